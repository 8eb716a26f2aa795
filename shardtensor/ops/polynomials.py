"""The orthogonal polynomials of ``torch.special`` (Chebyshev T/U/V/W and their shifted forms,
Hermite H and He, Laguerre, Legendre) as torch's CPU kernels run them: the three-term recurrence
for ``n`` up to the largest ``n`` in the tensor (a ``lax.while_loop``), with torch's closed forms
for large ``n`` inside (-1, 1), in float32 or float64 only, as torch.

Example::

    x = st.shard(torch.linspace(-1, 1, 8), mesh, ("x",))
    torch.special.chebyshev_polynomial_t(x, 3)   # n_scalar overload: T_3(x)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from shardtensor.ops._promote import FLOAT32, FLOAT64, cast, float_type
from shardtensor.ops.registry import register

aten = torch.ops.aten
F64 = np.dtype(np.float64)


# ----------------------------------------------------------------------------------------------
# orthogonal polynomials: f(x, n) with n a tensor (or either one a Scalar)
# ----------------------------------------------------------------------------------------------
def _degree(n):
    """torch's static_cast<int64_t>(n) of n in the compute dtype; NaN, inf and out-of-range values
    (INT64_MIN on x86) count as negative degrees."""
    ok = jnp.isfinite(n) & (jnp.abs(n) < 2.0**63)
    return jnp.where(ok, n, -1).astype(np.int64)


def _recurrence(p0, q0, iters, use, step, stop_at_nan=True):
    """torch's loop ``for (j = 1; j <= iters && !isnan(q); j++) { r = step(j, p, q); p = q; q = r; }``
    on the lanes in ``use``, run until the last lane is done. Returns the final q."""

    def active(j, q):
        a = use & (j <= iters)
        return a & ~jnp.isnan(q) if stop_at_nan else a

    def body(state):
        j, p, q = state
        a = active(j, q)
        r = step(j.astype(q.dtype), p, q)
        return j + 1, jnp.where(a, q, p), jnp.where(a, r, q)

    state = (jnp.asarray(1, np.int64), p0, q0)
    return lax.while_loop(lambda s: jnp.any(active(s[0], s[2])), body, state)[2]


def _alternate(nn, v):
    """(-1)^n v."""
    return jnp.where(nn % 2 == 0, v, -v)


def _f64(fn):
    """``fn`` evaluated in float64 and rounded back to float32: XLA's float32 acos is a few ulp off,
    which the closed forms' n * acos(x) magnify. (torch's libm acosf is itself up to 1 ulp off, so
    float32 results for n in the hundreds agree to ~1e-4, not bit for bit.)"""
    return lambda v: fn(v.astype(F64)).astype(v.dtype)


_acos, _cos, _sin = _f64(jnp.arccos), _f64(jnp.cos), _f64(jnp.sin)


def _chebyshev(kind, shifted):
    """Chebyshev T/U/V/W (of x, or of 2x - 1 when shifted), with torch's endpoint values, closed forms
    cos/sin(. acos y) for n above a threshold inside (-1, 1), and the recurrence 2y q - p otherwise."""
    threshold = {"t": 6, "u": 6 if shifted else 8, "v": 6 if shifted else 8, "w": 4 if shifted else 8}[kind]

    def fn(x, nn):
        y = x + x - 1 if shifted else x
        one = jnp.ones_like(x)
        n1, n21 = (nn + 1).astype(x.dtype), (nn + nn + 1).astype(x.dtype)
        th = _acos(y)
        if kind == "t":
            q0, at_pos, at_neg = y, one, _alternate(nn, one)
            closed = _cos(nn.astype(x.dtype) * th)
        elif kind == "u":
            q0, at_pos, at_neg = y + y, n1, _alternate(nn, n1)
            s = _sin(th)
            closed = jnp.where(s != 0, _sin(n1 * th) / s, n1 * _cos(n1 * th) / y)
        elif kind == "v":
            q0, at_pos, at_neg = y + y - 1, one, _alternate(nn, n21)
            closed = jnp.where(
                _sin(th / 2) != 1, _cos((nn.astype(x.dtype) + 0.5) * th) / _cos(th / 2), _alternate(nn, n21)
            )
        else:
            q0, at_pos, at_neg = y + y + 1, n21, _alternate(nn, one)
            fallback = _alternate(nn, one) if shifted else jnp.where(x > 0, n21, _alternate(nn, one))
            closed = jnp.where(_cos(th / 2) != 1, _sin((nn.astype(x.dtype) + 0.5) * th) / _sin(th / 2), fallback)
        is_pos = (x == 1) if shifted else (jnp.abs(x) == 1) & (x > 0)
        is_neg = (x == 0) if shifted else (jnp.abs(x) == 1) & ~(x > 0)
        use_closed = (nn > threshold) & (jnp.abs(y) < 1)
        use = (nn >= 2) & ~is_pos & ~is_neg & ~use_closed
        rec = _recurrence(one, q0, nn - 1, use, lambda j, p, q: (y + y) * q - p)
        out = jnp.where(nn == 1, q0, rec)
        out = jnp.where(nn == 0, one, out)
        out = jnp.where(use_closed, closed, out)
        out = jnp.where(is_neg, at_neg, jnp.where(is_pos, at_pos, out))
        return jnp.where(nn < 0, 0, out)

    return fn


def _hermite(physicists):
    """Hermite H (physicists') or He (probabilists'); NaN above torch's degree limit."""

    def fn(x, nn):
        one = jnp.ones_like(x)
        limit = {FLOAT32: 128, FLOAT64: 512}[np.dtype(x.dtype)]

        def step(j, p, q):  # H: 2x q - k p with k = 2j; He: x q - j p
            return (x + x) * q - (j + j) * p if physicists else x * q - j * p

        q0 = x + x if physicists else x
        rec = _recurrence(one, q0, nn - 1, (nn >= 2) & (nn <= limit), step, stop_at_nan=False)
        out = jnp.where(nn > limit, jnp.nan, rec)
        out = jnp.where(nn == 1, q0, out)
        out = jnp.where(nn == 0, one, out)
        return jnp.where(nn < 0, 0, out)

    return fn


