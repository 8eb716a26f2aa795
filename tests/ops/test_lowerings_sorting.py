"""sort / topk / median / nanmedian / kthvalue lowerings against eager torch on CPU."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _lowering_harness import Batch  # noqa: E402

aten = torch.ops.aten
F32, F64, BF16, I64, I32, U8, BOOL = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32,
                                      torch.uint8, torch.bool)


def _distinct(shape, dtype, seed=0):
    n = 1
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(n, generator=g) - n // 3).reshape(shape).to(dtype)


def test_sort_topk():
    nan = float("nan")
    with Batch() as b:
        for dtype in (F32, F64, BF16, I64, I32):
            x = _distinct((4, 6), dtype)
            for dim in (0, -1):  # (-1 is dim 1: both axes, and a negative dim)
                for descending in (False, True):
                    b.check(aten.sort.default, x, dim, descending)
                    b.check(aten.sort.stable, x, stable=True, dim=dim, descending=descending)
                for k in (1, 3):
                    b.check(aten.topk.default, x, k, dim)
                    b.check(aten.topk.default, x, k, dim, False)
        # ties: a stable sort keeps the original order
        ties = torch.tensor([[3, 1, 3, 2, 1, 3], [0, 0, 0, 0, 0, 0]])
        b.check(aten.sort.stable, ties, stable=True, dim=1)
        b.check(aten.sort.stable, ties, stable=True, dim=1, descending=True)
        b.check(aten.sort.stable, torch.tensor([2, 255, 0, 7], dtype=U8), stable=True, descending=True)
        b.check(aten.sort.stable, torch.tensor([True, False, True]), stable=True)
        b.check(aten.sort.stable, torch.tensor([True, False, True]), stable=True, descending=True)
        # NaN sorts above +inf
        xn = torch.tensor([1.0, nan, -float("inf"), float("inf"), -2.0, nan, 0.5])
        b.check(aten.sort.stable, xn, stable=True)
        b.check(aten.sort.stable, xn, stable=True, descending=True)
        b.check(aten.topk.default, torch.tensor([1.0, nan, 3.0, -1.0]), 2)
        b.check(aten.sort.default, torch.tensor(2.5))


def test_median_kthvalue():
    nan = float("nan")
    with Batch() as b:
        # odd and even lengths (torch: the lower median for even lengths)
        for dtype, shape in ((F32, (5, 7)), (F64, (4, 6)), (I64, (4, 6))):
            x = _distinct(shape, dtype, seed=3)
            b.check(aten.median.default, x)
            b.check(aten.nanmedian.default, x)
            for dim in (0, 1):
                b.check(aten.median.dim, x, dim)
                b.check(aten.median.dim, x, dim, True)
                b.check(aten.nanmedian.dim, x, dim)
                for k in (1, shape[dim]):
                    b.check(aten.kthvalue.default, x, k, dim)
                b.check(aten.kthvalue.default, x, 2, dim, True)
        xn = torch.tensor([[1.0, nan, 3.0, 2.0], [nan, nan, nan, nan], [4.0, 1.0, 2.0, 3.0], [nan, 5.0, 0.0, nan]])
        b.check(aten.median.default, xn)
        b.check(aten.nanmedian.default, xn)
        b.check(aten.median.dim, xn, 1)
        b.check(aten.nanmedian.dim, xn[[0, 2, 3]], 1)  # (an all-NaN row's index is arbitrary in torch)
        b.check(aten.nanmedian.default, torch.full((3,), nan))
        b.check(aten.nanmedian.default, torch.tensor([nan, 1.0, nan, 3.0, 2.0]))
