"""Elementwise lowerings: unary math, binary arithmetic with torch's type promotion, comparisons,
bitwise and logical ops, where/clamp/lerp/addcmul/addcdiv/masked_fill, dtype conversion and copies.

Every op follows torch exactly: the result dtype is ``torch.result_type`` of the operands (see
``_promote``), bfloat16/float16 are computed in float32 and rounded once at the end (as torch's CPU
kernels do), integer division and remainder take torch's signs, NaN propagates as in torch.
Powers live in ``power.py``; activations in ``activation.py``; digamma, polygamma and the other special functions in
``special.py``, ``bessel.py`` (Bessel and Airy) and ``polynomials.py`` (orthogonal polynomials).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from shardtensor.ops._promote import (
    BOOL,
    cast,
    dtype_arg,
    dtype_of,
    float_type,
    fresh,
    is_bool,
    is_complex,
    is_float,
    is_int,
    is_python_number,
    opmath,
    promote,
    result_type,
    to_compute,
)
from shardtensor.ops.checks import fail_where
from shardtensor.ops.power import pow_scalar
from shardtensor.ops.registry import register

aten = torch.ops.aten


# ----------------------------------------------------------------------------------------------
# unary math
# ----------------------------------------------------------------------------------------------
def unary_float(fn):
    """Wrap ``fn`` (a function of one jax value) as a torch "floating" unary op: integer and bool
    inputs give the default float dtype; bfloat16/float16 are computed in float32."""

    def lowering(self):
        rt = float_type(self)
        return cast(fn(cast(self, opmath(rt))), rt)

    lowering.__name__ = getattr(fn, "__name__", "unary")
    return lowering


def unary_same(fn, *, int_fn=None):
    """Wrap ``fn`` as a dtype-preserving unary op; ``int_fn`` (default ``fn``) for bool/integers."""

    def lowering(self):
        dt = dtype_of(self)
        if not (is_float(dt) or is_complex(dt)):
            out = (int_fn or fn)(self)
        else:
            out = cast(fn(cast(self, opmath(dt))), dt)
        return fresh(out) if out is self else out

    lowering.__name__ = getattr(fn, "__name__", "unary")
    return lowering


def _sign(x):
    # torch: sign(nan) = 0, sign(-0.) = 0
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)


def _sgn(x):
    if is_complex(x.dtype):
        a = jnp.abs(x)
        return jnp.where(a == 0, jnp.zeros_like(x), x / a.astype(x.dtype))
    return _sign(x)


def _frac(x):
    return x - jnp.trunc(x)


def _angle(x):
    if is_complex(x.dtype):
        return jnp.angle(x)
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.asarray(math.pi, x.dtype), jnp.zeros_like(x)))


def _sinc(x):
    px = x * jnp.asarray(math.pi, x.dtype)
    safe = jnp.where(x == 0, jnp.ones_like(px), px)
    return jnp.where(x == 0, jnp.ones_like(x), jnp.sin(safe) / safe)


_UNARY_FLOAT = {
    aten.exp.default: jnp.exp,
    aten.exp2.default: jnp.exp2,
    aten.expm1.default: jnp.expm1,
    aten.log.default: jnp.log,
    aten.log2.default: jnp.log2,
    aten.log10.default: jnp.log10,
    aten.log1p.default: jnp.log1p,
    aten.sqrt.default: jnp.sqrt,
    aten.rsqrt.default: lax.rsqrt,
    aten.sin.default: jnp.sin,
    aten.cos.default: jnp.cos,
    aten.tan.default: jnp.tan,
    aten.tanh.default: jnp.tanh,
    aten.asin.default: jnp.arcsin,
    aten.acos.default: jnp.arccos,
    aten.atan.default: jnp.arctan,
    aten.sinh.default: jnp.sinh,
    aten.cosh.default: jnp.cosh,
    aten.asinh.default: jnp.arcsinh,
    aten.acosh.default: jnp.arccosh,
    aten.atanh.default: jnp.arctanh,
    aten.sigmoid.default: jax.nn.sigmoid,
    aten.erf.default: lax.erf,
    aten.erfc.default: lax.erfc,
    aten.erfinv.default: lax.erf_inv,
    aten.lgamma.default: lax.lgamma,
    aten.reciprocal.default: lambda x: 1 / x,
    aten.deg2rad.default: jnp.deg2rad,
    aten.rad2deg.default: jnp.rad2deg,
    aten.sinc.default: _sinc,
    aten.angle.default: _angle,
}
_fn: Callable[..., Any]  # the jax function of each registration loop in this module
for _op, _fn in _UNARY_FLOAT.items():
    register(_op)(unary_float(_fn))


def _identity(x):
    return fresh(x)


def _int_sign(x):
    return x if is_bool(x.dtype) else _sign(x)


_UNARY_SAME = {
    aten.abs.default: (jnp.abs, None),
    aten.neg.default: (jnp.negative, lambda x: jnp.logical_not(x) if is_bool(x.dtype) else -x),
    aten.sign.default: (_sign, _int_sign),
    aten.sgn.default: (_sgn, _int_sign),
    aten.floor.default: (jnp.floor, _identity),
    aten.ceil.default: (jnp.ceil, _identity),
    aten.round.default: (jnp.round, _identity),
    aten.trunc.default: (jnp.trunc, _identity),
    aten.frac.default: (_frac, _identity),
    aten.conj_physical.default: (jnp.conj, _identity),
}
for _op, (_fn, _int_fn) in _UNARY_SAME.items():
    register(_op)(unary_same(_fn, int_fn=_int_fn))


@register(aten.round.decimals)
def round_decimals(self, *, decimals=0):
    dt = dtype_of(self)
    if not is_float(dt):
        return fresh(self)
    x = cast(self, opmath(dt))
    if decimals < 0:
        p = jnp.asarray(10.0 ** (-decimals), x.dtype)
        out = jnp.round(x / p) * p
    else:
        p = jnp.asarray(10.0**decimals, x.dtype)
        out = jnp.round(x * p) / p
    return cast(out, dt)


@register(aten.logit.default)
def logit(self, eps=None):
    rt = float_type(self)
    x = cast(self, opmath(rt))
    if eps is not None and eps >= 0:
        lo, hi = jnp.asarray(eps, x.dtype), jnp.asarray(1 - eps, x.dtype)
        x = jnp.where(x < lo, lo, jnp.where(x > hi, hi, x))
    return cast(jnp.log(x / (1 - x)), rt)


@register(aten.nan_to_num.default)
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    dt = dtype_of(self)
    if not is_float(dt):
        return fresh(self)
    info = jnp.finfo(dt)
    nan = 0.0 if nan is None else nan
    posinf = float(info.max) if posinf is None else posinf
    neginf = float(info.min) if neginf is None else neginf
    x = self
    x = jnp.where(jnp.isnan(x), cast(nan, dt), x)
    x = jnp.where(jnp.isposinf(x), cast(posinf, dt), x)
    return jnp.where(jnp.isneginf(x), cast(neginf, dt), x)


# predicates: always bool
def _float_pred(fn, int_value=False):
    def lowering(self):
        if is_float(dtype_of(self)) or is_complex(dtype_of(self)):
            return fn(self)
        return jnp.full(jnp.shape(self), int_value, BOOL)

    return lowering


register(aten.isnan.default)(_float_pred(jnp.isnan))
register(aten.isinf.default)(_float_pred(jnp.isinf))
register(aten.isposinf.default)(_float_pred(jnp.isposinf))
register(aten.isneginf.default)(_float_pred(jnp.isneginf))


@register(aten.isfinite.default)
def isfinite(self):
    if is_float(dtype_of(self)) or is_complex(dtype_of(self)):
        return jnp.isfinite(self)
    return jnp.ones(jnp.shape(self), BOOL)


@register(aten.signbit.default)
def signbit(self):
    dt = dtype_of(self)
    if is_float(dt):
        return jnp.signbit(self)
    if is_bool(dt):
        return jnp.zeros(jnp.shape(self), BOOL)
    return self < 0


# ----------------------------------------------------------------------------------------------
# bitwise and logical
# ----------------------------------------------------------------------------------------------
@register(aten.bitwise_not.default)
def bitwise_not(self):
    return jnp.logical_not(self) if is_bool(dtype_of(self)) else lax.bitwise_not(self)


def _bitwise(fn):
    def lowering(self, other):
        rt, _, a, b = promote(self, other)
        return fn(a, b)

    return lowering


for _name, _fn in (("bitwise_and", lax.bitwise_and), ("bitwise_or", lax.bitwise_or), ("bitwise_xor", lax.bitwise_xor)):
    _packet = getattr(aten, _name)
    register(_packet.Tensor, _packet.Scalar, _packet.Scalar_Tensor)(_bitwise(_fn))


def _shift_left(a, b):
    return lax.shift_left(a, b)


def _shift_right(a, b):
    # torch: arithmetic shift for signed types, logical for unsigned; large shifts saturate (as XLA)
    if np.issubdtype(a.dtype, np.signedinteger):
        return lax.shift_right_arithmetic(a, b)
    return lax.shift_right_logical(a, b)


for _name, _fn in (("bitwise_left_shift", _shift_left), ("bitwise_right_shift", _shift_right)):
    _packet = getattr(aten, _name)
    register(_packet.Tensor, _packet.Tensor_Scalar, _packet.Scalar_Tensor)(_bitwise(_fn))
register(aten.__lshift__.Tensor, aten.__lshift__.Scalar)(_bitwise(_shift_left))  # ``x << 2``
register(aten.__rshift__.Tensor, aten.__rshift__.Scalar)(_bitwise(_shift_right))


def _as_bool(x):
    x = x if isinstance(x, jax.Array) else cast(x, dtype_of(x))
    return x if is_bool(x.dtype) else x != 0


@register(aten.logical_not.default)
def logical_not(self):
    return jnp.logical_not(_as_bool(self))


@register(aten.logical_and.default)
def logical_and(self, other):
    return jnp.logical_and(_as_bool(self), _as_bool(other))


@register(aten.logical_or.default)
def logical_or(self, other):
    return jnp.logical_or(_as_bool(self), _as_bool(other))


@register(aten.logical_xor.default)
def logical_xor(self, other):
    return jnp.logical_xor(_as_bool(self), _as_bool(other))


# ----------------------------------------------------------------------------------------------
# binary arithmetic
# ----------------------------------------------------------------------------------------------
def _is_one(v) -> bool:
    return is_python_number(v) and v == 1


def _scaled(b, alpha, rt, ct):
    """``alpha * b`` in the compute dtype, alpha rounded to the result dtype first (as torch);
    skipped for a Python ``alpha == 1``."""
    if _is_one(alpha):
        return b
    a = to_compute(alpha, rt, ct)
    return jnp.logical_and(b, a) if ct == BOOL else b * a


def _is_bool_operand(v) -> bool:
    return type(v) is bool or (isinstance(v, torch.Tensor) and v.dtype == torch.bool)


def _alpha_args(self, other, alpha=1):
    """``validate`` of add: a bool alpha only for a bool result (torch's alpha_check)."""
    if type(alpha) is bool and not (_is_bool_operand(self) and _is_bool_operand(other)):
        raise RuntimeError("Boolean alpha only supported for Boolean results.")


def _sub_args(self, other, alpha=1):
    """``validate`` of sub/rsub: torch refuses bool operands (its sub_check), then checks alpha."""
    bools = _is_bool_operand(self) + _is_bool_operand(other)
    if bools == 2:
        raise RuntimeError(
            "Subtraction, the `-` operator, with two bool tensors is not supported. "
            "Use the `^` or `logical_xor()` operator instead."
        )
    if bools == 1:
        raise RuntimeError(
            "Subtraction, the `-` operator, with a bool tensor is not supported. "
            "If you are trying to invert a mask, use the `~` or `logical_not()` operator instead."
        )
    _alpha_args(self, other, alpha)


@register(aten.add.Tensor, aten.add.Scalar, validate=_alpha_args)
def add(self, other, alpha=1):
    rt, ct, a, b = promote(self, other)
    b = _scaled(b, alpha, rt, ct)
    return cast(jnp.logical_or(a, b) if ct == BOOL else a + b, rt)


@register(aten.sub.Tensor, aten.sub.Scalar, validate=_sub_args)
def sub(self, other, alpha=1):
    rt, ct, a, b = promote(self, other)
    return cast(a - _scaled(b, alpha, rt, ct), rt)


@register(aten.rsub.Tensor, aten.rsub.Scalar, validate=_sub_args)
def rsub(self, other, alpha=1):
    rt, ct, a, b = promote(self, other)
    return cast(b - _scaled(a, alpha, rt, ct), rt)


@register(aten.mul.Tensor, aten.mul.Scalar)
def mul(self, other):
    rt, ct, a, b = promote(self, other, exact_last=True)
    return cast(jnp.logical_and(a, b) if ct == BOOL else a * b, rt)


def _int_div_floor(a, b):
    a, b = jnp.broadcast_arrays(a, b)
    q = lax.div(a, b)
    r = lax.rem(a, b)
    fix = (r != 0) & ((a < 0) != (b < 0))
    return jnp.where(fix, q - 1, q)


def _float_div_floor(a, b):
    # c10::div_floor_floating
    a, b = jnp.broadcast_arrays(a, b)
    mod = lax.rem(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floordiv = jnp.floor(div)
    floordiv = jnp.where(div - floordiv > 0.5, floordiv + 1, floordiv)
    floordiv = jnp.where(div == 0, jnp.copysign(jnp.zeros_like(div), a / b), floordiv)
    return jnp.where(b == 0, a / b, floordiv)


def true_divide(self, other):
    rt = float_type(self, other)
    ct = opmath(rt)
    return cast(to_compute(self, rt, ct) / to_compute(other, rt, ct, exact=True), rt)


def _check_int_divisor(a, b):
    """torch's integer division and modulo raise on a zero divisor."""
    fail_where(
        jnp.broadcast_to(b == 0, jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))), RuntimeError, "ZeroDivisionError"
    )


