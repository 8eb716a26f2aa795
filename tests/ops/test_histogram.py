"""histc / histogram / histogramdd lowerings (shardtensor/ops/histogram.py) and their exact bin edges
against eager torch on CPU, and through sharded tensors (even and uneven shardings)."""

import importlib
import os
import sys
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(__file__))
from _lowering_harness import Batch, call, make, to_torch  # noqa: E402

histogram = importlib.import_module("shardtensor.ops.histogram")  # (until shardtensor.ops imports them)

aten = torch.ops.aten
F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16
NAN, INF = float("nan"), float("inf")


# ----------------------------------------------------------------------------------------------
# histograms
# ----------------------------------------------------------------------------------------------
def _round_once(value: Fraction, dt):
    """The float of numpy type ``dt`` nearest to the exact ``value`` (ties to even)."""
    near = dt(float(value))
    candidates = [c for c in (np.nextafter(near, dt(-INF)), near, np.nextafter(near, dt(INF))) if np.isfinite(c)]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(c.view(f"u{c.itemsize}")) & 1))


def fused_linspace(start, end, steps, dtype):
    """torch's linspace formula with each multiply-add rounded once (what shardtensor promises, and
    what torch's AVX2 / AVX-512 kernels compute), in exact rational arithmetic: no CPU enters it.
    torch's unvectorised kernel (``ATEN_CPU_CAPABILITY=default``) rounds the product too."""
    dt = {F32: np.float32, F64: np.float64}[dtype]
    s, e = dt(start), dt(end)
    if steps == 1:
        return torch.tensor([s], dtype=dtype)
    step = Fraction(
        float(_round_once(Fraction(float(_round_once(Fraction(float(e)) - Fraction(float(s)), dt))) / (steps - 1), dt))
    )
    out = [
        Fraction(float(s)) + step * i if i < steps // 2 else Fraction(float(e)) - step * (steps - 1 - i)
        for i in range(steps)
    ]
    return torch.tensor(np.array([_round_once(v, dt) for v in out], dtype=dt))


@pytest.mark.parametrize("dtype", [F32, F64, F16, BF16])
def test_exact_linspace(dtype):
    # bin edges are exact: an element on an edge goes where the edges say
    rng = np.random.default_rng(1)
    jd = {F32: np.float32, F64: np.float64, F16: np.float16, BF16: jnp.bfloat16}[dtype]
    cases = [(-3.0, 7.0, 101), (-2.9, 6.1, 11), (0.0, 1.0, 1), (2.0, 2.0, 5)]
    cases += [(*sorted(rng.normal(size=2) * 10.0 ** rng.integers(-3, 4)), int(rng.integers(2, 300))) for _ in range(40)]

    @jax.jit
    def edges(starts, ends):
        return [histogram.exact_linspace(s, e, n, np.dtype(jd)) for s, e, (_, _, n) in zip(starts, ends, cases)]

    got = edges(jnp.asarray([c[0] for c in cases]), jnp.asarray([c[1] for c in cases]))
    for (s, e, n), g in zip(cases, got):
        want = torch.linspace(float(s), float(e), n, dtype=dtype)
        if dtype in (F32, F64):  # exact against the rounded-once formula; within the product's rounding of torch
            torch.testing.assert_close(to_torch(g), fused_linspace(s, e, n, dtype), rtol=0, atol=0)
            ulp = torch.finfo(dtype).eps * max(abs(float(s)), abs(float(e)))
            torch.testing.assert_close(to_torch(g), want, rtol=0, atol=2 * ulp)
        else:  # float16 / bfloat16: every operation rounds, in any of torch's kernels
            torch.testing.assert_close(to_torch(g), want, rtol=0, atol=0)


