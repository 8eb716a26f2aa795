"""Special-function lowerings (shardtensor/ops/special.py, bessel.py, polynomials.py) against eager
torch on CPU: digamma / polygamma at negative inputs and poles, Bessel and Airy functions across their approximation
branches, the scipy-style helpers (i0e, i1, ndtri, log_ndtr, erfcx, entr, igamma, zeta), the
orthogonal polynomials with torch's special cases (n < 0, |x| == 1, closed forms for large n, degree
limits), then forward and backward through sharded tensors."""

import importlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _lowering_harness import Batch, call, make  # noqa: E402

importlib.import_module("shardtensor.ops.special")  # (in case shardtensor.ops does not import it yet)

aten = torch.ops.aten
prims = torch.ops.prims
F32, F64 = torch.float32, torch.float64
I64, I32, I8 = torch.int64, torch.int32, torch.int8


def _tol(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == F32 else {"atol": 1e-10, "rtol": 1e-10}


# the branch points of the approximations (5 for J/Y, 8 for I, 2 for K, +-2.09 and 103.892 for Ai),
# poles, signed zeros, tiny values and the non-finite values
SPECIAL_POINTS = [
    0.0,
    -0.0,
    1e-30,
    -1e-30,
    1e-6,
    -1e-6,
    0.25,
    0.5,
    -0.5,
    1.0,
    -1.0,
    1.9999,
    2.0,
    2.0001,
    -2.0,
    2.09,
    -2.09,
    2.1,
    -2.1,
    4.99,
    5.0,
    5.01,
    -5.0,
    7.99,
    8.0,
    8.01,
    -8.0,
    9.99,
    10.0,
    -7.5,
    -3.3,
    30.0,
    -30.0,
    100.0,
    103.9,
    500.0,
    1e10,
    -1e10,
    float("inf"),
    float("-inf"),
    float("nan"),
]


def _points(dtype, seed=0):
    fixed = torch.tensor(SPECIAL_POINTS, dtype=dtype)
    return torch.cat(
        [
            fixed,
            make((300,), dtype, low=-12, high=12, seed=seed),
            make((100,), dtype, low=-200, high=200, seed=seed + 1),
        ]
    )


UNARY = [
    aten.special_bessel_j0.default,
    aten.special_bessel_j1.default,
    aten.special_bessel_y0.default,
    aten.special_bessel_y1.default,
    aten.special_spherical_bessel_j0.default,
    aten.special_airy_ai.default,
    aten.special_modified_bessel_i0.default,
    aten.special_modified_bessel_i1.default,
    aten.special_modified_bessel_k0.default,
    aten.special_modified_bessel_k1.default,
    aten.special_scaled_modified_bessel_k0.default,
    aten.special_scaled_modified_bessel_k1.default,
    aten.digamma.default,
]


@pytest.mark.parametrize("dtype", [F32, F64])
def test_bessel_airy_digamma(dtype):
    x = _points(dtype)
    with Batch() as b:
        for op in UNARY:
            b.check(op, x, **_tol(dtype))
        b.check(aten.special_bessel_j0.default, torch.arange(-3, 9), **_tol(F32))  # ints -> float32


def test_airy_large_negative_phase():
    # the phase 2/3 (-x)^1.5 is large: x / 3 must stay a true division (XLA would use x * (1/3))
    x = -torch.logspace(0.5, 9, 500, dtype=F32)
    with Batch() as b:
        b.check(aten.special_airy_ai.default, x, **_tol(F32))


def test_prims_overloads():
    x = _points(F32)[:60]
    with Batch() as b:
        b.check(prims.bessel_j0.default, x, **_tol(F32))
        b.check(prims.bessel_j1.default, x, **_tol(F32))
        b.check(prims.spherical_bessel_j0.default, x, **_tol(F32))
        b.check(prims.digamma.default, x, **_tol(F32))
        b.check(prims.bessel_i0e.default, x, **_tol(F32))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_polygamma(dtype):
    # negative non-integers (reflection), poles (negative integers, 0, -inf: inf/NaN as torch), large
    # positives; n = 1 is torch's trigamma (in x's dtype), n >= 2 its float64 Hurwitz zeta
    x = torch.cat(
        [
            _points(dtype),
            make((200,), dtype, low=-60, high=0, seed=5),
            torch.tensor([-1.0000001, -0.9999999, -2.5, -1e3 + 0.25, 1e20], dtype=dtype),
        ]
    )
    with Batch() as b:
        for n in range(7):
            b.check(aten.polygamma.default, n, x, **_tol(dtype))
        # torch sums zeta(13, q) straight from a negative q: its cancellation costs it ~1e-5 (relative)
        b.check(aten.polygamma.default, 12, x[x > -5], atol=1e-4, rtol=1e-4)
        b.check(aten.polygamma.default, 2, torch.arange(-4, 6), **_tol(F32))
    with pytest.raises(RuntimeError, match="negative n"):
        call(aten.polygamma.default, -1, x)


def test_mvlgamma():
    x = make((5, 4), F64, low=2, high=6)
    with Batch() as b:
        for p in (1, 2, 5):
            b.check(aten.mvlgamma.default, x, p, **_tol(F64))


def test_polygamma_mvlgamma():
    y = make((6,), F64, low=0.5, high=4)
    with Batch() as b:
        for n in range(3):
            b.check(aten.polygamma.default, n, y)
        b.check(aten.polygamma.default, 1, y.float())
        b.check(aten.mvlgamma.default, make((6,), F64, low=2, high=5), 3)
        b.check(aten.mvlgamma.default, make((6,), F32, low=2, high=5), 1)


def test_special_functions_and_integer_extras():
    with Batch() as b:
        for dtype in (F32,):
            x = make((12,), dtype, low=-4, high=4)
            for name in (
                "special_i0e",
                "special_i1",
                "special_i1e",
                "special_log_ndtr",
                "special_erfcx",
                "special_entr",
            ):
                b.check(getattr(aten, name).default, x)
            b.check(aten.special_ndtri.default, make((12,), dtype, low=0.01, high=0.99))
            a, y = make((12,), dtype, low=0.5, high=4, seed=1), make((12,), dtype, low=0.1, high=5, seed=2)
            b.check(aten.igamma.default, a, y)
            b.check(aten.igammac.default, a, y)
            b.check(aten.special_zeta.default, a + 1.5, y)
            b.check(aten.special_zeta.other_scalar, a + 1.5, 2.0)
            # torch's domain: inf at x == 1 and at the poles q = 0, -1, ...; NaN for x < 1
            xs, qs = zip(*[(x_, q_) for x_ in (0.0, 0.5, 1.0, 2.0, 2.5, -1.0) for q_ in (0.0, 1.0, -1.0, -1.5, 0.5)])
            b.check(aten.special_zeta.default, torch.tensor(xs, dtype=dtype), torch.tensor(qs, dtype=dtype))
            b.check(aten.frexp.Tensor, torch.tensor([0.0, -3.5, 1e-30, 1024.0, 0.75], dtype=dtype))
            b.check(aten.ldexp.Tensor, x, torch.tensor([3] * 12))
        b.check(aten.ldexp.Tensor, torch.tensor([1, 2, 3]), torch.tensor([1, -1, 2]))
        b.check(aten.special_i1.default, torch.tensor([1, 2]))
        for dtype in (I64, I32, I8):
            p, q = torch.tensor([12, -18, 0, 7, 0, -4], dtype=dtype), torch.tensor([8, 12, 5, -3, 0, -6], dtype=dtype)
            b.check(aten.gcd.default, p, q)
            b.check(aten.lcm.default, p, q)
            b.check(aten.__lshift__.Scalar, p, 2)
            b.check(aten.__rshift__.Scalar, p, 1)
            b.check(aten.__lshift__.Tensor, p, torch.tensor([0, 1, 2, 3, 4, 5], dtype=dtype))
            b.check(aten.__rshift__.Tensor, p, torch.tensor([0, 1, 2, 3, 4, 5], dtype=dtype))


POLYNOMIALS = [
    "chebyshev_polynomial_t",
    "chebyshev_polynomial_u",
    "chebyshev_polynomial_v",
    "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t",
    "shifted_chebyshev_polynomial_u",
    "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w",
    "hermite_polynomial_h",
    "hermite_polynomial_he",
    "laguerre_polynomial_l",
    "legendre_polynomial_p",
]
# endpoints (|x| == 1, and 0 / 1 of the shifted forms), values next to them, |x| > 1, infinities
POLY_X = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    -0.5,
    0.25,
    0.75,
    1e-30,
    1e-8,
    0.9999999,
    -0.9999999,
    1.0000001,
    2.0,
    -2.0,
    3.0,
    -8.48,
    0.3,
    -0.7,
    float("inf"),
    float("-inf"),
]
# negative, fractional (truncated), the closed-form thresholds (4, 6, 8), Hermite's limits (128 / 512)
# and non-finite degrees (taken as negative)
POLY_N = [
    -3.0,
    -1.0,
    -0.5,
    0.0,
    0.7,
    1.0,
    1.9,
    2.0,
    3.0,
    4.0,
    5.0,
    6.0,
    7.0,
    8.0,
    9.0,
    10.0,
    12.0,
    20.0,
    33.0,
    float("nan"),
    float("inf"),
    float("-inf"),
    1e30,
]
POLY_N_LARGE = [64.0, 127.0, 128.0, 129.0, 300.0, 512.0, 513.0, 1000.0]


