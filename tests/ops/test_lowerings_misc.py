"""Miscellaneous lowerings against eager torch on CPU: conjugation / complex / polar, mode,
searchsorted / bucketize / isin, hash_tensor, histc / histogram / histogramdd — on jax values, and
through sharded tensors (even and uneven shardings)."""
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
importlib.import_module("shardtensor.ops.complex")

aten = torch.ops.aten
F32, F64, F16, BF16, I64, I32, U8, BOOL = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                           torch.int64, torch.int32, torch.uint8, torch.bool)
C64, C128 = torch.complex64, torch.complex128
NAN, INF = float("nan"), float("inf")


def _complex(shape, dtype, seed=0):
    real = make(shape, F32 if dtype == C64 else F64, seed=seed)
    imag = make(shape, F32 if dtype == C64 else F64, seed=seed + 1)
    return torch.complex(real, imag)


# ----------------------------------------------------------------------------------------------
# conj, complex, polar
# ----------------------------------------------------------------------------------------------
def test_conj_complex_polar():
    with Batch() as b:
        for dt in (C64, C128):
            z = _complex((3, 4), dt)
            z[0, 0] = complex(NAN, INF)
            for op in (aten._conj.default, aten._conj_physical.default, aten._conj_copy.default):
                b.check(op, z)
                b.check(op, z[0, 1])
        b.check(aten._conj_physical.default, make((3,), F32))  # real: a copy
        for dt in (F32, F64):
            a, t = make((4, 1), dt, seed=2), make((5,), dt, seed=3)
            b.check(aten.complex.default, a, t)  # broadcasting
            b.check(aten.complex.default, torch.tensor(1.5, dtype=dt), t)
            special = torch.tensor([NAN, INF, -0.0], dtype=dt)
            b.check(aten.complex.default, special, torch.tensor([1, NAN, -INF], dtype=dt))
            b.check(aten.polar.default, a.abs(), t)
            b.check(aten.polar.default, torch.tensor([2.0, 0.0, INF, NAN, -1.0], dtype=dt),
                    torch.tensor([0.5, 1.0, 0.0, 1.0, 3.0], dtype=dt))


def test_complex_errors():
    with pytest.raises(RuntimeError, match="same dtype"):
        call(aten.complex.default, make((2,), F32), make((2,), F64))
    with pytest.raises(RuntimeError, match="float or double"):
        call(aten.polar.default, torch.tensor([1, 2]), torch.tensor([1, 2]))


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
        for row in ([1.0, 2, 2, 3, 3], [3.0, 1, 2], [5.0, 5, 5], [0.0, -0.0, 1], [-0.0, 0.0, 1],
                    [-INF, INF, INF, -INF], [2, 2, NAN, NAN, NAN], [1.0, 1, NAN], [NAN, 1, 1], [NAN, NAN]):
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
            b.check(aten.isin.Tensor_Tensor, torch.randint(0, 100, (40,), generator=g),
                    torch.randint(0, 100, (n,), generator=g))
            b.check(aten.isin.Tensor_Tensor, torch.randint(0, 9, (4, 10), generator=g).to(F64) / 2,
                    torch.randint(0, 9, (n,), generator=g).to(F32) / 2, assume_unique=n == 3)
        b.check(aten.isin.Tensor_Tensor, torch.empty(0), torch.tensor([1.0]))
        b.check(aten.isin.Tensor_Tensor, torch.tensor([1.0]), torch.empty(0))


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
    step = Fraction(float(_round_once(Fraction(float(_round_once(Fraction(float(e)) - Fraction(float(s)), dt)))
                                      / (steps - 1), dt)))
    out = [Fraction(float(s)) + step * i if i < steps // 2 else Fraction(float(e)) - step * (steps - 1 - i)
           for i in range(steps)]
    return torch.tensor(np.array([_round_once(v, dt) for v in out], dtype=dt))


