"""Reduction, scan and softmax lowerings against eager torch on CPU."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _lowering_harness import Batch, call, make  # noqa: E402

aten = torch.ops.aten
F32, F64, BF16, I64, I32, BOOL, U8 = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
)
F16, C64 = torch.float16, torch.complex64
NAN, INF = float("nan"), float("inf")
DIMS = [None, [], [1], [-1], [2, 0]]


@pytest.mark.parametrize("dtype", [F32, F64, BF16, I64, I32, BOOL])
def test_sum_mean_prod(dtype):
    x = make((3, 4, 5), dtype, low=-3, high=4)
    with Batch() as b:
        b.check(aten.sum.default, x)
        b.check(aten.sum.default, x, dtype=F64)
        b.check(aten.prod.default, make((6,), dtype, low=1, high=3))
        b.check(aten.nansum.default, x)
        b.check(aten.count_nonzero.default, x)
        b.check(aten.count_nonzero.dim_IntList, x, [0, 2])
        for dim in DIMS:
            for keepdim in (False, True):
                b.check(aten.sum.dim_IntList, x, dim, keepdim)
                if dtype.is_floating_point:
                    b.check(aten.mean.dim, x, dim, keepdim)
                b.check(aten.amax.default, x, dim or [], keepdim)
                b.check(aten.amin.default, x, dim or [], keepdim)
        b.check(aten.sum.dim_IntList, x, [1], dtype=F32)
        b.check(aten.mean.dim, x, [1], True, dtype=F64)
        for dim in (0, -1):
            b.check(aten.prod.dim_int, x, dim)
            b.check(aten.prod.dim_int, x, dim, True, dtype=F64)
        if dtype.is_floating_point:
            b.check(aten.mean.default, x)


def test_reductions_of_0d_and_nan():
    nan = float("nan")
    s = torch.tensor(2.5)
    x = torch.tensor([[1.0, nan, 3.0], [nan, nan, -1.0], [2.0, 5.0, 0.0]])
    with Batch() as b:
        b.check(aten.sum.dim_IntList, s, [0])
        b.check(aten.amax.default, s, [0])
        b.check(aten.max.dim, s, 0)
        b.check(aten.argmax.default, s, 0)
        b.check(aten.cumsum.default, s, 0)
        b.check(aten._softmax.default, s, 0, False)
        for dtype in (F32, BF16):
            xd = x.to(dtype)
            b.check(aten.nansum.default, xd, [1])
            b.check(aten.max.default, xd)
            b.check(aten.min.default, xd)
            b.check(aten.amax.default, xd, [1])
            b.check(aten.amin.default, xd, [0])
            b.check(aten.argmax.default, xd, 1)
            b.check(aten.argmin.default, xd, 0)
            b.check(aten.max.dim, xd, 1)
            b.check(aten.min.dim, xd, 0, True)
            b.check(aten.cummax.default, xd, 1)
            b.check(aten.cummin.default, xd, 0)
            b.check(aten.aminmax.default, xd)
            b.check(aten.aminmax.default, xd, dim=1, keepdim=True)
            b.check(aten.logsumexp.default, xd, [1])


@pytest.mark.parametrize("dtype", [F32, F64, BF16, I64, BOOL])
def test_max_min_argmax(dtype):
    x = make((4, 6), dtype, low=-3, high=3)  # plenty of ties: first index wins
    with Batch() as b:
        b.check(aten.max.default, x)
        b.check(aten.min.default, x)
        b.check_or_skip(aten.argmax.default, x)
        b.check_or_skip(aten.argmin.default, x)
        for dim in (0, 1, -1):
            for keepdim in (False, True):
                b.check(aten.max.dim, x, dim, keepdim)
                b.check(aten.min.dim, x, dim, keepdim)
                b.check_or_skip(aten.argmax.default, x, dim, keepdim)
                b.check_or_skip(aten.argmin.default, x, dim, keepdim)
        b.check(aten.aminmax.default, x, dim=0)
        if dtype != BOOL:
            b.check(aten.cummax.default, x, 1)
            b.check(aten.cummin.default, x, 0)


@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_var_std(dtype):
    x = make((3, 4, 5), dtype)
    with Batch() as b:
        for dim in (None, [1], [0, 2]):
            for correction in (None, 0, 2.5):
                for keepdim in (False, True):
                    kw = dict(correction=correction, keepdim=keepdim)
                    b.check(aten.var.correction, x, dim, **kw)
                    b.check(aten.std.correction, x, dim, **kw)
                    b.check(aten.var_mean.correction, x, dim, **kw)
                    b.check(aten.std_mean.correction, x, dim, **kw)
        b.check(aten.var.correction, x)
        b.check(aten.var.correction, make((1, 3), dtype), [0])  # n - correction = 0: nan/inf as torch


@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_norms(dtype):
    x = make((3, 4, 5), dtype)
    x[0, 0, :2] = 0
    with Batch() as b:
        for ord in (2, 1, 0, 3, 0.5, float("inf"), float("-inf"), -1):
            b.check(aten.linalg_vector_norm.default, x, ord)
            b.check(aten.linalg_vector_norm.default, x, ord, [1, 2], True)
        b.check(aten.linalg_vector_norm.default, x, 2, None, False, dtype=F64)
        b.check(aten.linalg_vector_norm.default, x, 2, [])
        b.check(aten.norm.Scalar, x)
        b.check(aten.norm.Scalar, x, 1)
        b.check(aten.norm.ScalarOpt_dim, x, 2, [1])
        b.check(aten.norm.ScalarOpt_dim, x, None, [0, 1], True)
        b.check(aten.norm.ScalarOpt_dim_dtype, x, 2, [1], False, dtype=F64)
        b.check(aten.norm.ScalarOpt_dtype, x, 3, dtype=F64)


def test_any_all():
    with Batch() as b:
        for dtype in (BOOL, F32, I64, U8):
            x = make((3, 4), dtype, low=0, high=2)
            for op in (aten.any, aten.all):
                b.check(op.default, x)
                b.check(op.dim, x, 1)
                b.check(op.dim, x, 0, True)
                b.check(op.dims, x)
                b.check(op.dims, x, [0, 1], True)
                b.check(op.dims, x, [])
                b.check(op.dims, x, [1])


@pytest.mark.parametrize("dtype", [F32, F64, BF16, I64, BOOL])
def test_scans(dtype):
    x = make((3, 5), dtype, low=-2, high=3)
    with Batch() as b:
        for dim in (0, 1, -1):
            b.check(aten.cumsum.default, x, dim)
            b.check(aten.cumprod.default, x, dim)
            b.check(aten.cumsum.default, x, dim, dtype=F64)
            if dtype.is_floating_point:
                b.check(aten.logcumsumexp.default, x, dim)
                b.check(aten.logsumexp.default, x, [dim])
                b.check(aten.logsumexp.default, x, [dim], True)
        b.check(aten.logsumexp.default, x, [0, 1])


def test_logsumexp_infinities():
    inf = float("inf")
    x = torch.tensor([[inf, 1.0], [-inf, -inf], [-inf, 2.0], [inf, -inf]])
    with Batch() as b:
        b.check(aten.logsumexp.default, x, [1])
        b.check(aten.logcumsumexp.default, x, 1)


@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_softmax(dtype):
    x = make((3, 4, 5), dtype, low=-5, high=5)
    masked = x.clone()
    masked[0, 1, :] = float("-inf")
    masked[1, :, 2] = float("-inf")
    # torch's bfloat16 log_softmax rounds the sum of exponentials to bfloat16 before its log (one
    # ulp less accurate than us at times)
    tol = dict(atol=1e-2, rtol=2e-2) if dtype == BF16 else {}
    with Batch() as b:
        for dim in (0, 1, -1):
            b.check(aten._softmax.default, x, dim, False)
            b.check(aten._log_softmax.default, x, dim, False, **tol)
            b.check(aten._safe_softmax.default, masked, dim)
            y = aten._softmax.default(x, dim, False)
            ly = aten._log_softmax.default(x, dim, False)
            g = make((3, 4, 5), dtype, seed=4)
            b.check(aten._softmax_backward_data.default, g, y, dim, dtype)
            b.check(aten._log_softmax_backward_data.default, g, ly, dim, dtype)
        b.check(aten._softmax.default, masked, -1, False)  # a fully masked row gives nan, as torch
        b.check(aten._safe_softmax.default, masked, -1, F32)


def test_softmax_half_to_float():
    # half_to_float is a CUDA feature in torch; check against the float computation
    x = make((2, 5), BF16)
    from _lowering_harness import call, to_torch

    got = to_torch(call(aten._softmax.default, x, -1, True))
    assert got.dtype == F32
    torch.testing.assert_close(got, torch.softmax(x.float(), -1))
    got = to_torch(call(aten._log_softmax.default, x, -1, True))
    torch.testing.assert_close(got, torch.log_softmax(x.float(), -1))


# ----------------------------------------------------------------------------------------------
# hash_tensor
# ----------------------------------------------------------------------------------------------
def test_hash_tensor():
    x = make((3, 4, 5), F64, low=-100, high=100, seed=5)
    with Batch() as b:
        for dt in (F32, F64, F16, BF16, I64, I32, torch.int16, torch.int8, U8, BOOL):
            y = x.to(dt) if dt != BOOL else x > 0
            b.check(aten.hash_tensor.default, y)
            for dim in ([0], [1], [-1], [0, 2], []):
                b.check(aten.hash_tensor.default, y, dim)
                b.check(aten.hash_tensor.default, y, dim, keepdim=True)
        # NaN payloads and signs, signed zero and infinities are hashed by their bits
        odd_nan = torch.tensor([0x7FC00001, -0x400000], dtype=I32).view(F32)
        b.check(aten.hash_tensor.default, torch.cat([odd_nan, torch.tensor([NAN, -NAN, 0.0, -0.0, INF])]))
        b.check(aten.hash_tensor.default, torch.tensor(2.5))
        b.check(aten.hash_tensor.default, torch.tensor(2.5), [0], keepdim=True)
        b.check(aten.hash_tensor.default, torch.empty(0, 3), [1])
        b.check(aten.hash_tensor.default, torch.empty(0, 3), [1], keepdim=True)


def test_hash_tensor_errors():
    with pytest.raises(RuntimeError, match="mode"):
        call(aten.hash_tensor.default, torch.ones(3), mode=1)
    with pytest.raises(RuntimeError, match="reduction dim to be specified"):
        call(aten.hash_tensor.default, torch.empty(0, 3))
    with pytest.raises(RuntimeError, match="non-zero size"):
        call(aten.hash_tensor.default, torch.empty(0, 3), [0])
    with pytest.raises(RuntimeError, match="xor_sum"):
        call(aten.hash_tensor.default, torch.ones(3, dtype=C64))
