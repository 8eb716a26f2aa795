"""Torch's type promotion, computed from jax operands.

torch promotes in three tiers (``torch.result_type``): tensors with dimensions win over 0-dim tensors,
which win over Python scalars ("wrapped numbers"), unless a lower tier is of a higher *category*
(bool < integer < floating < complex). A Python float in the lowest tier counts as the default dtype
(float32), a Python int as int64.

Here a Python number, or a 0-d *weakly typed* jax value (what the dispatcher makes of a Python
scalar), is a wrapped number; any other jax value is a tensor.

Example::

    result_type(int32_array, 2.5)        # float32 (torch), where jax under x64 would say float64
    result_type(float16_array, f64_0d)   # float16: a 0-dim tensor does not win within a category
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from shardtensor.dtypes import to_jax, to_torch

BOOL = np.dtype(np.bool_)
INT64 = np.dtype(np.int64)
FLOAT32 = np.dtype(np.float32)
FLOAT64 = np.dtype(np.float64)
_LOW_FLOATS = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))

_DIM, _ZERO, _WRAPPED = 0, 1, 2


def is_jax(x) -> bool:
    """Whether ``x`` is a jax array or tracer."""
    return isinstance(x, jax.Array)


def is_weak(x) -> bool:
    """A Python number or a 0-d weakly typed jax value: torch's "wrapped number"."""
    if isinstance(x, (numbers.Number, np.generic)):
        return True
    if is_jax(x):
        return x.ndim == 0 and bool(getattr(jax.typeof(x), "weak_type", False))
    return False


def dtype_of(x) -> np.dtype:
    """The numpy dtype of a jax value or a Python number (Python numbers: bool/int64/float64/complex128)."""
    if is_jax(x) or isinstance(x, (np.ndarray, np.generic)):
        return np.dtype(x.dtype)
    if isinstance(x, (bool, np.bool_)):
        return BOOL
    if isinstance(x, numbers.Integral):
        return INT64
    if isinstance(x, numbers.Real):
        return FLOAT64
    if isinstance(x, numbers.Complex):
        return np.dtype(np.complex128)
    raise TypeError(f"not a tensor or a number: {x!r}")


def is_bool(dt) -> bool:
    return np.dtype(dt) == BOOL


def is_int(dt) -> bool:
    """Integral, bool excluded."""
    return np.issubdtype(np.dtype(dt), np.integer)


def is_float(dt) -> bool:
    """Real floating point (bfloat16 and float8 included)."""
    return jnp.issubdtype(np.dtype(dt), jnp.floating)


def is_complex(dt) -> bool:
    return np.issubdtype(np.dtype(dt), np.complexfloating)


def default_float() -> np.dtype:
    """torch's default floating dtype (``torch.get_default_dtype()``), as a numpy dtype."""
    return to_jax(torch.get_default_dtype())


def default_complex() -> np.dtype:
    return np.dtype(np.complex128) if default_float() == FLOAT64 else np.dtype(np.complex64)


def _category(dt: np.dtype) -> int:
    if dt == BOOL:
        return 0
    if is_int(dt):
        return 1
    if is_float(dt):
        return 2
    return 3


@functools.cache
def _promote_pair(a: np.dtype | None, b: np.dtype | None) -> np.dtype | None:
    if a is None:
        return b
    if b is None:
        return a
    return to_jax(torch.promote_types(to_torch(a), to_torch(b)))


def _to_complex(dt: np.dtype) -> np.dtype:
    return np.dtype(np.complex128) if dt == FLOAT64 else np.dtype(np.complex64)


def _combine(higher: np.dtype | None, lower: np.dtype | None) -> np.dtype | None:
    # c10's combine_categories (aten/src/ATen/native/TypeProperties.cpp)
    if higher is None:
        return lower
    if lower is None:
        return higher
    if is_complex(higher):
        return higher
    if is_complex(lower):
        return _to_complex(higher) if is_float(higher) else lower
    if is_float(higher):
        return higher
    if higher == BOOL or is_float(lower):
        return _promote_pair(higher, lower)
    return higher


@functools.lru_cache(maxsize=4096)
def _result_type_cached(key: tuple, default: np.dtype) -> np.dtype:
    tiers: list[np.dtype | None] = [None, None, None]
    for tier, dt in key:
        if tier == _WRAPPED:
            if is_float(dt):
                dt = default
            elif is_complex(dt):
                dt = _to_complex(default)
        tiers[tier] = _promote_pair(tiers[tier], dt)
    out = _combine(tiers[_DIM], _combine(tiers[_ZERO], tiers[_WRAPPED]))
    if out is None:
        raise TypeError("result_type() needs at least one operand")
    return out