@pytest.mark.parametrize("dtype", [F32, F64, F16, BF16])
def test_exact_linspace(dtype):
    # bin edges are exact: an element on an edge goes where the edges say
    rng = np.random.default_rng(1)
    jd = {F32: np.float32, F64: np.float64, F16: np.float16, BF16: jnp.bfloat16}[dtype]
    cases = [(-3.0, 7.0, 101), (-2.9, 6.1, 11), (0.0, 1.0, 1), (2.0, 2.0, 5)]
    cases += [(*sorted(rng.normal(size=2) * 10.0 ** rng.integers(-3, 4)), int(rng.integers(2, 300)))
              for _ in range(40)]

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
            for density in (False, True):
                for t, kw in ((x, {}), (x, {"range": [-1.0, 1.0]}), (x, {"weight": w}), (odd, {"range": [0.0, 4.0]}),
                              (edge_points, {"range": [-2.9, 6.1]})):
                    b.check(aten.histogram.bin_ct, t, bins, density=density, **kw,
                            expected=_histogram_by_edges(t, bins, density=density, **kw))
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
            for density in (False, True):
                b.check(aten._histogramdd_from_bin_cts.default, pts, bins, density=density)
                b.check(aten._histogramdd_from_bin_cts.default, pts, bins, range=[-1.0, 1.0, 0.0, 2.0, -3.0, 0.0],
                        density=density)
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


def test_histogram_errors():
    with pytest.raises(NotImplementedError, match="not implemented for"):
        call(aten.histc.default, torch.arange(3), 4)
    with pytest.raises(RuntimeError, match="not finite"):
        call(aten.histc.default, make((3,), F32), 4, 0, INF)


# ----------------------------------------------------------------------------------------------
# through sharded tensors: (4, 2) and (8,) meshes, even and uneven (padded) shardings
# ----------------------------------------------------------------------------------------------
def _mesh(shape=(4, 2)):
    import shardtensor as st

    names = ("x", "y")[:len(shape)]
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
    same(torch.histogram(s1, st.shard(torch.tensor([-1.0, 0, 2]), mesh, (None,))),
         torch.histogram(x[:, 0], torch.tensor([-1.0, 0, 2])))
    same(torch.histogramdd(sx, [2, 3, 1]), torch.histogramdd(x, [2, 3, 1]))
    same(torch.histogramdd(sx, [2, 2, 2], weight=sw), torch.histogramdd(x, [2, 2, 2], weight=w))
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.histogram(s1, 4, weight=sw.double())


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


def test_sharded_conj_views():
    st, mesh = _mesh()
    z = _complex((8, 3), C64, seed=14)
    sz = st.shard(z.clone(), mesh, ("x", None))
    # no conjugate bit: the view holds the conjugated values, is_conj() is False, resolve_conj is a no-op
    view = sz.conj()
    assert not view.is_conj()
    torch.testing.assert_close(view.cpu(), z.conj().resolve_conj())
    torch.testing.assert_close(view.resolve_conj().cpu(), z.conj().resolve_conj())
    torch.testing.assert_close(sz.mH.cpu(), z.mH.resolve_conj())
    torch.testing.assert_close(torch.view_as_real(view).cpu(), torch.view_as_real(z.conj().resolve_conj()))
    sz.mul_(2)  # a later write into the base shows through the view
    torch.testing.assert_close(view.cpu(), (2 * z).conj().resolve_conj())
    # autograd through conj, hfft (conj + c2r) and ifft of a real input (r2c + conj)
    r = make((8, 6), F32, seed=15)
    for fn in (lambda t: torch.fft.hfft(t.to(C64) * (1 + 1j)),
               lambda t: torch.view_as_real(torch.fft.ifft(t).resolve_conj()),
               lambda t: (torch.polar(t.abs(), t) * torch.complex(t, t).conj()).abs()):
        ref = r.clone().requires_grad_()
        fn(ref).sum().backward()
        sr = st.shard(r.clone(), mesh, ("x", None)).requires_grad_()
        got = fn(sr)
        got.sum().backward()
        torch.testing.assert_close(got.detach().cpu(), fn(r), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sr.grad.cpu(), ref.grad, rtol=1e-4, atol=1e-4)


def test_sharded_write_through_conj_view():
    st, mesh = _mesh()
    z = _complex((8, 3), C64, seed=16)
    sz = st.shard(z.clone(), mesh, ("x", None))
    view, want = sz.conj(), z.clone()
    want_view = want.conj()
    view.mul_(2)
    want_view.mul_(2)
    view[0, 0] = 1 + 1j
    want_view[0, 0] = 1 + 1j
    torch.testing.assert_close(sz.cpu(), want)
