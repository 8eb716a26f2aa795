"""Factory lowerings against eager torch on CPU (dtype inference included)."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _lowering_harness import Batch, dtypes, lookup, make, to_jax  # noqa: E402

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
CPU = dict(device=torch.device("cpu"), layout=torch.strided, pin_memory=False)


def test_full_zeros_ones_empty():
    with Batch() as b:
        for value in (3, 2.5, True, -1):
            b.check(aten.full.default, [2, 3], value)
            b.check(aten.full.default, [2, 3], value, dtype=BF16, **CPU)
            b.check(aten.full.default, [4], value, dtype=I32)
        for dtype in (None, F64, I64, BOOL):
            kw = {} if dtype is None else {"dtype": dtype}
            b.check(aten.zeros.default, [2, 3], **kw, **CPU)
            b.check(aten.ones.default, [3], **kw)
            # empty is zeros here; torch's values are garbage: shapes and dtypes only
            _check_empty(aten.empty.memory_format, [2, 2], memory_format=torch.contiguous_format, **kw)
            _check_empty(aten.empty_strided.default, [2, 3], [3, 1], **kw)
            _check_empty(aten.empty_permuted.default, [2, 3], [1, 0], **kw)
        b.check(aten.zeros.default, [])
        b.check(aten.ones.default, [0, 3])


def _check_empty(op, *args, **kwargs):
    want = op(*args, **kwargs)
    got = lookup(op).fn(*[to_jax(a) if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
    assert tuple(got.shape) == tuple(want.shape), (op, got.shape, want.shape)
    assert dtypes.to_torch(got.dtype) == want.dtype, (op, got.dtype, want.dtype)
    assert not got.any()


def test_like_and_new():
    with Batch() as b:
        for dtype in (F32, BF16, I64, BOOL):
            x = make((2, 3), dtype)
            b.check(aten.zeros_like.default, x)
            b.check(aten.ones_like.default, x)
            b.check(aten.ones_like.default, x, dtype=F64, **CPU)
            b.check(aten.full_like.default, x, 7)
            b.check(aten.full_like.default, x, 2.5, dtype=F32)
            b.check(aten.new_zeros.default, x, [4])
            b.check(aten.new_ones.default, x, [1, 2], dtype=I32)
            b.check(aten.new_full.default, x, [3], 5)
            b.check(aten.new_full.default, x, [3], 1.5, dtype=F64)
    for dtype in (BF16, I64):
        x = make((2, 3), dtype)
        _check_empty(aten.empty_like.default, x)
        _check_empty(aten.empty_like.default, x, dtype=F64)
        _check_empty(aten.new_empty.default, x, [5])
        _check_empty(aten.new_empty.default, x, [5], dtype=BOOL)
        _check_empty(aten.new_empty_strided.default, x, [5], [1])


def test_arange():
    with Batch() as b:
        for args in (
            (5,),
            (7.0,),
            (2, 9),
            (-3, 4.5),
            (0, 1, 0.1),
            (10, 0, -3),
            (1, 2.5, 0.5),
            (0, 10, 3),
            (-1.5, 1.5, 0.25),
            (5, 5),
            (0, -1e-3, -1e-4),
        ):
            b.check(
                aten.arange.default
                if len(args) == 1
                else aten.arange.start
                if len(args) == 2
                else aten.arange.start_step,
                *args,
            )
        for dtype in (F32, F64, BF16, I64, I32, U8):
            b.check(aten.arange.start_step, 0, 20, 3, dtype=dtype, **CPU)
            b.check(aten.arange.start_step, 0.5, 20.7, 2.5, dtype=dtype)
            b.check(aten.arange.default, 9, dtype=dtype)
        b.check(aten.arange.start_step, -5, 7000, 0.1)  # long enough to be computed on the device
        b.check(aten.arange.start_step, -5, 7000, 0.1, dtype=F64)


def test_linspace_logspace():
    with Batch() as b:
        for start, end in ((0, 1), (-3.5, 10), (5, -5), (2, 2)):
            for steps in (0, 1, 2, 5, 33):
                b.check(aten.linspace.default, start, end, steps)
                b.check(aten.logspace.default, start, end, steps)
            for dtype in (F64, BF16, I64, I32):
                b.check(aten.linspace.default, start, end, 7, dtype=dtype, **CPU)
                b.check(aten.logspace.default, start, end, 7, 2.0, dtype=dtype)
        s, e = torch.tensor(-2.0), torch.tensor(3.0)
        b.check(aten.linspace.Tensor_Tensor, s, e, 9)
        b.check(aten.linspace.Tensor_Scalar, s, 4, 9)
        b.check(aten.linspace.Scalar_Tensor, 1, e, 9, dtype=F64)
        b.check(aten.logspace.Tensor_Tensor, s, e, 9)
        b.check(aten.logspace.Tensor_Scalar, s, 1, 4, 3.0)
        b.check(aten.logspace.Scalar_Tensor, 0, e, 4)


def test_eye_scalar_tensor_tri_indices():
    with Batch() as b:
        for dtype in (None, F64, I64, BOOL):
            kw = {} if dtype is None else {"dtype": dtype}
            b.check(aten.eye.default, 4, **kw)
            b.check(aten.eye.m, 3, 5, **kw)
            b.check(aten.eye.m, 5, 2, **kw)
            for s in (3, 2.5, True):
                b.check(aten.scalar_tensor.default, s, **kw)
        for args in ((4, 4), (3, 5, 1), (5, 3, -1), (4, 4, 10)):
            b.check(aten.tril_indices.default, *args)
            b.check(aten.triu_indices.default, *args)
        b.check(aten.tril_indices.default, 3, 3, 0, dtype=I32)
        b.check(aten.scalar_tensor.default, 7, **CPU)
