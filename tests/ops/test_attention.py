"""Attention lowerings (shardtensor/ops/attention.py: scaled dot-product attention, CPU flash kernel) against
eager torch on CPU, forward and backward ops."""

import pytest
import torch
import torch.nn.functional as F

from _lowering_harness import BF16, assert_same, aten, check, deferred_checks, lower, randn, run, to_jax  # noqa: F401  (the deferred_checks fixture)

torch.manual_seed(0)


r = randn  # float32 normal samples


# ---------------------------------------------------------------------------------------- attention


def _sdpa_case(dtype, hq=2, hk=2, L=5, S=5, E=8, Ev=8):
    q = r(2, hq, L, E, dtype=dtype)
    k = r(2, hk, S, E, dtype=dtype)
    v = r(2, hk, S, Ev, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["plain", "causal", "mask", "gqa_causal_rect", "scale_masked_row"])
def test_sdpa_flash_cpu(dtype, kind):
    tol = BF16 if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
    mask, causal, scale = None, False, None
    if kind == "gqa_causal_rect":
        q, k, v = _sdpa_case(dtype, hq=4, hk=2, L=3, S=6)
        causal = True
    else:
        q, k, v = _sdpa_case(dtype)
    if kind == "causal":
        causal = True
    if kind in ("mask", "scale_masked_row"):
        mask = torch.randn(5, 5).to(dtype)
        if kind == "scale_masked_row":
            mask[2] = float("-inf")
            scale = 0.3
    out, lse = check(
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        q,
        k,
        v,
        0.0,
        causal,
        attn_mask=mask,
        scale=scale,
        **tol,
    )
    g = torch.randn_like(out)
    check(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        g,
        q,
        k,
        v,
        out,
        lse,
        0.0,
        causal,
        attn_mask=mask,
        scale=scale,
        **tol,
    )


def test_sdpa_matches_autograd_through_functional():
    q, k, v = (t.requires_grad_() for t in _sdpa_case(torch.float32))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    g = torch.randn_like(out)
    out.backward(g)
    fwd = lower(aten._scaled_dot_product_flash_attention_for_cpu.default)
    bwd = lower(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)

    def both(q, k, v, g):
        o, lse = fwd(q, k, v, 0.0, True)
        return o, bwd(g, q, k, v, o, lse, 0.0, True)

    o, grads = run(both, to_jax([q, k, v, g]), {})
    assert_same(o, out, rtol=1e-4, atol=1e-5)
    assert_same(grads, (q.grad, k.grad, v.grad), rtol=1e-4, atol=1e-5)
