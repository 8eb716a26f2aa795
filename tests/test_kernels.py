"""Issue 17 §4: Pallas kernels (shardtensor.kernels) — a fused SiLU and flash attention, forward and
backward, in Pallas' interpret mode on CPU.

The JAX-level kernels are checked against eager torch (``F.silu``, ``F.scaled_dot_product_attention``
and their autograd) and the attention gradients also against ``jax.grad`` of a plain jnp attention;
the torch-level ops (through ``st.jax_op``) on ShardedTensors in lazy, eager and ``st.compile`` modes.
Interpretation is slow: shapes are tiny, and each case is one program (forward and backward jitted
together)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from _training_helpers import mesh_4x2, reset_state
from shardtensor.kernels import flash_attention_jax, resolve_interpret, silu_jax


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    yield
    reset_state()


def _randn(seed, *shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _jnp(t: torch.Tensor):
    return jnp.asarray(t.numpy())


def _torch(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a))  # a writable copy


def _torch_attention(q, k, v, causal, scale, do):
    """F.scaled_dot_product_attention's output and (dq, dk, dv) for the cotangent ``do``."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _jnp_attention(q, k, v, causal, scale):
    """Plain jnp attention, is_causal's top-left aligned mask; scale defaults to 1/sqrt(head_dim)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def test_interpret_is_chosen_by_backend_and_can_be_forced():
    assert resolve_interpret(None) is (jax.default_backend() == "cpu")
    assert resolve_interpret(True) is True and resolve_interpret(False) is False
    with pytest.raises(TypeError, match="interpret must be True, False or None"):
        resolve_interpret("yes")


def test_silu_jax_forward_and_backward_match_torch():
    x = _randn(0, 3, 50, 7)  # 1050 elements: one whole block of 8x128 and a padded one
    g = _randn(1, 3, 50, 7)
    y, dx = jax.jit(lambda x, g: (silu_jax(x), jax.vjp(silu_jax, x)[1](g)[0]))(_jnp(x), _jnp(g))
    xr = x.clone().requires_grad_()
    ref = F.silu(xr)
    ref.backward(g)
    torch.testing.assert_close(_torch(y), ref.detach())
    torch.testing.assert_close(_torch(dx), xr.grad)


# (batch, heads, seq_q, seq_k, head_dim, head_dim_v, causal, scale, block_q, block_k)
ATTENTION_CASES = {
    "causal-unequal-blocks": (1, 2, 16, 16, 8, 8, True, None, 8, 4),  # key blocks above the diagonal skipped
    "padded-cross": (1, 2, 12, 20, 8, 4, False, 0.3, None, None),  # seq_q != seq_k, padded keys masked
}


@pytest.mark.parametrize("case", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_flash_attention_jax_forward_and_backward_match_torch_and_jnp(case):
    b, h, lq, lk, d, dv, causal, scale, bq, bk = case
    q, k, v, do = _randn(1, b, h, lq, d), _randn(2, b, h, lk, d), _randn(3, b, h, lk, dv), _randn(4, b, h, lq, dv)

    def attention(q, k, v):
        return flash_attention_jax(q, k, v, causal=causal, scale=scale, block_q=bq, block_k=bk)

    @jax.jit
    def forward_and_backward(q, k, v, do):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, *vjp(do)

    got = [_torch(a) for a in forward_and_backward(*map(_jnp, (q, k, v, do)))]
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, _torch_attention(q, k, v, causal, scale, do)):
        torch.testing.assert_close(g, r, msg=lambda m, name=name: f"{name}: {m}")
    # the custom_vjp's gradients against jax.grad of plain jnp attention
    plain = jax.vjp(lambda q, k, v: _jnp_attention(q, k, v, causal, scale), *map(_jnp, (q, k, v)))[1](_jnp(do))
    for name, g, r in zip(("dq", "dk", "dv"), got[1:], plain):
        torch.testing.assert_close(g, _torch(r), msg=lambda m, name=name: f"{name} vs jnp: {m}")


def test_flash_attention_jax_bad_input_says_what_to_do():
    q = jnp.zeros((1, 2, 12, 8))
    with pytest.raises(ValueError, match=r"block_q=8 does not divide the sequence length 12.*block_q=None"):
        flash_attention_jax(q, q, q, block_q=8)
    with pytest.raises(ValueError, match=r"\(batch, heads, seq, head_dim\)"):
        flash_attention_jax(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="same head_dim"):
        flash_attention_jax(q, q[..., :4], q)
    with pytest.raises(ValueError, match="agree on \\(batch, heads\\)"):
        flash_attention_jax(q, q[:, :1], q[:, :1])
    with pytest.raises(TypeError, match="floating-point"):
        flash_attention_jax(q.astype(jnp.int32), q, q)
    with pytest.raises(ValueError, match="block_rows must be a positive int"):
        silu_jax(q, block_rows=0)


# ---- the torch-level ops, through st.jax_op -------------------------------------------------------


def _torch_level_inputs():
    """q, k, v (batch 4, heads 2, seq 8, head_dim 8), x for SiLU, and weights for a scalar loss."""
    q, k, v = _randn(10, 4, 2, 8, 8), _randn(11, 4, 2, 8, 8), _randn(12, 4, 2, 8, 8)
    x = _randn(13, 8, 24)
    weights = _randn(14, 4, 2, 8, 8), _randn(15, 4, 2, 8, 8), _randn(16, 8, 24)
    return (q, k, v, x), weights


PLAIN = {"block_q": 4, "block_k": 4}  # two blocks each way: the online softmax across key blocks
CAUSAL = {"causal": True, "scale": 0.5}  # default blocks: one block of 16, half of it padding


def _step(attention, silu, weights, variants):
    """Attention with each of ``variants`` (keyword arguments) and SiLU, a weighted loss, and the
    gradients of q, k, v and x."""

    def step(q, k, v, x):
        outs = [attention(q, k, v, **kwargs) for kwargs in variants] + [silu(x)]
        loss = sum((out * w).sum() for out, w in zip(outs, [*weights[: len(variants)], weights[2]]))
        return (*outs, *torch.autograd.grad(loss, (q, k, v, x)))

    return step


def _torch_reference(inputs, weights, variants):
    def sdpa(q, k, v, causal=False, scale=None, block_q=None, block_k=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    leaves = [t.clone().requires_grad_() for t in inputs]
    return [t.detach() for t in _step(sdpa, F.silu, weights, variants)(*leaves)]


# Each mode runs its own programs of interpreted kernels (slow): lazy checks both attentions, eager
# and st.compile one each.
MODES = {"lazy": [PLAIN, CAUSAL], "eager": [CAUSAL], "compile": [PLAIN]}


@pytest.mark.parametrize("mode", MODES)
def test_torch_ops_on_sharded_tensors_match_torch(mode):
    """st.kernels.flash_attention (plain and causal) and st.kernels.silu on ShardedTensors, forward
    and backward, against F.scaled_dot_product_attention and F.silu."""
    mesh = mesh_4x2()
    inputs, weights = _torch_level_inputs()
    specs = [("data", "model", None, None)] * 3 + [("data", None)]
    sharded = [st.shard(t, mesh, s).requires_grad_() for t, s in zip(inputs, specs)]
    sharded_weights = [st.shard(w, mesh, s) for w, s in zip(weights, (specs[0], specs[0], specs[3]))]
    step = _step(st.kernels.flash_attention, st.kernels.silu, sharded_weights, MODES[mode])
    if mode == "compile":
        step = st.compile(step)
    with st.eager_mode(mode == "eager"):
        got = step(*sharded)
    names = [f"attention {kwargs}" for kwargs in MODES[mode]] + ["silu", "dq", "dk", "dv", "dx"]
    for name, g, r in zip(names, got, _torch_reference(inputs, weights, MODES[mode]), strict=True):
        torch.testing.assert_close(g.cpu(), r, msg=lambda m, name=name: f"{name}: {m}")


def test_flash_attention_per_shard_over_batch_and_heads():
    """With mesh and spec the kernel runs on each device's (1, 1, seq, head_dim) block, under shard_map."""
    mesh = mesh_4x2()
    spec = ("data", "model", None, None)
    (q, k, v, _), (w, _, _) = _torch_level_inputs()
    sq, sk, sv = (st.shard(t, mesh, spec).requires_grad_() for t in (q, k, v))
    out = st.kernels.flash_attention(sq, sk, sv, causal=True, mesh=mesh, spec=spec)
    (out * st.shard(w, mesh, spec)).sum().backward()
    ref = _torch_attention(q, k, v, True, None, w)
    for name, g, r in zip(("out", "dq", "dk", "dv"), (out, sq.grad, sk.grad, sv.grad), ref):
        torch.testing.assert_close(g.cpu(), r, msg=lambda m, name=name: f"{name}: {m}")
    with pytest.raises(ValueError, match="shard only batch and heads"):
        st.kernels.flash_attention(sq, sk, sv, mesh=mesh, spec=("data", None, "model", None))
    with pytest.raises(ValueError, match="give both mesh and spec"):
        st.kernels.silu(sq, mesh=mesh)
