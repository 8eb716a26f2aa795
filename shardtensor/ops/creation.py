"""Factory ops: full/zeros/ones/empty (empty is zeros), the ``*_like`` and ``new_*`` variants, arange,
linspace, logspace, eye, scalar_tensor, tril/triu_indices; ``prims.convert_element_type`` (the cast
torch's reference decompositions call).

The dispatcher passes ``dtype``, ``layout``, ``device``, ``pin_memory`` (and ``memory_format``)
keywords; only ``dtype`` matters here. A missing dtype is torch's: the default float dtype, int64 for
an integral ``arange`` / a Python-int fill value, bool for a bool fill value.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from shardtensor.ops._promote import (
    BOOL,
    FLOAT64,
    INT64,
    cast,
    default_complex,
    default_float,
    dtype_arg,
    dtype_of,
    is_bool,
    is_complex,
    is_float,
    is_int,
    opmath,
)
from shardtensor.ops.registry import register

aten = torch.ops.aten


def _shape(size) -> tuple[int, ...]:
    return tuple(int(s) for s in size)


def scalar_dtype(value) -> np.dtype:
    """torch's dtype for a tensor filled from a Python scalar: bool, int64, default float/complex."""
    dt = dtype_of(value)
    if is_bool(dt):
        return BOOL
    if is_int(dt):
        return INT64
    if is_complex(dt):
        return default_complex()
    return default_float()


def _like_dtype(self, dtype):
    return dtype_arg(dtype) if dtype is not None else dtype_of(self)


# ----------------------------------------------------------------------------------------------
# full / zeros / ones / empty
# ----------------------------------------------------------------------------------------------
@register(aten.full.default)
def full(size, fill_value, *, dtype=None, **_factory):
    dt = dtype_arg(dtype) if dtype is not None else scalar_dtype(fill_value)
    return jnp.broadcast_to(cast(fill_value, dt), _shape(size))


@register(aten.zeros.default, aten._efficientzerotensor.default)
def zeros(size, *, dtype=None, **_factory):
    return jnp.zeros(_shape(size), dtype_arg(dtype) or default_float())


@register(aten.ones.default)
def ones(size, *, dtype=None, **_factory):
    return jnp.ones(_shape(size), dtype_arg(dtype) or default_float())


@register(aten.empty.memory_format)
def empty(size, *, dtype=None, **_factory):
    return zeros(size, dtype=dtype)


@register(aten.empty_strided.default)
def empty_strided(size, stride, *, dtype=None, **_factory):
    return zeros(size, dtype=dtype)


@register(aten.empty_permuted.default)
def empty_permuted(size, physical_layout, *, dtype=None, **_factory):
    return zeros(size, dtype=dtype)


@register(aten.zeros_like.default, aten.empty_like.default)
def zeros_like(self, *, dtype=None, **_factory):
    return jnp.zeros(jnp.shape(self), _like_dtype(self, dtype))


@register(aten.ones_like.default)
def ones_like(self, *, dtype=None, **_factory):
    return jnp.ones(jnp.shape(self), _like_dtype(self, dtype))


@register(aten.full_like.default)
def full_like(self, fill_value, *, dtype=None, **_factory):
    return jnp.broadcast_to(cast(fill_value, _like_dtype(self, dtype)), jnp.shape(self))


@register(aten.new_zeros.default, aten.new_empty.default)
def new_zeros(self, size, *, dtype=None, **_factory):
    return jnp.zeros(_shape(size), _like_dtype(self, dtype))


@register(aten.new_ones.default)
def new_ones(self, size, *, dtype=None, **_factory):
    return jnp.ones(_shape(size), _like_dtype(self, dtype))


@register(aten.new_full.default)
def new_full(self, size, fill_value, *, dtype=None, **_factory):
    return jnp.broadcast_to(cast(fill_value, _like_dtype(self, dtype)), _shape(size))


@register(aten.new_empty_strided.default)
def new_empty_strided(self, size, stride, *, dtype=None, **_factory):
    return new_zeros(self, size, dtype=dtype)


@register(aten.scalar_tensor.default)
def scalar_tensor(s, *, dtype=None, **_factory):
    return cast(s, dtype_arg(dtype) or default_float())


@register(torch.ops.prims.convert_element_type.default)
def convert_element_type(a, dtype):
    """``a`` cast to ``dtype`` with torch's rules (what ``_to_copy(a, dtype=dtype)`` does); torch's
    decompositions (e.g. renorm's for bfloat16) call this prim."""
    dt = dtype_arg(dtype)
    if is_complex(dtype_of(a)) and not is_complex(dt):
        return cast(jnp.real(a), dt)
    return cast(a, dt)