def _against_float64(op, *args, rtol, atol, growth=None):
    """``Batch.check`` arguments comparing a polynomial with ``op`` in float64 (no CPU's rounding in
    it), not with torch's float32 kernel: a recurrence with cancellation returns a different float32
    value with and without fused multiply-adds, and compilers contract them differently on each CPU.
    An element passes within ``rtol``/``atol`` of the float64 value, or within 8 times the error of
    torch's own float32 kernel there (that error measures the element's conditioning); near
    overflow (within a factor 2 of the dtype's max, or where torch's own kernel overflows) an
    infinity or NaN passes too, as a recurrence's terms may overflow before its result does.
    ``growth``: a per-element factor on the dtype's eps, added to the tolerance (large degrees)."""
    dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
    ref = op(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
    own = op(*args).double()
    own_error = torch.where(own.isfinite() & ref.isfinite(), (own - ref).abs(), 0)
    scale = ref.abs().nan_to_num(0, posinf=0)
    tol = atol + rtol * scale + 8 * own_error
    if growth is not None:
        tol = tol + growth * torch.finfo(dtype).eps * (scale + 1)
    big = torch.finfo(dtype).max / 2

    def compare(got, want, what):
        assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
        g = got.double()
        ok = (g - ref).abs() <= tol
        ok |= (g == ref) | (g.isnan() & ref.isnan())
        ok |= ~g.isfinite() & ~own.isfinite()
        ok |= g.isinf() & (g.sign() == ref.sign()) & (ref.abs() > big)
        ok |= ref.isinf() & (g.sign() == ref.sign()) & (g.abs() > big)
        if not bool(ok.all()):
            bad = (~ok).nonzero().tolist()[:5]
            raise AssertionError(
                f"{what}: {int((~ok).sum())} elements off the float64 value; first at "
                + "; ".join(
                    f"{i}: got {g[tuple(i)].item()!r}, float64 {ref[tuple(i)].item()!r}, torch {own[tuple(i)].item()!r}"
                    for i in bad
                )
            )

    return {"compare": compare}


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomials(name, dtype):
    op = getattr(aten, "special_" + name)
    x = torch.cat(
        [
            torch.tensor(POLY_X, dtype=dtype),
            make((30,), dtype, low=-1.2, high=1.2, seed=3),
            make((10,), dtype, low=-9, high=9, seed=4),
        ]
    )
    n = torch.tensor(POLY_N + (POLY_N_LARGE if dtype == F64 else []), dtype=dtype)
    t = _tol(dtype)
    with Batch() as b:
        for variant, args in (
            (op.default, (x[:, None], n[None, :])),
            (op.x_scalar, (0.3, n)),
            (op.x_scalar, (-2, n)),
            (op.n_scalar, (x, 5)),
            (op.n_scalar, (x, 2.5)),
            (op.n_scalar, (x, 11)),
        ):
            b.check(variant, *args, **_against_float64(variant, *args, **t))
        b.check(op.default, torch.arange(-3, 4)[:, None], torch.arange(-1, 6, dtype=torch.int32), **_tol(F32))


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomials_large_degree_float32(name):
    # float32 at large n: a recurrence's rounding errors grow like n^2 eps (times the terms' size),
    # and the closed forms' n * acos(x) like n eps; torch's float32 result moves by as much between
    # its vectorised and unvectorised kernels, so the reference is float64 (see _against_float64)
    op = getattr(aten, "special_" + name).default
    x = torch.cat([torch.tensor(POLY_X, dtype=F32), make((20,), F32, low=-1.2, high=1.2, seed=6)])
    n = torch.tensor(POLY_N_LARGE, dtype=F32)
    with Batch() as b:
        b.check(
            op,
            x[:, None],
            n[None, :],
            **_against_float64(op, x[:, None], n[None, :], rtol=1e-5, atol=1e-5, growth=n[None, :].double() ** 2),
        )


def test_polynomial_dtype_errors():
    with pytest.raises(RuntimeError, match="not implemented for 'Half'"):
        call(
            aten.special_chebyshev_polynomial_t.default,
            torch.ones(3, dtype=torch.float16),
            torch.ones(3, dtype=torch.float16),
        )


# ----------------------------------------------------------------------------------------------
# through sharded tensors (lazy mode, (4, 2) mesh): forward and backward against torch autograd
# ----------------------------------------------------------------------------------------------
def _mesh():
    import shardtensor as st

    return st, st.Mesh(range(8), (4, 2), ("x", "y"))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_sharded_polygamma_backward(dtype):
    st, mesh = _mesh()
    x = torch.cat([make((12, 3), dtype, low=-9, high=9, seed=7), make((4, 3), dtype, low=0.1, high=3, seed=8)])
    for fn in (
        torch.digamma,
        lambda v: torch.polygamma(1, v),
        lambda v: torch.polygamma(3, v),
        lambda v: torch.special.polygamma(0, v) * v,
    ):
        ref = x.clone().requires_grad_()
        want = fn(ref)
        want.sum().backward()
        sx = st.shard(x.clone(), mesh, ("x", None)).requires_grad_()
        got = fn(sx)
        got.sum().backward()
        torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sx.grad.cpu(), ref.grad, rtol=1e-4, atol=1e-4)


def test_sharded_bessel_and_polynomials():
    st, mesh = _mesh()
    x = make((8, 6), F32, low=-9, high=9, seed=9)
    n = torch.arange(6, dtype=F32) * 3 - 2  # -2 .. 13: both sides of the closed-form thresholds
    sx = st.shard(x, mesh, ("x", "y"))
    sn = st.shard(n, mesh, ("y",))
    cases = [
        (torch.special.bessel_j0, (x,), (sx,)),
        (torch.special.modified_bessel_k1, (x.abs(),), (sx.abs(),)),
        (torch.special.airy_ai, (x,), (sx,)),
        (torch.special.chebyshev_polynomial_t, (x / 8, n), (sx / 8, sn)),
        (torch.special.legendre_polynomial_p, (x / 8, n), (sx / 8, sn)),
        (torch.special.hermite_polynomial_h, (x, 4), (sx, 4)),
        (torch.special.shifted_chebyshev_polynomial_w, (0.4, n), (0.4, sn)),
    ]
    for fn, args, sargs in cases:
        torch.testing.assert_close(fn(*sargs).cpu(), fn(*args), **_tol(F32))
