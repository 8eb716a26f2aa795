"""Issue 48 §6: ``torch.autocast`` on the device, bfloat16 and float16, in every mode.

**Which lists the device follows: PyTorch/XLA's** (``torch.autocast('xla')`` on a TPU, see
``shardtensor/tensor/autocast.py``): torch's CPU lists with PyTorch/XLA's changes — ``relu``,
``max_pool2d`` and ``einsum`` in the lower precision, ``softmax``, ``log_softmax``, ``batch_norm`` and
``pow(Tensor, Scalar)`` in float32 — without the CPU-only entries that exist for CPU kernels' limits.
They are the lists the code users bring from PyTorch/XLA was tuned with, on the chip shardtensor runs
on; CUDA's lists (torch's other family) cast far more ops to float32 (exp, log, sum, layer_norm ...).

**The reference** is eager torch on the CPU under ``torch.autocast("cpu", dtype=...)``; for the eight
ops PyTorch/XLA changes, the CPU's autocast is given the same policy for the test
(``cpu_autocast_like_the_device``: the op's CPU tensors cast as the policy says, then torch's own CPU
op), so every op's output dtype is compared exactly and its value at the autocast dtype's tolerance.
A training run is compared by its losses at that tolerance and its gradients by their norm, as bf16
differs from another bf16 implementation by rounding (XLA keeps excess precision inside fusions).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from _training_helpers import reset_state
from shardtensor.tensor import autocast as device_autocast

DEV = st.device()
LOW = (torch.bfloat16, torch.float16)

# PyTorch/XLA's changes to torch's CPU lists, and the CPU entries it (and the device) leaves out
XLA_CHANGES = {
    "relu": "lower",
    "max_pool2d": "lower",
    "einsum": "lower",
    "batch_norm": "fp32",
    "_softmax": "fp32",
    "softmax.int": "fp32",
    "log_softmax.int": "fp32",
    "pow.Tensor_Scalar": "fp32",
}
CPU_ONLY = {  # for CPU kernels' limits (bfloat16 3-d pooling, mkldnn), or CPU-internal ops
    "_addmm_activation",
    "_convolution.deprecated",
    "_grid_sampler_2d_cpu_fallback",
    "_native_multi_head_attention",
    "adaptive_avg_pool3d",
    "adaptive_max_pool3d",
    "avg_pool3d",
    "fractional_max_pool2d",
    "fractional_max_pool3d",
    "linalg_vecdot",
    "max_pool3d",
    "max_unpool2d",
    "max_unpool3d",
    "mkldnn_rnn_layer",
}


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    yield
    reset_state()


def _cpu_kernel(op, policy):
    off = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def kernel(*args, **kwargs):
        to = torch.get_autocast_dtype("cpu") if policy == "lower" else torch.float32

        def cast(a):
            if isinstance(a, (list, tuple)):
                return type(a)(cast(t) for t in a)
            if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype is not torch.float64:
                return a.to(to)
            return a

        with torch._C._ExcludeDispatchKeyGuard(off):
            return op(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})

    return kernel


@contextlib.contextmanager
def cpu_autocast_like_the_device(dtype):
    """``torch.autocast("cpu", dtype)`` with PyTorch/XLA's eight changes, for this block only."""
    with torch.library._scoped_library("aten", "IMPL") as lib:
        for name, policy in XLA_CHANGES.items():
            base, _, overload = name.partition(".")
            lib.impl(
                name, _cpu_kernel(getattr(getattr(torch.ops.aten, base), overload or "default"), policy), "AutocastCPU"
            )
        with torch.autocast("cpu", dtype=dtype):
            yield


def autocast_on(device, dtype):
    return cpu_autocast_like_the_device(dtype) if device == "cpu" else torch.autocast(DEV.type, dtype=dtype)


RTOL = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3}  # torch's own tolerances for the dtype


def assert_like(actual, expected, what=""):
    """Same dtype exactly; values at the tolerance of a low-precision dtype: torch's relative one,
    and as absolute one the same fraction of the largest value (one sum rounded in the low dtype at
    another step — addbmm's batches — moves a small element by an ulp of the large ones)."""
    assert actual.dtype == expected.dtype, f"{what}: {actual.dtype} where torch gives {expected.dtype}"
    actual = actual.cpu()
    if expected.dtype in RTOL:
        rtol = RTOL[expected.dtype]
        atol = rtol * float(expected.abs().max()) if expected.numel() else 0.0
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}")