def floor_divide(self, other):
    rt, ct, a, b = promote(self, other, exact_last=True)
    if is_int(ct):
        _check_int_divisor(a, b)
    if is_int(ct) or ct == BOOL:
        return cast(_int_div_floor(cast(a, np.int64) if ct == BOOL else a, b), rt)
    return cast(_float_div_floor(a, b), rt)


def trunc_divide(self, other):
    rt, ct, a, b = promote(self, other, exact_last=True)
    if is_int(ct):
        _check_int_divisor(a, b)
    if is_int(ct) or ct == BOOL:
        return cast(lax.div(*jnp.broadcast_arrays(a, b)), rt)
    return cast(jnp.trunc(a / b), rt)


@register(aten.div.Tensor, aten.div.Scalar)
def div(self, other):
    return true_divide(self, other)


@register(aten.div.Tensor_mode, aten.div.Scalar_mode, checked=True)
def div_mode(self, other, *, rounding_mode=None):
    if rounding_mode is None:
        return true_divide(self, other)
    if rounding_mode == "trunc":
        return trunc_divide(self, other)
    if rounding_mode == "floor":
        return floor_divide(self, other)
    raise ValueError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but found '{rounding_mode}'")


register(aten.floor_divide.default, aten.floor_divide.Scalar, checked=True)(floor_divide)