def _laguerre(x, nn):
    one = jnp.ones_like(x)
    q0 = 1 - x
    rec = _recurrence(one, q0, nn - 1, nn >= 2, lambda j, p, q: ((j + j + (1 - x)) * q - j * p) / (j + 1))
    out = jnp.where(nn == 1, q0, rec)
    out = jnp.where((nn == 0) | (x == 0), one, out)
    return jnp.where(nn < 0, 0, out)


def _legendre(x, nn):
    one = jnp.ones_like(x)
    rec = _recurrence(one, x, nn - 1, nn >= 2, lambda j, p, q: ((j + j + 1) * x * q - j * p) / (j + 1))
    out = jnp.where(nn == 1, x, rec)
    out = jnp.where(nn == 0, one, out)
    out = jnp.where(jnp.abs(x) == 1, jnp.where((x > 0) | (nn % 2 == 0), one, -one), out)
    return jnp.where(nn < 0, 0, out)


def _polynomial(name, fn):
    def lowering(x, n):
        rt = float_type(x, n)
        if rt not in (FLOAT32, FLOAT64):  # torch's CPU kernels have float and double only
            c10_name = {"float16": "Half", "bfloat16": "BFloat16"}.get(rt.name, rt.name)
            raise RuntimeError(f"\"{name}_cpu\" not implemented for '{c10_name}'")
        xv, nv = jnp.broadcast_arrays(cast(x, rt), cast(n, rt))
        return fn(xv, _degree(nv)).astype(rt)

    lowering.__name__ = name
    return lowering


_POLYNOMIALS = {
    "chebyshev_polynomial_t": _chebyshev("t", False),
    "chebyshev_polynomial_u": _chebyshev("u", False),
    "chebyshev_polynomial_v": _chebyshev("v", False),
    "chebyshev_polynomial_w": _chebyshev("w", False),
    "shifted_chebyshev_polynomial_t": _chebyshev("t", True),
    "shifted_chebyshev_polynomial_u": _chebyshev("u", True),
    "shifted_chebyshev_polynomial_v": _chebyshev("v", True),
    "shifted_chebyshev_polynomial_w": _chebyshev("w", True),
    "hermite_polynomial_h": _hermite(True),
    "hermite_polynomial_he": _hermite(False),
    "laguerre_polynomial_l": _laguerre,
    "legendre_polynomial_p": _legendre,
}
for _name, _fn in _POLYNOMIALS.items():
    _packet = getattr(aten, "special_" + _name)
    register(_packet.default, _packet.x_scalar, _packet.n_scalar)(_polynomial(_name, _fn))
