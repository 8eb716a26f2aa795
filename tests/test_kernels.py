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

from _training_helpers import reset_state
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
    "several-blocks": (2, 2, 16, 16, 8, 8, False, None, 8, 8),
    "causal-unequal-blocks": (1, 2, 16, 16, 8, 8, True, None, 8, 4),  # key blocks above the diagonal skipped
    "causal-padded-cross": (1, 2, 12, 20, 8, 4, True, 0.3, None, None),  # seq_q != seq_k, both padded
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