def _histogram_by_edges(x, bins, range=None, weight=None, density=False):
    """histogram with a bin count, as the same histogram over the rounded-once edges (``fused_linspace``)
    given explicitly: torch's bin-count kernel finds the bin against edges its CPU's linspace made."""
    if range is not None:
        lo, hi = range
    elif x.numel():
        lo, hi = x.min().item(), x.max().item()
    else:
        lo, hi = 0.0, 1.0
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    return aten.histogram.bins_tensor(x, fused_linspace(lo, hi, bins + 1, x.dtype), weight=weight, density=density)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_histc_histogram(dtype):
    x = make((50,), dtype, seed=6)
    w = make((50,), dtype, low=0, high=1, seed=7)
    odd = torch.tensor([1.0, 2, NAN, 3, -INF, INF, 0.5, 4.0, 0.0], dtype=dtype)
    edge_points = torch.linspace(-3, 7, 1001, dtype=dtype)  # many values on or next to bin edges
    with Batch() as b:
        for bins in (1, 13, 100):  # one bin, a bin width that is no round number, many narrow bins
            b.check(aten.histc.default, x, bins)
            b.check(aten.histc.default, x, bins, -1, 1)
            b.check(aten.histc.default, odd, bins, 0, 4)
            b.check(aten.histc.default, edge_points, bins)
            # density divides the counts by their total and the bin width: checked at the odd width
            for density in (False, True) if bins == 13 else (False,):
                for t, kw in (
                    (x, {}),
                    (x, {"range": [-1.0, 1.0]}),
                    (x, {"weight": w}),
                    (odd, {"range": [0.0, 4.0]}),
                    (edge_points, {"range": [-2.9, 6.1]}),
                ):
                    b.check(
                        aten.histogram.bin_ct,
                        t,
                        bins,
                        density=density,
                        **kw,
                        expected=_histogram_by_edges(t, bins, density=density, **kw),
                    )
        e = torch.tensor([-1.0, 0, 0.5, 2], dtype=dtype)
        for density in (False, True):
            b.check(aten.histogram.bins_tensor, x, e, density=density)
            b.check(aten.histogram.bins_tensor, x.reshape(5, 10), e, weight=w.reshape(5, 10), density=density)
            b.check(aten.histogram.bins_tensor, odd, e, density=density)
        b.check(aten.histogram.bins_tensor, x, torch.tensor([0.0, 3, 2, 4], dtype=dtype))  # unsorted edges
        b.check(aten.histogram.bins_tensor, x, torch.tensor([0.5], dtype=dtype).expand(3).clone())
        # degenerate ranges: equal ends are widened (histc by 1, histogram by 0.5); no data: [0, 1]
        for t in (torch.tensor([2.0, 2.0], dtype=dtype), torch.empty(0, dtype=dtype)):
            b.check(aten.histc.default, t, 4)
            b.check(aten.histogram.bin_ct, t, 4)
        b.check(aten.histc.default, torch.empty(0, dtype=dtype), 4, 1, 1)
        b.check(aten.histogram.bin_ct, x, 4, range=[1.0, 1.0])
        b.check(aten.histogram.bin_ct, torch.zeros(4, dtype=dtype), 3, density=True)  # 0 / 0 -> NaN


@pytest.mark.parametrize("dtype", [F32, F64])
def test_histogramdd(dtype):
    pts = make((7, 6, 3), dtype, seed=8)
    w = make((7, 6), dtype, low=0, high=1, seed=9)
    with Batch() as b:
        for bins in ([1, 1, 1], [2, 3, 4], [5, 1, 7]):
            b.check(aten._histogramdd_bin_edges.default, pts, bins)
            b.check(aten._histogramdd_bin_edges.default, pts, bins, range=[-1.0, 1.0, 0.0, 2.0, -3.0, 0.0])
            for density in (False, True) if bins == [2, 3, 4] else (False,):  # (density: as in test_histc_histogram)
                b.check(aten._histogramdd_from_bin_cts.default, pts, bins, density=density)
                b.check(
                    aten._histogramdd_from_bin_cts.default,
                    pts,
                    bins,
                    range=[-1.0, 1.0, 0.0, 2.0, -3.0, 0.0],
                    density=density,
                )
                b.check(aten._histogramdd_from_bin_cts.default, pts, bins, weight=w, density=density)
        edges = [torch.tensor(e, dtype=dtype) for e in ([-1.0, 0, 1], [-2.0, -1, 0, 0.5, 3], [0.0, 1])]
        for density in (False, True):
            b.check(aten._histogramdd_from_bin_tensors.default, pts, edges, density=density)
            b.check(aten._histogramdd_from_bin_tensors.default, pts, edges, weight=w, density=density)
        b.check(aten._histogramdd_from_bin_cts.default, torch.empty(0, 2, dtype=dtype), [2, 3])