@register(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor, checked=True)
def remainder(self, other):
    rt, ct, a, b = promote(self, other)
    if is_int(ct):
        _check_int_divisor(a, b)
    a, b = jnp.broadcast_arrays(a, b)
    r = lax.rem(a, b)
    r = jnp.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
    return cast(r, rt)


@register(aten.fmod.Tensor, aten.fmod.Scalar, checked=True)
def fmod(self, other):
    rt, ct, a, b = promote(self, other)
    if is_int(ct):
        _check_int_divisor(a, b)
    return cast(lax.rem(*jnp.broadcast_arrays(a, b)), rt)


def _binary_float(fn):
    """A binary op that computes in floating point (ints promote to the default float)."""

    def lowering(self, other):
        rt = float_type(self, other)
        ct = opmath(rt)
        return cast(fn(to_compute(self, rt, ct), to_compute(other, rt, ct)), rt)

    return lowering


def _xlogy(x, y):
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, jnp.zeros_like(x), x * jnp.log(y)))


def _xlog1py(x, y):
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, jnp.zeros_like(x), x * jnp.log1p(y)))


register(aten.atan2.default)(_binary_float(jnp.arctan2))
register(aten.hypot.default)(_binary_float(jnp.hypot))
register(aten.logaddexp.default)(_binary_float(jnp.logaddexp))
register(aten.logaddexp2.default)(_binary_float(jnp.logaddexp2))
register(aten.copysign.Tensor, aten.copysign.Scalar)(_binary_float(jnp.copysign))
register(aten.xlogy.Tensor, aten.xlogy.Scalar_Other, aten.xlogy.Scalar_Self)(_binary_float(_xlogy))
register(aten.special_xlog1py.default, aten.special_xlog1py.other_scalar, aten.special_xlog1py.self_scalar)(
    _binary_float(_xlog1py)
)