def _tier(x) -> tuple[int, np.dtype]:
    dt = dtype_of(x)
    if is_weak(x):
        return _WRAPPED, dt
    return (_ZERO if np.ndim(x) == 0 else _DIM), dt


def result_type(*xs) -> np.dtype:
    """torch's result dtype of the operands (``None`` operands are skipped), as a numpy dtype."""
    key = tuple(_tier(x) for x in xs if x is not None)
    return _result_type_cached(key, default_float())


def float_type(*xs) -> np.dtype:
    """Result dtype of an op that always gives floating point (true division, sin, ...):
    the promoted dtype, or the default float dtype if that is bool or integral."""
    dt = result_type(*xs)
    return dt if (is_float(dt) or is_complex(dt)) else default_float()


def opmath(dt) -> np.dtype:
    """The dtype torch computes in on CPU: float32 for bfloat16/float16 (and float8), else itself."""
    dt = np.dtype(dt)
    if dt in _LOW_FLOATS or (is_float(dt) and dt.itemsize == 1):
        return FLOAT32
    return dt


def acc_dtype(dt) -> np.dtype:
    """The dtype torch's CPU kernels accumulate sums and products in: ``opmath``'s (float32 for
    half types). The one rule every lowering uses.

    Example: ``acc_dtype(jnp.bfloat16) == jnp.float32``.
    """
    return opmath(dt)


def cast(x, dt):
    """``x`` (jax value or Python number) as a strongly typed jax value of dtype ``dt``."""
    dt = np.dtype(dt)
    if is_jax(x) and x.dtype == dt and not getattr(jax.typeof(x), "weak_type", False):
        return x
    return lax.convert_element_type(x, dt)


def to_compute(x, rt, ct, *, exact=False):
    """Operand ``x`` of an op with result dtype ``rt`` computed in ``ct``: rounded to ``rt`` first (the
    common-dtype cast of torch's TensorIterator), then widened. ``exact``: a 0-d operand keeps its
    original value (torch's mul/div kernels read a scalar divisor/factor in opmath precision)."""
    if x is None:
        return None
    if ct != rt and not (exact and np.ndim(x) == 0):
        x = cast(x, rt)
    return cast(x, ct)


def promote(*xs, dtype=None, exact_last=False):
    """``(result_dtype, compute_dtype, *operands)`` with torch's promotion (or with ``dtype`` given):
    operands are rounded to the result dtype, then widened to the compute dtype (float32 for
    bfloat16/float16). ``exact_last``: a 0-d last operand skips the rounding (see ``to_compute``)."""
    rt = result_type(*xs) if dtype is None else np.dtype(dtype)
    ct = opmath(rt)
    last = len(xs) - 1
    return (rt, ct, *(to_compute(x, rt, ct, exact=exact_last and i == last) for i, x in enumerate(xs)))


def fresh(x):
    """A copy of ``x``, for lowerings that would otherwise return an input unchanged (clone,
    ``floor`` of an integer tensor...): the output of an op must be a buffer of its own, since an
    input's buffer may later be donated. Free under tracing (XLA drops the copy)."""
    return jnp.copy(x)


def is_python_number(x) -> bool:
    """A concrete Python number (not a jax value): lets a lowering specialise, e.g. ``x ** 2``."""
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


_SCALAR_TYPE_NAMES = {
    torch.bool: "Bool",
    torch.uint8: "Byte",
    torch.int8: "Char",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.float32: "Float",
    torch.float64: "Double",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}


def scalar_type_name(dt) -> str:
    """torch's name of a dtype in its messages ('Long', 'Float', 'Bool'...).

    Example: ``scalar_type_name(np.dtype(np.int32)) == "Int"``.
    """
    torch_dtype = dt if isinstance(dt, torch.dtype) else to_torch(np.dtype(dt))
    return _SCALAR_TYPE_NAMES.get(torch_dtype, str(torch_dtype))


def dtype_arg(dtype) -> np.dtype | None:
    """A torch.dtype argument (or None) as a numpy dtype (or None)."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        return to_jax(dtype)
    return np.dtype(dtype)
