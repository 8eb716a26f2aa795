"""sort / topk / median / nanmedian / kthvalue / mode / searchsorted / bucketize / isin lowerings against
eager torch on CPU, with torch CPU's order of equal elements in sort / topk / kthvalue indices; then
through sharded tensors (even and uneven shardings)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _lowering_harness import Batch, call, check, deferred_checks, make, to_torch  # noqa: E402,F401  (the deferred_checks fixture)

aten = torch.ops.aten
F32, F64, BF16, I64, I32, U8, BOOL = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)
NAN, INF = float("nan"), float("inf")


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
            # topk's order replay compiles slowly: every k, dim and direction in float32, one mix of
            # them per other dtype (the dtype only changes how the ranks are computed)
            cases = [(k, dim, largest) for k in (1, 3) for dim in (0, -1) for largest in (True, False)]
            for k, dim, largest in cases if dtype == F32 else [(3, -1, True), (1, 0, False)]:
                b.check(aten.topk.default, x, k, dim, largest)
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
            if dtype != F32:  # (the selection replay compiles slowly: one of each per other dtype)
                b.check(aten.median.dim, x, 1)
                b.check(aten.kthvalue.default, x, 2, 0, True)
                continue
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


# ------------------------------------- sort / topk / kthvalue indices: torch CPU's order of equal elements
def _tied(shape, dtype, g):
    x = torch.randint(0, 3, shape, generator=g)
    if dtype == torch.bool:
        return x > 0
    x = x.to(dtype)
    if dtype.is_floating_point:
        x[torch.rand(shape, generator=g) < 0.05] = float("nan")
        x[torch.rand(shape, generator=g) < 0.05] = -0.0
    return x


def _torch_supports(fn, *args):
    try:
        fn(*args)
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64, torch.bool])
def test_sort_topk_kthvalue_ties_like_torch_cpu(dtype):
    """Unstable sort is libstdc++'s std::sort, topk std::nth_element + std::sort (or std::partial_sort
    when k * 64 <= n), kthvalue ATen's quickselect: their order of equal elements is replayed
    (ops/_cpu_order.py), indices exactly. The replay orders integer ranks whatever the dtype: bfloat16
    (with NaN and -0.0) and bool run every case, int64 (whose ranks are plain) the long rows' sort,
    nth_element and quickselect."""
    g = torch.Generator().manual_seed(0)
    every = dtype != torch.int64
    for n in (17, 300) if every else (300,):
        x = _tied((3, n), dtype, g)
        check(aten.sort.default, x, 1, False)
        if every:
            check(aten.sort.stable, x, stable=False, dim=1, descending=True)
            check(aten.sort.stable, x, stable=True, dim=1, descending=False)
        topks = [(1, True, True), (3, False, True), (n // 2, True, False), (n // 2, False, True)]
        for k, largest, sorted_ in topks if every else topks[2:3]:
            if _torch_supports(torch.topk, x, k, 1, largest):
                check(aten.topk.default, x, k, 1, largest, sorted_)
        for k in (1, n // 2) if every else (n // 2,):
            if _torch_supports(torch.kthvalue, x, k, 1):
                check(aten.kthvalue.default, x, k, 1)


# ----------------------------------------------------------------------------------------------
# mode
# ----------------------------------------------------------------------------------------------
def test_mode():
    with Batch() as b:
        for dt in (F32, F64, BF16, I64, I32, U8, BOOL):
            x = make((5, 6, 7), dt, low=0, high=4, seed=1)
            for dim in (0, 1, 2, -1):
                b.check(aten.mode.default, x, dim)
                b.check(aten.mode.default, x, dim, True)
        # ties between values: the smallest wins; the index is the value's last occurrence
        for row in (
            [1.0, 2, 2, 3, 3],
            [3.0, 1, 2],
            [5.0, 5, 5],
            [0.0, -0.0, 1],
            [-0.0, 0.0, 1],
            [-INF, INF, INF, -INF],
            [2, 2, NAN, NAN, NAN],
            [1.0, 1, NAN],
            [NAN, 1, 1],
            [NAN, NAN],
        ):
            b.check(aten.mode.default, torch.tensor(row))
        b.check(aten.mode.default, torch.tensor(3.5))
        b.check(aten.mode.default, torch.tensor(3.5), 0, True)
        b.check(aten.mode.default, torch.empty(0, 3), 1)
        b.check(aten.mode.default, torch.empty(0, 3), 1, True)


def test_mode_long_slices():
    # beyond 16 elements torch's std::sort is unstable: its index is *some* occurrence of the mode
    x = make((3, 200), I64, low=0, high=6, seed=4)
    values, indices = (to_torch(v) for v in call(aten.mode.default, x, 1))
    want_values, _ = torch.mode(x, 1)
    torch.testing.assert_close(values, want_values)
    torch.testing.assert_close(x.gather(1, indices[:, None])[:, 0], want_values)
    last = torch.tensor([int((row == v).nonzero().max()) for row, v in zip(x, want_values)])
    torch.testing.assert_close(indices, last)


def test_mode_empty_dim_raises():
    with pytest.raises(RuntimeError, match="non-zero size"):
        call(aten.mode.default, torch.empty(3, 0), 1)


# ----------------------------------------------------------------------------------------------
# searchsorted, bucketize, isin
# ----------------------------------------------------------------------------------------------
def test_searchsorted_bucketize():
    g = torch.Generator().manual_seed(0)
    with Batch() as b:
        bd = torch.tensor([1.0, 2, 2, 3, 5])
        v = torch.tensor([[0.0, 1, 2, 2.5], [3, 5, 6, NAN]])
        for right in (False, True):
            for int32 in (False, True):
                b.check(aten.searchsorted.Tensor, bd, v, right=right, out_int32=int32)
                b.check(aten.bucketize.Tensor, v, bd, right=right, out_int32=int32)
            b.check(aten.searchsorted.Scalar, bd, 2, right=right)
            b.check(aten.searchsorted.Scalar, bd, 2.5, right=right)
            b.check(aten.bucketize.Scalar, 2, bd, right=right)
            b.check(aten.searchsorted.Tensor, torch.tensor([1, 3, 3, 7]), torch.tensor([[3, 0], [8, 7]]), right=right)
        for side in ("left", "right"):
            # torch's bisection, step for step: unsorted and NaN-holding boundaries give its answers
            for n in (1, 2, 7, 16, 100):
                seq = torch.randn(n, generator=g)
                seq[::3] = NAN
                vals = torch.cat([torch.randn(50, generator=g), seq[:5], torch.tensor([NAN, INF, -INF])])
                b.check(aten.searchsorted.Tensor, seq, vals, side=side)
                b.check(aten.searchsorted.Tensor, seq.sort().values, vals, side=side)
                b.check(aten.searchsorted.Tensor, seq, vals, side=side, sorter=torch.randperm(n, generator=g))
            rows = torch.randn(3, 7, generator=g)
            b.check(aten.searchsorted.Tensor, rows.sort(-1).values, torch.randn(3, 4, generator=g), side=side)
            b.check(aten.searchsorted.Tensor, rows, torch.randn(3, 4, generator=g), side=side, sorter=rows.argsort(-1))
            b.check(aten.searchsorted.Tensor, rows, torch.randn(3, 4, generator=g), side=side, right=side == "right")
        # torch's promotion: a 0-d float64 input is compared in the boundaries' float32, a 1-D one in float64
        b.check(aten.searchsorted.Tensor, torch.tensor([0.1]), torch.tensor(0.1, dtype=F64), right=True)
        b.check(aten.searchsorted.Tensor, torch.tensor([0.1], dtype=F64), torch.tensor([0.1]))
        b.check(aten.searchsorted.Tensor, torch.tensor([1, 3, 5]), torch.tensor([2.5, 3.0]))
        b.check(aten.searchsorted.Scalar, torch.tensor([0.1]), 0.1, right=True)
        b.check(aten.searchsorted.Tensor, torch.tensor([1, 2, 3], dtype=U8), torch.tensor([2], dtype=U8))
        b.check(aten.searchsorted.Tensor, torch.empty(0), torch.tensor([1.0, 2]))
        b.check(aten.searchsorted.Tensor, torch.tensor([1.0, 2]), torch.empty(0))
        b.check(aten.bucketize.Tensor, torch.empty(2, 0), torch.tensor([1.0, 2]))


def test_searchsorted_errors():
    with pytest.raises(RuntimeError, match="opposites"):
        call(aten.searchsorted.Tensor, torch.tensor([1.0]), torch.tensor([1.0]), right=True, side="left")
    with pytest.raises(RuntimeError, match="1 dimension"):
        call(aten.bucketize.Tensor, torch.tensor([1.0]), torch.tensor([[1.0]]))


def test_isin():
    g = torch.Generator().manual_seed(1)
    with Batch() as b:
        e = torch.tensor([[1.0, 2, NAN], [0.0, -0.0, 4]])
        for invert in (False, True):
            b.check(aten.isin.Tensor_Tensor, e, torch.tensor([NAN, 2.0, 0.0]), invert=invert)  # few: compare all
            b.check(aten.isin.Tensor_Tensor, e, torch.arange(-50, 50) / 2, invert=invert)  # many: sort + search
            b.check(aten.isin.Tensor_Tensor, e, torch.tensor([NAN, 4.0, INF] + [NAN] * 20), invert=invert)
            b.check(aten.isin.Tensor_Tensor, torch.arange(20), torch.tensor([2.0, 3.5]), invert=invert)
            b.check(aten.isin.Tensor_Scalar, torch.arange(5), 2, invert=invert)
            b.check(aten.isin.Tensor_Scalar, torch.arange(5), 2.5, invert=invert)
            b.check(aten.isin.Scalar_Tensor, 2, torch.arange(5), invert=invert)
            b.check(aten.isin.Scalar_Tensor, 7, torch.arange(50), invert=invert)
        for n in (3, 60, 500):
            b.check(
                aten.isin.Tensor_Tensor,
                torch.randint(0, 100, (40,), generator=g),
                torch.randint(0, 100, (n,), generator=g),
            )
            b.check(
                aten.isin.Tensor_Tensor,
                torch.randint(0, 9, (4, 10), generator=g).to(F64) / 2,
                torch.randint(0, 9, (n,), generator=g).to(F32) / 2,
                assume_unique=n == 3,
            )
        b.check(aten.isin.Tensor_Tensor, torch.empty(0), torch.tensor([1.0]))
        b.check(aten.isin.Tensor_Tensor, torch.tensor([1.0]), torch.empty(0))


# ----------------------------------------------------------------------------------------------
# through sharded tensors: (4, 2) and (8,) meshes, even and uneven (padded) shardings
# ----------------------------------------------------------------------------------------------
def _mesh(shape=(4, 2)):
    import shardtensor as st

    names = ("x", "y")[: len(shape)]
    return st, st.Mesh(range(8), shape, names)


def test_sharded_sort_topk_kthvalue_ties():
    st, mesh = _mesh()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-9, 9, (5, 10, 5), generator=g)  # the OpInfo sample shape, many ties
    sx = st.shard(x, mesh, (None, None, "x"))  # 5 over 4 devices: uneven as well
    for got, want in [
        (torch.topk(sx, 3), torch.topk(x, 3)),
        (torch.topk(sx, 3, 1), torch.topk(x, 3, 1)),
        (torch.kthvalue(sx, 2), torch.kthvalue(x, 2)),
        (torch.kthvalue(sx, 4, 1), torch.kthvalue(x, 4, 1)),
        (torch.sort(sx, 1), torch.sort(x, 1)),
        (torch.sort(sx.bfloat16(), 1), torch.sort(x.bfloat16(), 1)),
    ]:
        for a, b in zip(got, want):
            torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)
    big = torch.randint(0, 50, (2, 3000), generator=g).bfloat16()
    torch.testing.assert_close(torch.argsort(st.shard(big, mesh, ("y", None)), dim=1).cpu(), torch.argsort(big, dim=1))


@pytest.mark.parametrize("shape", [(8,), (4, 2)])
def test_sharded_sorting_ops(shape):
    st, mesh = _mesh(shape)
    spec = ("x", None)
    x = make((12, 9), F32, low=0, high=3, seed=13).round()
    sx = st.shard(x, mesh, spec)
    for got, want in ((torch.mode(sx, 1), torch.mode(x, 1)), (torch.mode(sx, 0), torch.mode(x, 0))):
        torch.testing.assert_close(got.values.cpu(), want.values)
        torch.testing.assert_close(got.indices.cpu(), want.indices)
    bd = torch.tensor([0.0, 0.5, 1.0, 2.0])
    sbd = st.shard(bd, mesh, (None,))
    torch.testing.assert_close(torch.searchsorted(sbd, sx, right=True).cpu(), torch.searchsorted(bd, x, right=True))
    torch.testing.assert_close(torch.bucketize(sx, sbd, out_int32=True).cpu(), torch.bucketize(x, bd, out_int32=True))
    test = torch.arange(0, 3, 0.5)
    torch.testing.assert_close(torch.isin(sx, st.shard(test, mesh, (None,))).cpu(), torch.isin(x, test))
    for dim in ([], [0], [1]):
        torch.testing.assert_close(torch.hash_tensor(sx, dim).cpu(), torch.hash_tensor(x, dim))