@register(aten.gcd.default)
def gcd(self, other):
    rt, _, a, b = promote(self, other)
    return jnp.gcd(*jnp.broadcast_arrays(a, b)).astype(rt)


@register(aten.lcm.default)
def lcm(self, other):
    rt, _, a, b = promote(self, other)
    a, b = jnp.broadcast_arrays(a, b)
    g = jnp.gcd(a, b)
    safe = jnp.where(g == 0, jnp.ones_like(g), g)
    return jnp.where(g == 0, jnp.zeros_like(a), jnp.abs(lax.div(a, safe) * b)).astype(rt)


@register(aten.frexp.Tensor)
def frexp(self):
    dt = dtype_of(self)
    m, e = jnp.frexp(cast(self, opmath(dt)))
    return cast(m, dt), e.astype(np.int32)


@register(aten.ldexp.Tensor)
def ldexp(self, other):
    # torch: self * 2.0 ** other, with the promotions of those two ops
    return mul(self, pow_scalar(2.0, other))


def _binary_same(fn):
    """A binary op computed in the promoted dtype (no float upcast for bf16: exact ops)."""

    def lowering(self, other):
        rt = result_type(self, other)
        return fn(*jnp.broadcast_arrays(cast(self, rt), cast(other, rt)))

    return lowering


