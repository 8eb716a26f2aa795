"""Special functions: digamma, trigamma, polygamma, mvlgamma, and the scipy-style helpers (i0, i0e,
i1, i1e, ndtri, log_ndtr, erfcx, entr, zeta, igamma); the Bessel and Airy functions are in
``bessel.py``, the orthogonal polynomials in ``polynomials.py``.

Each follows torch's CPU kernel (ATen's ``Math.h``, after Cephes): the same approximations (the
coefficient tables are Cephes' published constants), in the same precision — float32 inputs compute
in float32 except where torch widens (the Hurwitz zeta behind ``polygamma(n >= 2, x)`` runs in
float64, as ATen's CPU accumulate type) — with torch's values at poles, endpoints and infinities.

Example::

    x = st.shard(torch.linspace(0.5, 20, 8), mesh, ("x",))
    torch.digamma(x)
    torch.polygamma(2, -x)                           # finite between the poles, inf at them
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import torch
from jax import lax

from shardtensor.ops._promote import cast, float_type, opmath
from shardtensor.ops.elementwise import _binary_float, unary_float
from shardtensor.ops.registry import register

aten = torch.ops.aten
prims = torch.ops.prims
F64 = np.dtype(np.float64)


def _horner(z, coeffs):
    """sum(c * z**(len-1-i)): torch's coefficient loops (``r = r * z + c``) in z's dtype."""
    r = jnp.full_like(z, coeffs[0])
    for c in coeffs[1:]:
        r = r * z + c
    return r


def _chbevl(t, coeffs):
    """Cephes' Chebyshev series (Clenshaw), as torch runs it: ``0.5 * (b0 - b2)``."""
    p = q = jnp.zeros_like(t)
    a = jnp.full_like(t, coeffs[0])
    for c in coeffs[1:]:
        p, q = q, a
        a = t * q - p + c
    return 0.5 * (a - p)


# ----------------------------------------------------------------------------------------------
# digamma, trigamma, polygamma, mvlgamma
# ----------------------------------------------------------------------------------------------
_PSI_10 = 2.25175258906672110764  # digamma(10)
_DIGAMMA_A = (
    8.33333333333333333333e-2,
    -2.10927960927960927961e-2,
    7.57575757575757575758e-3,
    -4.16666666666666666667e-3,
    3.96825396825396825397e-3,
    -8.33333333333333333333e-3,
    8.33333333333333333333e-2,
)


def _digamma(x):
    """torch's calc_digamma: reflection below 0 (its pi/tan term in float64, from the exact fraction
    of x), recurrence up to 10, then the asymptotic series."""
    neg = x < 0
    frac = x - jnp.trunc(x)  # modf: exact
    refl = (math.pi / jnp.tan(math.pi * frac.astype(F64))).astype(x.dtype)
    y = jnp.where(neg, 1 - x, x)
    acc = jnp.zeros_like(x)
    for _ in range(10):  # while (y < 10) { acc -= 1 / y; y += 1 }: at most 10 steps for y > 0
        low = y < 10
        acc = jnp.where(low, acc - 1 / jnp.where(low, y, 1), acc)
        y = jnp.where(low, y + 1, y)
    z = 1 / (y * y)
    tail = jnp.where(y < 1e17, z * _horner(z, _DIGAMMA_A), 0)
    out = jnp.where(y == 10, acc + _PSI_10, acc + jnp.log(y) - 0.5 / y - tail)
    out = jnp.where(neg, out - refl, out)
    out = jnp.where(neg & (x == jnp.trunc(x)), jnp.nan, out)  # poles (and -inf): NaN
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x).astype(x.dtype), out)  # ±0 -> ∓inf


def _trigamma(x):
    """torch's trigamma, in x's dtype (float32 too): reflection below 0.5, 6 recurrence steps, series."""
    pi = np.asarray(math.pi, x.dtype)
    small = x < 0.5
    s = jnp.sin(pi * x)
    acc = jnp.where(small, -(pi * pi) / (s * s), 0).astype(x.dtype)
    y = jnp.where(small, 1 - x, x)
    for _ in range(6):
        acc = acc + 1 / (y * y)
        y = y + 1
    ixx = 1 / (y * y)
    acc = acc + (1 + 1 / (2 * y) + ixx * (1 / 6 - ixx * (1 / 30 - ixx * (1 / 42)))) / y
    return jnp.where(small, -acc, acc)


_ZETA_A = (
    12.0,
    -720.0,
    30240.0,
    -1209600.0,
    47900160.0,
    -1.8924375803183791606e9,
    7.47242496e10,
    -2.950130727918164224e12,
    1.1646782814350067249e14,
    -4.5979787224074726105e15,
    1.8152105401943546773e17,
    -7.1661652561756670113e18,
)  # (2k)! / B_2k
_MACHEP = 1.11022302462515654042e-16


