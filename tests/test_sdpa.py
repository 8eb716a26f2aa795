"""``F.scaled_dot_product_attention`` on shardtensor's device reaches ``__torch_dispatch__`` as one op,
``_scaled_dot_product_fused_attention_overrideable`` (the C++ extension answers torch's backend
choice), lowered as einsums over (batch, heads) (shardtensor/ops/fused_attention.py): values and
gradients equal eager torch's on CPU; one op instead of torch's matmul/bmm chain; and with heads split
over "tp" no all-gather of the heads (torch's math path, still reachable with ``sdpa_kernel``, has it).
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import shardtensor as st
from tensor_helpers import MESH_42

aten = torch.ops.aten
FUSED = aten._scaled_dot_product_fused_attention_overrideable.default
FUSED_BACKWARD = aten._scaled_dot_product_fused_attention_overrideable_backward.default
B, L, S, E = 4, 6, 5, 8


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _bool_mask():
    """(B, 1, L, S) keep-mask with one row whose every key is masked (output 0, as torch's CPU kernel)."""
    keep = torch.rand(B, 1, L, S, generator=_gen(5)) > 0.4
    keep[1, 0, 2] = False
    return keep


CASES = {  # name: (query heads, key/value heads, sdpa keyword arguments)
    "plain": (2, 2, {}),
    "causal": (2, 2, {"is_causal": True}),
    "scale": (2, 2, {"scale": 0.3}),
    "float_mask_broadcast": (2, 2, {"attn_mask": torch.randn(L, S, generator=_gen(3))}),
    "bool_mask_empty_row": (2, 2, {"attn_mask": _bool_mask()}),
    "gqa_causal": (4, 2, {"is_causal": True, "enable_gqa": True}),
    "gqa_mask_per_head": (4, 2, {"attn_mask": torch.randn(1, 4, L, S, generator=_gen(4)), "enable_gqa": True}),
}


def _inputs(hq, hk, dtype, causal):
    s = L if causal else S
    q = torch.randn(B, hq, L, E, generator=_gen(0)).to(dtype)
    k = torch.randn(B, hk, s, E, generator=_gen(1)).to(dtype)
    v = torch.randn(B, hk, s, E + 2, generator=_gen(2)).to(dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def _sharded(t):
    """``t`` batch-split over "x" and heads over "y" (a leaf that requires grad)."""
    return st.shard(t.detach(), MESH_42, ("x", "y", None, None)).requires_grad_()


def _compare(hq, hk, kwargs, dtype, tol):
    q, k, v = _inputs(hq, hk, dtype, kwargs.get("is_causal", False))
    mask = kwargs.get("attn_mask")
    mask = mask.clone().requires_grad_() if mask is not None and mask.is_floating_point() else mask
    want = F.scaled_dot_product_attention(q, k, v, **{**kwargs, "attn_mask": mask})
    grad = torch.randn(want.shape, generator=_gen(9)).to(dtype)
    want.backward(grad)
    dq, dk, dv = (_sharded(t) for t in (q, k, v))
    dmask = None if mask is None else mask.detach().to(st.device()).requires_grad_(mask.requires_grad)
    got = F.scaled_dot_product_attention(dq, dk, dv, **{**kwargs, "attn_mask": dmask})
    got.backward(grad.to(st.device()))
    torch.testing.assert_close(got.cpu(), want, **tol)
    for name, mine, theirs in (("q", dq, q), ("k", dk, k), ("v", dv, v), ("mask", dmask, mask)):
        if theirs is not None and theirs.requires_grad:
            torch.testing.assert_close(mine.grad.cpu(), theirs.grad, **tol, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_match_eager_float32(case):
    hq, hk, kwargs = CASES[case]
    _compare(hq, hk, kwargs, torch.float32, {"rtol": 1e-5, "atol": 1e-5})


@pytest.mark.parametrize("case", ["causal", "gqa_mask_per_head"])
def test_values_and_gradients_match_eager_bfloat16(case):
    hq, hk, kwargs = CASES[case]
    _compare(hq, hk, kwargs, torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2})


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _backends(math_only):
    """torch's default backend choice, or its math path only (what shardtensor took before)."""
    return sdpa_kernel([SDPBackend.MATH]) if math_only else contextlib.nullcontext()


def _ops_of_forward_and_backward(math_only=False):
    q, k, v = (_sharded(t) for t in _inputs(2, 2, torch.float32, True))
    log = _OpLog()
    with _backends(math_only), log:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    st.sync()
    return [op for op in log.ops if op.namespace == "aten"]


def test_one_op_forward_and_backward():
    ops = _ops_of_forward_and_backward()
    assert ops.count(FUSED) == 1 and ops.count(FUSED_BACKWARD) == 1
    assert not {aten.bmm.default, aten.mm.default, aten._safe_softmax.default} & set(ops), ops
    # torch's math path (what shardtensor took before) is still there on request
    math_ops = _ops_of_forward_and_backward(math_only=True)
    assert FUSED not in math_ops and aten.bmm.default in math_ops


def test_dropout_takes_the_math_path_and_the_op_refuses_it():
    q, k, v = (_sharded(t) for t in _inputs(2, 2, torch.float32, False))
    log = _OpLog()
    with log:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert FUSED not in log.ops and out.shape == (B, 2, L, E + 2)
    st.sync()
    with pytest.raises(NotImplementedError, match="dropout_p > 0"):
        FUSED(q, k, v, None, 0.5)


def _attention_step(q, k, v):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (out * out).sum().backward()
    return out


def _all_gathers(math_only=False):
    """The all-gathers of forward + backward with batch over "x" and heads over "y" (as tensor parallelism)."""
    q, k, v = (
        st.shard(torch.randn(8, 4, 16, 8, generator=_gen(i)), MESH_42, ("x", "y", None, None)).requires_grad_()
        for i in range(3)
    )
    with _backends(math_only):
        ex = st.explain(_attention_step, q, k, v)
    st.sync()
    return [op.result_type.split("{")[0] for op in ex.ops if op.kind == "all-gather"]


def test_heads_split_over_tp_stay_split():
    assert _all_gathers() == []
    # torch's math path flattens (batch, heads) for bmm and gathers q, k and v's heads (2 rows, all 4 heads)
    assert _all_gathers(math_only=True).count("f32[2,4,16,8]") >= 2