maximum = register(aten.maximum.default)(_binary_same(lax.max))  # NaN-propagating, as torch
minimum = register(aten.minimum.default)(_binary_same(lax.min))
register(aten.fmax.default)(_binary_same(jnp.fmax))  # NaN-ignoring
register(aten.fmin.default)(_binary_same(jnp.fmin))
register(aten.nextafter.default)(_binary_same(jnp.nextafter))


@register(aten.heaviside.default)
def heaviside(self, values):
    rt = result_type(self, values)
    x, v = cast(self, rt), cast(values, rt)
    return jnp.where(x == 0, v, (x > 0).astype(rt))


# comparisons: computed in the promoted dtype, bool result
def _compare(fn):
    def lowering(self, other):
        rt = result_type(self, other)
        return fn(cast(self, rt), cast(other, rt))

    return lowering


for _name, _fn in (
    ("eq", jnp.equal),
    ("ne", jnp.not_equal),
    ("lt", jnp.less),
    ("le", jnp.less_equal),
    ("gt", jnp.greater),
    ("ge", jnp.greater_equal),
):
    _packet = getattr(aten, _name)
    register(_packet.Tensor, _packet.Scalar)(_compare(_fn))


# ----------------------------------------------------------------------------------------------
# where, clamp, lerp, addcmul, addcdiv, masked_fill
# ----------------------------------------------------------------------------------------------
@register(aten.where.self)
def where(condition, self, other):
    rt = result_type(self, other)
    return jnp.where(_as_bool(condition), cast(self, rt), cast(other, rt))


@register(aten.clamp.default, aten.clamp.Tensor)
def clamp(self, min=None, max=None):
    rt = result_type(self, min, max)
    x = cast(self, rt)
    if min is not None:
        x = lax.max(*jnp.broadcast_arrays(x, cast(min, rt)))
    if max is not None:
        x = lax.min(*jnp.broadcast_arrays(x, cast(max, rt)))
    return fresh(x) if x is self else x


@register(aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp_min(self, min):
    return clamp(self, min, None)


@register(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(self, max):
    return clamp(self, None, max)


@register(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp(self, end, weight):
    rt = result_type(self, end)
    ct = opmath(rt)
    a, b, w = cast(self, ct), cast(end, ct), cast(weight, ct)
    small = jnp.abs(w) < 0.5
    return cast(jnp.where(small, a + w * (b - a), b - (b - a) * (1 - w)), rt)


@register(aten.addcmul.default)
def addcmul(self, tensor1, tensor2, *, value=1):
    rt, ct, s, t1, t2 = promote(self, tensor1, tensor2)
    if ct == BOOL:
        return jnp.logical_or(s, jnp.logical_and(cast(value, BOOL), jnp.logical_and(t1, t2)))
    if _is_one(value):
        return cast(s + t1 * t2, rt)
    return cast(s + cast(value, ct) * t1 * t2, rt)


@register(aten.addcdiv.default)
def addcdiv(self, tensor1, tensor2, *, value=1):
    rt, ct, s, t1, t2 = promote(self, tensor1, tensor2)
    if _is_one(value):
        return cast(s + t1 / t2, rt)
    return cast(s + cast(value, ct) * t1 / t2, rt)


@register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(self, mask, value):
    dt = dtype_of(self)
    return jnp.where(_as_bool(mask), cast(value, dt), self)


# ----------------------------------------------------------------------------------------------
# conversion, copies, fills
# ----------------------------------------------------------------------------------------------
@register(aten._to_copy.default)
def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    if dtype is None:
        return fresh(self)
    dt = dtype_arg(dtype)
    if is_complex(dtype_of(self)) and not is_complex(dt):
        return cast(jnp.real(self), dt)
    out = cast(self, dt)
    return fresh(out) if out is self else out


@register(aten.clone.default)
def clone(self, *, memory_format=None):
    return fresh(self)


@register(aten.copy.default)
def copy(self, src, non_blocking=False):
    return fresh(jnp.broadcast_to(_to_copy(src, dtype=dtype_of(self)), jnp.shape(self)))


@register(aten.fill.Scalar, aten.fill.Tensor)
def fill(self, value):
    return jnp.broadcast_to(cast(value, dtype_of(self)), jnp.shape(self))


@register(aten.zero.default)
def zero(self):
    return jnp.zeros(jnp.shape(self), dtype_of(self))