def _hurwitz_zeta_positive(s, q):
    """zeta(s, q) for an integer s >= 2 and q > 0, float64: torch's (Cephes') 9 direct terms then
    Euler-Maclaurin, with its early exits (masks, so every lane stops where torch's loop would)."""
    acc = jnp.power(q, -float(s))
    a, b = q, jnp.zeros_like(q)
    done = jnp.zeros(q.shape, bool)
    for _ in range(9):  # for q > 0 torch's `while (i < 9 || a <= 9)` makes exactly 9 steps
        a = a + 1
        b = jnp.where(done, b, jnp.power(a, -float(s)))
        acc = jnp.where(done, acc, acc + b)
        done = done | ((-_MACHEP * acc < b) & (b < _MACHEP * acc))
    direct = acc
    w = a
    acc = acc + b * w / (s - 1) - 0.5 * b
    fin = jnp.zeros(q.shape, bool)
    coef, k = 1.0, 0.0
    for div in _ZETA_A:
        coef *= s + k
        b = b / w
        t = coef * b / div
        acc = jnp.where(fin, acc, acc + t)
        fin = fin | (jnp.abs(t / acc) < _MACHEP)
        k += 1
        coef *= s + k
        b = b / w
        k += 1
    return jnp.where(done, direct, acc)


@functools.cache
def _cot_derivative(n: int) -> tuple:
    """Integer coefficients (by power of c) of P_n with d^n/dx^n cot(pi x) = pi^n P_n(cot(pi x)):
    P_0 = c, P_{k+1} = -(1 + c^2) P_k'."""
    p = [0, 1]
    for _ in range(n):
        d = [i * p[i] for i in range(1, len(p))] + [0, 0]
        p = [-(d[i] + (d[i - 2] if i >= 2 else 0)) for i in range(len(d))]
    return tuple(p)


def _polygamma_high(n: int, x):
    """polygamma(n >= 2, x) = (-1)^(n+1) n! zeta(n+1, x), as torch: zeta in float64, rounded to x's
    dtype, times the sign and n! (exp(lgamma(n+1))) in x's dtype. Torch sums the series straight from
    a negative q; here q < 0 uses the reflection zeta(s, q) = (-1)^n (zeta(s, 1-q) + pi^s P_n(cot pi q) / n!):
    the same function without a loop as long as |q|, and without the direct sum's cancellation (where
    that costs torch digits, e.g. n = 12 at half-integers, this is the closer to the exact value)."""
    q = x.astype(F64)
    neg = q < 0
    z = _hurwitz_zeta_positive(n + 1, jnp.where(neg, 1 - q, q))
    r = q - jnp.round(q)  # exact; cot(pi q) = cot(pi r), and near r = 1/2 sign(r) tan(pi (1/2 - |r|))
    # (keeps c's relative accuracy: P_n weighs c's errors by ~n!)
    c = jnp.where(jnp.abs(r) < 0.25, 1 / jnp.tan(math.pi * r), jnp.sign(r) * jnp.tan(math.pi * (0.5 - jnp.abs(r))))
    scale = math.exp((n + 1) * math.log(math.pi) - math.lgamma(n + 1))
    refl = (-1) ** n * (z + scale * _horner(c, _cot_derivative(n)[::-1]))
    z = jnp.where(neg, refl, z)
    z = jnp.where((q <= 0) & (q == jnp.floor(q)), jnp.inf, z)  # poles and -inf
    with np.errstate(over="ignore"):
        fact = np.exp(np.asarray(math.lgamma(n + 1), x.dtype))
    sign = np.asarray(1 if n % 2 else -1, x.dtype)
    return (sign * fact) * z.astype(x.dtype)


@register(aten.polygamma.default)
def polygamma(n, self):
    if n < 0:
        raise RuntimeError("polygamma(n, x) does not support negative n.")
    rt = float_type(self)
    x = cast(self, opmath(rt))
    out = _digamma(x) if n == 0 else _trigamma(x) if n == 1 else _polygamma_high(n, x)
    return cast(out, rt)


@register(aten.mvlgamma.default)
def mvlgamma(self, p):
    rt = float_type(self)
    x = cast(self, opmath(rt))
    out = sum(lax.lgamma(x - i / 2) for i in range(p)) + p * (p - 1) / 4 * math.log(math.pi)
    return cast(out, rt)


_UNARY = {
    (aten.digamma.default, prims.digamma.default): _digamma,
    # scipy-style helpers: jax.scipy's Cephes ports agree with torch's kernels to float32 tolerance
    (aten.i0.default, prims.bessel_i0.default): jsp.i0,
    (aten.special_i0e.default, prims.bessel_i0e.default): jsp.i0e,
    (aten.special_i1.default, prims.bessel_i1.default): jsp.i1,
    (aten.special_i1e.default, prims.bessel_i1e.default): jsp.i1e,
    (aten.special_ndtri.default, prims.ndtri.default): jsp.ndtri,
    (aten.special_log_ndtr.default,): jsp.log_ndtr,
    (aten.special_erfcx.default, prims.erfcx.default): jsp.erfcx,
    (aten.special_entr.default,): jsp.entr,
}
for _ops, _fn in _UNARY.items():
    register(*_ops)(unary_float(_fn))

register(aten.igamma.default, prims.igamma.default)(_binary_float(jsp.gammainc))
register(aten.igammac.default, prims.igammac.default)(_binary_float(jsp.gammaincc))


def _zeta(x, q):
    """Hurwitz zeta with torch's (Cephes') domain rules: inf at x == 1 and at the poles q = 0, -1, ...
    (jax gives NaN there for x > 1), NaN for x < 1 (jax: inf at x == 0 on a pole)."""
    out = jnp.where((q <= 0) & (q == jnp.floor(q)), jnp.inf, jsp.zeta(x, q))
    return jnp.where(x == 1, jnp.inf, jnp.where(x < 1, jnp.nan, out))


register(aten.special_zeta.default, aten.special_zeta.other_scalar, aten.special_zeta.self_scalar, prims.zeta.default)(
    _binary_float(_zeta)
)