# ----------------------------------------------------------------------------------------------
# ranges (arange's length depends on its scalars: they are static)
# ----------------------------------------------------------------------------------------------
_HOST_ARANGE_MAX = 1 << 16  # float aranges up to this length are built on the host


def _trunc_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


@register(aten.arange.default, aten.arange.start, aten.arange.start_step, static_scalars=True)
def arange(*args, dtype=None, **_factory):
    start, end, step = {1: lambda: (0, args[0], 1), 2: lambda: (args[0], args[1], 1), 3: lambda: args}[len(args)]()
    start, end, step = (v.item() if hasattr(v, "item") else v for v in (start, end, step))
    if dtype is not None:
        dt = dtype_arg(dtype)
    else:
        dt = default_float() if any(isinstance(v, float) for v in (start, end, step)) else INT64
    if step == 0:
        raise ValueError("arange: step must be nonzero")
    if is_float(dt) or is_complex(dt):
        n = math.ceil((float(end) - float(start)) / float(step))
        # torch's CPU accumulate type: double for float/double, float for bfloat16/half
        acc = np.dtype(np.complex128) if is_complex(dt) else FLOAT64 if opmath(dt) == dt else opmath(dt)
        if n <= _HOST_ARANGE_MAX or acc != FLOAT64:
            # computed on the host (a constant): no float64 arithmetic on the device (TPUs lack it)
            host_idx = np.arange(max(n, 0), dtype=acc)
            return jnp.asarray((acc.type(start) + acc.type(step) * host_idx).astype(jnp.dtype(dt)))
        idx = jnp.arange(max(n, 0), dtype=acc)
        return cast(jnp.asarray(start, acc) + jnp.asarray(step, acc) * idx, dt)
    xs, xe, xst = int(start), int(end), int(step)  # Scalar.to<int64_t>() truncates
    if dt == INT64:
        sgn = (xst > 0) - (xst < 0)
        n = _trunc_div(xe - xs + xst - sgn, xst)
    else:
        n = math.ceil((float(end) - float(start)) / float(step))
    idx = jnp.arange(max(n, 0), dtype=INT64)
    return cast(xs + xst * idx, dt)


def _linspace_base(start, end, steps, dt):
    """torch's CPU linspace values (in ``step_t``: double for integers, else the dtype's opmath)."""
    st = FLOAT64 if (is_int(dt) or is_bool(dt)) else opmath(dt)
    s, e = cast(cast(start, dt), st), cast(cast(end, dt), st)
    if steps == 1:
        return jnp.reshape(s, (1,)), st
    step = (e - s) / (steps - 1)
    idx = jnp.arange(steps, dtype=INT64)
    lo = s + step * idx.astype(st)
    hi = e - step * (steps - idx - 1).astype(st)
    return jnp.where(idx < steps // 2, lo, hi), st


@register(aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar, aten.linspace.Scalar_Tensor)
def linspace(start, end, steps, *, dtype=None, **_factory):
    dt = dtype_arg(dtype) or default_float()
    if steps == 0:
        return jnp.zeros((0,), dt)
    vals, _ = _linspace_base(start, end, steps, dt)
    return cast(vals, dt)


@register(aten.logspace.default, aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar, aten.logspace.Scalar_Tensor)
def logspace(start, end, steps, base=10.0, *, dtype=None, **_factory):
    dt = dtype_arg(dtype) or default_float()
    if steps == 0:
        return jnp.zeros((0,), dt)
    if steps == 1:
        return jnp.reshape(cast(jnp.power(float(base), cast(start, FLOAT64)), dt), (1,))
    vals, st = _linspace_base(start, end, steps, dt)
    return cast(jnp.power(jnp.asarray(base, st), vals), dt)


@register(aten.eye.default)
def eye(n, *, dtype=None, **_factory):
    return jnp.eye(int(n), dtype=dtype_arg(dtype) or default_float())


@register(aten.eye.m)
def eye_m(n, m, *, dtype=None, **_factory):
    return jnp.eye(int(n), int(m), dtype=dtype_arg(dtype) or default_float())


def _tri_indices(fn, row, col, offset, dtype):
    r, c = fn(int(row), int(offset), int(col))
    return jnp.asarray(np.stack([r, c]).astype(dtype_arg(dtype) or INT64))


@register(aten.tril_indices.default)
def tril_indices(row, col, offset=0, *, dtype=torch.int64, **_factory):
    return _tri_indices(np.tril_indices, row, col, offset, dtype)


@register(aten.triu_indices.default)
def triu_indices(row, col, offset=0, *, dtype=torch.int64, **_factory):
    return _tri_indices(np.triu_indices, row, col, offset, dtype)
