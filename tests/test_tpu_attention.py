"""``F.scaled_dot_product_attention`` through JAX's Pallas splash kernel, the path a TPU takes where
the kernel applies (issue 36 §6; ``ops/tpu_attention.py``, chosen in ``dispatch/fused_attention.py``
when the op is recorded). Here on the CPU, with the platform check answered "tpu" and the kernel in
Pallas' interpret mode: values and gradients equal eager torch's, torch's SDPA backend choice turns
it off, and shapes it does not apply to keep XLA's attention. On the chip: tests/test_kernels_tpu.py.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import shardtensor as st
from _training_helpers import reset_state
from shardtensor.dispatch import fused_attention
from shardtensor.ops import tpu_attention


@pytest.fixture()
def as_on_a_tpu(monkeypatch):
    """The platform check says "tpu", and every call into the kernel is counted."""
    reset_state()
    calls = []
    attend = tpu_attention._attend
    monkeypatch.setattr(fused_attention, "_on_tpu", lambda: True)
    monkeypatch.setattr(tpu_attention, "_attend", lambda *a: calls.append(a[0].shape) or attend(*a))
    yield calls
    reset_state()


def _leaves(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).bfloat16().requires_grad_() for _ in range(3)]


def _both(ref, is_causal=True, scale=None):
    """(eager torch's output and gradients, shardtensor's), for one SDPA and a weighted sum."""
    w = torch.randn(ref[0].shape, generator=torch.Generator().manual_seed(9)).bfloat16()
    out = F.scaled_dot_product_attention(*ref, is_causal=is_causal, scale=scale)
    (out.float() * w.float()).sum().backward()
    mine = [t.detach().to(st.device()).requires_grad_() for t in ref]
    got = F.scaled_dot_product_attention(*mine, is_causal=is_causal, scale=scale)
    (got.float() * w.to(st.device()).float()).sum().backward()
    return [out] + [t.grad for t in ref], [got.cpu()] + [t.grad.cpu() for t in mine]


def _close(want, got):
    # bf16 results: a few units in the last place of each result's largest value
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        b = b.float()
        torch.testing.assert_close(a.float(), b, atol=2e-2 * b.abs().max().item(), rtol=2e-2, msg=name)


@pytest.mark.parametrize("is_causal", [True, False])
def test_splash_attention_equals_torch(as_on_a_tpu, is_causal):
    want, got = _both(_leaves((1, 2, 512, 64)), is_causal=is_causal)
    _close(want, got)
    assert len(as_on_a_tpu) >= 2  # forward and backward went through the kernel


def test_splash_attention_with_a_scale_and_longer_keys(as_on_a_tpu):
    q = torch.randn(1, 2, 512, 64, generator=torch.Generator().manual_seed(3)).bfloat16().requires_grad_()
    k, v = (torch.randn(1, 2, 640, 64, generator=torch.Generator().manual_seed(s)).bfloat16() for s in (4, 5))
    want, got = _both([q, k.requires_grad_(), v.requires_grad_()], scale=0.3)
    _close(want, got)
    assert as_on_a_tpu


def test_torchs_backend_choice_keeps_xla_attention(as_on_a_tpu):
    """Without the flash backend (torch.nn.attention.sdpa_kernel), the same SDPA is XLA's."""
    with sdpa_kernel([SDPBackend.OVERRIDEABLE, SDPBackend.MATH]):  # (MATH: for the CPU reference)
        want, got = _both(_leaves((1, 2, 512, 64)))
    _close(want, got)
    assert as_on_a_tpu == []


@pytest.mark.parametrize(
    "shape, dtype",
    [((1, 2, 256, 64), torch.bfloat16), ((1, 2, 520, 64), torch.bfloat16), ((1, 2, 512, 64), torch.float32)],
    ids=["short", "not-a-multiple-of-128", "float32"],
)
def test_where_the_kernel_does_not_apply_xla_computes_it(as_on_a_tpu, shape, dtype):
    ref = [t.detach().to(dtype).requires_grad_() for t in _leaves(shape)]
    want, got = _both(ref)
    _close(want, got)
    assert as_on_a_tpu == []


def test_a_mask_keeps_xla_attention(as_on_a_tpu):
    q, k, v = (t.detach() for t in _leaves((1, 2, 512, 64)))
    mask = torch.rand(512, 512, generator=torch.Generator().manual_seed(1)) > 0.3
    got = F.scaled_dot_product_attention(*(t.to(st.device()) for t in (q, k, v)), attn_mask=mask.to(st.device()))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=2e-2, rtol=2e-2)
    assert as_on_a_tpu == []


def test_off_a_tpu_xla_computes_it():
    reset_state()
    q, k, v = (t.detach() for t in _leaves((1, 2, 512, 64)))
    assert not fused_attention.splash_chosen(q, k, v, None, 0.0) or st.runtime.platform() == "tpu"


def test_the_ops_on_plain_cpu_tensors_compute_sdpa():
    """The two ops' CPU bodies (plain tensors, no shardtensor) are SDPA and its gradients."""
    q, k, v, g = (torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(s)) for s in range(4))
    out, lse = torch.ops.shardtensor.splash_attention(q, k, v, True, 0.5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.5)
    torch.autograd.backward(ref, g)
    torch.testing.assert_close(out, ref.detach())
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    grads = torch.ops.shardtensor.splash_attention_backward(g, q, k, v, True, 0.5)
    for a, b in zip(grads, leaves):
        torch.testing.assert_close(a, b.grad)