# --- the lists ------------------------------------------------------------------------------------
def test_lists_are_torchs_cpu_lists_with_pytorch_xlas_changes():
    names = torch._C._dispatch_get_all_op_names()
    cpu = {n.removeprefix("aten::") for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCPU")}
    device = {
        n.removeprefix("aten::")
        for n in names
        if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastPrivateUse1")
    }
    assert device == (cpu - CPU_ONLY) | set(XLA_CHANGES)
    assert all(device_autocast.POLICIES[name] == policy for name, policy in XLA_CHANGES.items())
    # every other op falls through: it runs in the dtypes it is given
    x = torch.randn(4, 4, device=DEV)
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        assert (x.bfloat16() + x).dtype == torch.float32 and F.gelu(x.bfloat16()).dtype == torch.bfloat16


# --- one op at a time -----------------------------------------------------------------------------
def _op_cases(low):
    """name -> (function, inputs): CPU float32 inputs, and ``low`` ones where the op's input is
    usually an autocast result."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    a, b, v = r(6, 5), r(5, 7), r(5)
    a3, b3 = r(2, 6, 5), r(2, 5, 4)
    img, w = r(2, 3, 8, 8), r(4, 3, 3, 3)
    logits, target = r(6, 5), torch.randint(0, 5, (6,), generator=g)
    q, k, val = r(2, 2, 4, 8), r(2, 2, 4, 8), r(2, 2, 4, 8)
    mean, var = r(3), r(3).abs() + 0.5
    bf = r(6, 5, dtype=low)
    return {
        # lower precision
        "mm": (torch.mm, a, b),
        "matmul @": (lambda x, y: x @ y, a, b),
        "addmm": (torch.addmm, r(7), a, b),
        "bmm": (torch.bmm, a3, b3),
        "baddbmm": (torch.baddbmm, r(2, 6, 4), a3, b3),
        "addbmm": (torch.addbmm, r(6, 4), a3, b3),
        "linear": (F.linear, a, r(3, 5), r(3)),
        "conv1d": (F.conv1d, r(2, 3, 9), r(4, 3, 3)),
        "conv2d": (F.conv2d, img, w, r(4)),
        "conv2d same": (lambda x, y: F.conv2d(x, y, padding="same"), img, w),
        "conv_transpose2d": (F.conv_transpose2d, img, r(3, 2, 3, 3)),
        "prelu": (F.prelu, a, r(1)),
        "relu (PyTorch/XLA)": (F.relu, a),
        "max_pool2d (PyTorch/XLA)": (lambda x: F.max_pool2d(x, 2), img),
        "einsum (PyTorch/XLA)": (lambda x, y: torch.einsum("ij,jk->ik", x, y), a, b),
        "sdpa": (F.scaled_dot_product_attention, q, k, val),
        # float32
        "softmax (PyTorch/XLA)": (lambda x: x.softmax(-1), bf),
        "log_softmax (PyTorch/XLA)": (lambda x: F.log_softmax(x, -1), bf),
        "softmax dtype=": (lambda x: x.softmax(-1, dtype=torch.float64), bf),
        "batch_norm (PyTorch/XLA)": (lambda x, m, s: F.batch_norm(x, m, s), r(4, 3, dtype=low), mean, var),
        "pow (PyTorch/XLA)": (lambda x: x**2, bf),
        "prod": (lambda x: x.prod(-1), bf),
        "cdist": (torch.cdist, bf, r(4, 5)),
        "cross_entropy": (F.cross_entropy, logits.to(low), target),
        "nll_loss": (F.nll_loss, logits.to(low), target),
        "mse_loss": (F.mse_loss, bf, a),
        "l1_loss": (F.l1_loss, bf, a),
        "smooth_l1_loss": (F.smooth_l1_loss, bf, a),
        "kl_div": (lambda x, y: F.kl_div(x, y, reduction="batchmean"), bf, a.softmax(-1)),
        "bce_with_logits": (F.binary_cross_entropy_with_logits, bf, a.sigmoid()),
        "binary_cross_entropy": (F.binary_cross_entropy, bf.sigmoid(), a.sigmoid()),
        "trace": (torch.trace, bf),
        "reflection pad": (lambda x: F.pad(x, (1, 1, 1, 1), mode="reflect"), img.to(low)),
        # promote: the widest floating type
        "cat bf16+fp32": (lambda x, y: torch.cat([x, y]), bf, a),
        "cat bf16+bf16": (lambda x, y: torch.cat([x, y]), bf, bf),
        "stack": (lambda x, y: torch.stack([x, y]), bf, a),
        "index_copy": (lambda x, s: x.index_copy(0, torch.tensor([1, 3]).to(x.device), s), a, r(2, 5, dtype=low)),
        # not cast: float64, integers, in-place and unlisted ops
        "mm float64": (torch.mm, a.double(), b.double()),
        "mm integers": (torch.mm, torch.ones(2, 3, dtype=torch.long), torch.ones(3, 2, dtype=torch.long)),
        "addmm_ in place": (lambda x, y, z: x.clone().addmm_(y, z), r(6, 7), a, b),
        "layer_norm": (lambda x, w_, b_: F.layer_norm(x, (5,), w_, b_), bf, r(5), r(5)),
        "gelu": (F.gelu, bf),
        "matvec": (torch.mv, a, v),
    }


@pytest.mark.parametrize("dtype", LOW)
def test_each_op_as_torch_autocast_casts_it(dtype):
    """Output dtypes exactly as torch's CPU autocast (with PyTorch/XLA's changes), values at the
    dtype's tolerance; all cases record into one lazy program."""
    cases = _op_cases(dtype)
    expected, outputs = {}, {}
    with cpu_autocast_like_the_device(dtype):
        for name, (fn, *args) in cases.items():
            expected[name] = fn(*args)
    with torch.autocast(DEV.type, dtype=dtype):
        for name, (fn, *args) in cases.items():
            outputs[name] = fn(*[t.to(DEV) for t in args])
    for name in cases:
        assert_like(outputs[name], expected[name], name)


def test_a_promoting_op_refuses_the_other_low_dtype_as_torch_does():
    """float16 met before any float32 in a bfloat16 region: torch raises (float32 first wins)."""
    half, full = torch.randn(2, 3).half(), torch.randn(2, 3)
    for device, region in (("cpu", torch.autocast("cpu", dtype=torch.bfloat16)), (DEV, st.autocast())):
        with region:
            with pytest.raises(RuntimeError):
                torch.cat([half.to(device), full.to(device)])
            assert torch.cat([full.to(device), half.to(device)]).dtype == torch.float32