def test_histogram_low_precision():
    h = make((100,), F16, seed=10)
    with Batch() as b:
        b.check(aten.histc.default, h, 10)
        b.check(aten.histc.default, h.to(BF16), 10, -1, 1)
        b.check(aten.histogram.bin_ct, h, 10, range=[-1.0, 1.0])


def test_histc_integer_input_counts_as_on_cuda():
    """torch's CPU kernel refuses integer input; its CUDA kernel (and transformers' MoE routing on any
    non-CPU device) counts it: the counts of the same values as floats, in the input's dtype."""
    x = torch.tensor([0, 3, 1, 1, 3, 2, 7, -1], dtype=torch.int32)
    got = call(aten.histc.default, x, 4, 0, 3)
    assert got.dtype == jnp.int32
    assert got.tolist() == torch.histc(x.float(), 4, 0, 3).int().tolist() == [1, 2, 1, 2]


def test_histogram_errors():
    with pytest.raises(NotImplementedError, match="not implemented for"):
        call(aten.histogram.bin_ct, torch.arange(3), 4)
    with pytest.raises(RuntimeError, match="not finite"):
        call(aten.histc.default, make((3,), F32), 4, 0, INF)


# ----------------------------------------------------------------------------------------------
# through sharded tensors: (4, 2) and (8,) meshes, even and uneven (padded) shardings
# ----------------------------------------------------------------------------------------------
def _mesh(shape=(4, 2)):
    import shardtensor as st

    names = ("x", "y")[: len(shape)]
    return st, st.Mesh(range(8), shape, names)


@pytest.mark.parametrize("n", [16, 13, 5])  # 13 and 5 rows: padded over 4 devices
def test_sharded_histograms(n):
    st, mesh = _mesh()
    x = make((n, 3), F32, seed=11)
    w = make((n,), F32, low=0, high=1, seed=12)
    sx, sw = st.shard(x, mesh, ("x", None)), st.shard(w, mesh, ("x",))
    s1 = st.shard(x[:, 0].contiguous(), mesh, ("x",))

    def same(got, want):
        got, want = tree_flatten(got)[0], tree_flatten(want)[0]
        assert len(got) == len(want)
        for g, v in zip(got, want):
            torch.testing.assert_close(g.cpu(), v, rtol=1e-5, atol=1e-6)

    same(torch.histc(s1, 7), torch.histc(x[:, 0], 7))
    same(torch.histc(sx, 5, -1, 1), torch.histc(x, 5, -1, 1))
    same(torch.histogram(s1, 6, weight=sw, density=True), torch.histogram(x[:, 0], 6, weight=w, density=True))
    same(
        torch.histogram(s1, st.shard(torch.tensor([-1.0, 0, 2]), mesh, (None,))),
        torch.histogram(x[:, 0], torch.tensor([-1.0, 0, 2])),
    )
    same(torch.histogramdd(sx, [2, 3, 1]), torch.histogramdd(x, [2, 3, 1]))
    same(torch.histogramdd(sx, [2, 2, 2], weight=sw), torch.histogramdd(x, [2, 2, 2], weight=w))
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.histogram(s1, 4, weight=sw.double())
