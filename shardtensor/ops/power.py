"""Powers: ``pow`` with torch's rules — the exponents its kernel special-cases, integer powers by
repeated squaring, and the errors it raises.

Example (what ``x ** 2`` records)::

    pow_tensor_scalar(x, 2)   # x * x: the exponent is baked into the program, as torch special-cases it
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from shardtensor.ops._promote import (
    BOOL,
    cast,
    dtype_of,
    is_complex,
    is_int,
    is_python_number,
    opmath,
    result_type,
    to_compute,
)
from shardtensor.ops.checks import fail_where
from shardtensor.ops.registry import register

aten = torch.ops.aten


def _int_pow(base, exp):
    """Integer power by repeated squaring with torch's rules for negative exponents."""
    if isinstance(exp, (int, np.integer)) and not isinstance(exp, bool):
        if exp >= 0:
            return lax.integer_pow(base, int(exp)) if exp > 0 else jnp.ones_like(base)
        exp = jnp.asarray(exp, base.dtype)
    base, exp = jnp.broadcast_arrays(base, exp.astype(base.dtype))

    def body(state):
        acc, b, e = state
        acc = jnp.where((e & 1) == 1, acc * b, acc)
        return acc, b * b, e >> 1

    def cond(state):
        return jnp.any(state[2] > 0)

    acc, _, _ = lax.while_loop(cond, body, (jnp.ones_like(base), base, jnp.maximum(exp, 0)))
    if np.issubdtype(base.dtype, np.signedinteger):
        neg = jnp.where(base == 1, 1, jnp.where(base == -1, jnp.where(exp % 2 == 0, 1, -1), 0)).astype(base.dtype)
        acc = jnp.where(exp < 0, neg, acc)
    return acc


_SPECIAL_EXPONENTS = (2, 3, 1, 0, 0.5, -0.5, -1, -2)


def _float_pow_scalar(x, e):
    """``x ** e`` for the exponents torch special-cases (``_SPECIAL_EXPONENTS``); None for others."""
    if e == 2:
        return x * x
    if e == 3:
        return x * x * x
    if e == 1:
        return x
    if e == 0:
        return jnp.ones_like(x)
    if e == 0.5:
        return jnp.sqrt(x)
    if e == -0.5:
        return lax.rsqrt(x)
    if e == -1:
        return 1 / x
    if e == -2:
        return 1 / (x * x)
    return None


def pow_(self, exponent):
    rt = result_type(self, exponent)
    if is_int(rt) or rt == BOOL:
        ct = np.dtype(np.int64) if rt == BOOL else rt
        e = exponent if is_python_number(exponent) else cast(exponent, ct)
        return cast(_int_pow(cast(self, ct), e), rt)
    ct = opmath(rt)
    if is_python_number(exponent) and not is_complex(ct) and not isinstance(self, (int, float)):
        out = _float_pow_scalar(to_compute(self, rt, ct), exponent)
        if out is not None:
            return cast(out, rt)
    return cast(jnp.power(to_compute(self, rt, ct), to_compute(exponent, rt, ct)), rt)


register(aten.pow.Tensor_Tensor)(pow_)


# the exponents torch's kernel special-cases are baked into the program (x ** 2 is x * x, as in
# torch; a runtime exponent would be XLA's general power); any other exponent stays a runtime input
# (its dtype is the lowering's: torch's meta kernel says int64 for a bool tensor to a bool power, its
# CPU kernel gives bool)
@register(aten.pow.Tensor_Scalar, static_scalars=frozenset(_SPECIAL_EXPONENTS), checked=True, dtypes_from_lowering=True)
def pow_tensor_scalar(self, exponent):
    """``self ** exponent``: as ``pow_``, and like torch it refuses an integer (or bool) tensor to a
    negative integer Scalar power (a tensor of exponents follows the 1 / -1 / 0 rule instead)."""
    integral = is_int(dtype_of(exponent)) or dtype_of(exponent) == BOOL
    if integral and (is_int(dtype_of(self)) or dtype_of(self) == BOOL):
        fail_where(jnp.asarray(exponent) < 0, RuntimeError, "Integers to negative integer powers are not allowed.")
        if is_python_number(exponent) and exponent < 0:
            exponent = 0  # (baked: a negative Python int does not fit an unsigned tensor's dtype)
    return pow_(self, exponent)


@register(aten.pow.Scalar)
def pow_scalar(self, exponent):
    if is_python_number(self) and self == 1:
        return jnp.ones(jnp.shape(exponent), result_type(self, exponent))
    return pow_(self, exponent)
