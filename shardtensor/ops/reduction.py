"""Reductions, scans and softmax, with torch's dtypes: integer/bool sums and products give int64,
bfloat16/float16 accumulate in float32, max/min/argmax propagate NaN (the first NaN wins, across
shards too), an empty ``dim`` list reduces over every dimension.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from shardtensor.ops._promote import (
    BOOL,
    INT64,
    cast,
    default_float,
    dtype_arg,
    dtype_of,
    float_type,
    fresh,
    is_bool,
    is_complex,
    is_float,
    is_int,
    opmath,
    result_type,
)
from shardtensor.ops._traced import recall, remember
from shardtensor.ops.registry import register
from shardtensor.ops.shape import rows_source

aten = torch.ops.aten


def axes(dim, ndim: int) -> tuple[int, ...]:
    """torch ``dim`` (None, int, or list; empty means all) as sorted non-negative jax axes."""
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    dim = list(dim)
    if not dim:
        return tuple(range(ndim))
    if ndim == 0:
        return ()
    return tuple(sorted({d % ndim for d in dim}))


def _axis(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _acc_dtype(x, dtype, int_to=INT64):
    """(result dtype, compute dtype) of a sum-like reduction."""
    if dtype is not None:
        rt = dtype_arg(dtype)
    else:
        rt = dtype_of(x)
        if is_int(rt) or is_bool(rt):
            rt = int_to
    return rt, opmath(rt)


# ----------------------------------------------------------------------------------------------
# sum, mean, prod
# ----------------------------------------------------------------------------------------------
@register(aten.sum.dim_IntList)
def sum_dim(self, dim, keepdim=False, *, dtype=None):
    rt, ct = _acc_dtype(self, dtype)
    rows = rows_source(self) if self.ndim == 2 and axes(dim, 2) == (0,) else None
    if rows is not None:  # a Linear layer's bias gradient: over the leading dims of its (batch, tokens, features)
        out = jnp.sum(cast(rows, ct), axis=tuple(range(rows.ndim - 1)))
        return cast(out[None] if keepdim else out, rt)
    return cast(jnp.sum(cast(self, ct), axis=axes(dim, self.ndim), keepdims=keepdim), rt)


@register(aten.sum.default)
def sum_(self, *, dtype=None):
    return sum_dim(self, None, dtype=dtype)


@register(aten.nansum.default)
def nansum(self, dim=None, keepdim=False, *, dtype=None):
    rt, ct = _acc_dtype(self, dtype)
    x = cast(self, ct)
    if is_float(ct) or is_complex(ct):
        x = jnp.where(jnp.isnan(x), jnp.zeros_like(x), x)
    return cast(jnp.sum(x, axis=axes(dim, self.ndim), keepdims=keepdim), rt)


@register(aten.mean.dim)
def mean_dim(self, dim, keepdim=False, *, dtype=None):
    rt, ct = _acc_dtype(self, dtype, int_to=default_float())
    return cast(jnp.mean(cast(self, ct), axis=axes(dim, self.ndim), keepdims=keepdim), rt)


@register(aten.mean.default)
def mean(self, *, dtype=None):
    return mean_dim(self, None, dtype=dtype)


@register(aten.prod.dim_int)
def prod_dim(self, dim, keepdim=False, *, dtype=None):
    rt, ct = _acc_dtype(self, dtype)
    return cast(jnp.prod(cast(self, ct), axis=axes(dim, self.ndim), keepdims=keepdim), rt)


@register(aten.prod.default)
def prod(self, *, dtype=None):
    rt, ct = _acc_dtype(self, dtype)
    return cast(jnp.prod(cast(self, ct)), rt)


@register(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero(self, dim=None):
    return jnp.sum(self != 0, axis=axes(dim, self.ndim), dtype=INT64)


# ----------------------------------------------------------------------------------------------
# max / min / argmax / argmin
# ----------------------------------------------------------------------------------------------
def nan_max(x, axis=None, keepdims=False):
    """``jnp.max`` that returns NaN where the reduced elements hold one, as torch does. XLA's own
    max keeps NaN within a device, but the all-reduce that combines shards drops it on some platforms
    (XLA:CPU: a shard's NaN loses to the others' numbers; all NaN gives -inf): whether a NaN was
    there is reduced on its own (a bool ``any``, exact on every platform)."""
    return _nan_kept(jnp.max, x, axis, keepdims)


def nan_min(x, axis=None, keepdims=False):
    """``jnp.min`` keeping NaN across shards (see ``nan_max``)."""
    return _nan_kept(jnp.min, x, axis, keepdims)


def _nan_kept(reduce, x, axis, keepdims):
    out = reduce(x, axis=axis, keepdims=keepdims)
    if not is_float(x.dtype):
        return out
    has_nan = jnp.any(jnp.isnan(x), axis=axis, keepdims=keepdims)
    return jnp.where(has_nan, jnp.asarray(np.nan, out.dtype), out)


@register(aten.amax.default)
def amax(self, dim=(), keepdim=False):
    return nan_max(self, axis=axes(dim, self.ndim), keepdims=keepdim)


@register(aten.amin.default)
def amin(self, dim=(), keepdim=False):
    return nan_min(self, axis=axes(dim, self.ndim), keepdims=keepdim)


@register(aten.max.default)
def max_(self):
    return nan_max(self)


@register(aten.min.default)
def min_(self):
    return nan_min(self)


def _arg(fn, self, dim, keepdim):
    if dim is None:
        out = fn(jnp.ravel(self)).astype(INT64)
        return jnp.reshape(out, (1,) * self.ndim) if keepdim else out
    if self.ndim == 0:
        return jnp.zeros((), INT64)
    return fn(self, axis=_axis(dim, self.ndim), keepdims=keepdim).astype(INT64)


@register(aten.argmax.default)
def argmax(self, dim=None, keepdim=False):
    return _arg(jnp.argmax, self, dim, keepdim)


@register(aten.argmin.default)
def argmin(self, dim=None, keepdim=False):
    return _arg(jnp.argmin, self, dim, keepdim)


def _extreme_along(reduce, arg, self, dim, keepdim):
    """(values, int64 indices) of max.dim / min.dim."""
    if self.ndim == 0:
        return fresh(self), jnp.zeros((), INT64)
    ax = _axis(dim, self.ndim)
    return reduce(self, axis=ax, keepdims=keepdim), arg(self, ax, keepdim)


@register(aten.max.dim)
def max_dim(self, dim, keepdim=False):
    return _extreme_along(nan_max, argmax, self, dim, keepdim)


@register(aten.min.dim)
def min_dim(self, dim, keepdim=False):
    return _extreme_along(nan_min, argmin, self, dim, keepdim)


@register(aten.aminmax.default)
def aminmax(self, *, dim=None, keepdim=False):
    ax = None if dim is None else (_axis(dim, self.ndim),) if self.ndim else ()
    if ax is None:
        lo, hi = nan_min(self), nan_max(self)
        if keepdim:
            lo, hi = jnp.reshape(lo, (1,) * self.ndim), jnp.reshape(hi, (1,) * self.ndim)
        return lo, hi
    return nan_min(self, axis=ax, keepdims=keepdim), nan_max(self, axis=ax, keepdims=keepdim)


# ----------------------------------------------------------------------------------------------
# var / std
# ----------------------------------------------------------------------------------------------
def _var_mean(self, dim, correction, keepdim):
    rt = dtype_of(self)
    if not (is_float(rt) or is_complex(rt)):
        rt = default_float()
    ct = opmath(rt)
    x = cast(self, ct)
    ax = axes(dim, x.ndim)
    n = int(np.prod([x.shape[a] for a in ax])) if ax else 1
    m = jnp.mean(x, axis=ax, keepdims=True)
    d = x - m
    sq = (d * jnp.conj(d)).real if is_complex(ct) else d * d
    c = 1 if correction is None else correction
    denom = jnp.maximum(jnp.asarray(n, sq.dtype) - cast(c, sq.dtype), 0)
    var = jnp.sum(sq, axis=ax, keepdims=keepdim) / denom
    mean = m if keepdim else jnp.squeeze(m, axis=ax)
    real_rt = np.dtype(jnp.finfo(rt).dtype) if is_complex(rt) else rt
    return var, mean, real_rt, rt


@register(aten.var.correction)
def var(self, dim=None, *, correction=None, keepdim=False):
    v, _, vt, _ = _var_mean(self, dim, correction, keepdim)
    return cast(v, vt)


@register(aten.std.correction)
def std(self, dim=None, *, correction=None, keepdim=False):
    v, _, vt, _ = _var_mean(self, dim, correction, keepdim)
    return cast(jnp.sqrt(v), vt)


@register(aten.var_mean.correction)
def var_mean(self, dim=None, *, correction=None, keepdim=False):
    v, m, vt, mt = _var_mean(self, dim, correction, keepdim)
    return cast(v, vt), cast(m, mt)


@register(aten.std_mean.correction)
def std_mean(self, dim=None, *, correction=None, keepdim=False):
    v, m, vt, mt = _var_mean(self, dim, correction, keepdim)
    return cast(jnp.sqrt(v), vt), cast(m, mt)


# ----------------------------------------------------------------------------------------------
# norms (the order is static: it picks the formula)
# ----------------------------------------------------------------------------------------------
def vector_norm(self, ord=2, dim=None, keepdim=False, dtype=None, root=True):
    """torch.linalg.vector_norm; ``ord`` must be a Python number. ``root=False``: sum(|x|**ord)
    without the final root (``_foreach_powsum``)."""
    in_dt = dtype_arg(dtype) if dtype is not None else dtype_of(self)
    if not (is_float(in_dt) or is_complex(in_dt)):
        in_dt = default_float()
    rt = np.dtype(jnp.finfo(in_dt).dtype) if is_complex(in_dt) else in_dt
    ct = opmath(rt)
    x = cast(self, in_dt if is_complex(in_dt) else opmath(in_dt))
    a = cast(jnp.abs(x), ct)
    ax = axes(dim, a.ndim)
    ord = float(ord)
    if ord == float("inf"):
        out = nan_max(a, axis=ax, keepdims=keepdim)
    elif ord == float("-inf"):
        out = nan_min(a, axis=ax, keepdims=keepdim)
    elif ord == 0:
        out = jnp.sum((a != 0).astype(ct), axis=ax, keepdims=keepdim)
    elif ord == 1:
        out = jnp.sum(a, axis=ax, keepdims=keepdim)
    elif ord == 2:
        out = jnp.sum(a * a, axis=ax, keepdims=keepdim)
        out = jnp.sqrt(out) if root else out
    else:
        out = jnp.sum(jnp.power(a, ord), axis=ax, keepdims=keepdim)
        out = jnp.power(out, 1.0 / ord) if root else out
    return cast(out, rt)


@register(aten.linalg_vector_norm.default, static_scalars=True)
def linalg_vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    return vector_norm(self, ord, dim, keepdim, dtype)


@register(aten.norm.Scalar, static_scalars=True)
def norm_scalar(self, p=2):
    return vector_norm(self, 2 if p is None else p)


@register(aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype, static_scalars=True)
def norm_dim(self, p, dim, keepdim=False, *, dtype=None):
    return vector_norm(self, 2 if p is None else p, dim, keepdim, dtype)


@register(aten.norm.ScalarOpt_dtype, static_scalars=True)
def norm_dtype(self, p, *, dtype):
    return vector_norm(self, 2 if p is None else p, None, False, dtype)


# ----------------------------------------------------------------------------------------------
# any / all
# ----------------------------------------------------------------------------------------------
def _logical_reduce(fn, self, dim, keepdim):
    out_dt = np.dtype(np.uint8) if dtype_of(self) == np.uint8 else BOOL
    b = self if is_bool(dtype_of(self)) else self != 0
    return fn(b, axis=dim, keepdims=keepdim).astype(out_dt)


@register(aten.any.default)
def any_(self):
    return _logical_reduce(jnp.any, self, None, False)


@register(aten.all.default)
def all_(self):
    return _logical_reduce(jnp.all, self, None, False)


@register(aten.any.dim)
def any_dim(self, dim, keepdim=False):
    return _logical_reduce(jnp.any, self, axes(dim, self.ndim), keepdim)


@register(aten.all.dim)
def all_dim(self, dim, keepdim=False):
    return _logical_reduce(jnp.all, self, axes(dim, self.ndim), keepdim)


@register(aten.any.dims)
def any_dims(self, dim=None, keepdim=False):
    # unlike the other reductions, an empty dim list reduces nothing here
    ax = () if (dim is not None and len(dim) == 0) else axes(dim, self.ndim)
    return _logical_reduce(jnp.any, self, ax, keepdim)


@register(aten.all.dims)
def all_dims(self, dim=None, keepdim=False):
    ax = () if (dim is not None and len(dim) == 0) else axes(dim, self.ndim)
    return _logical_reduce(jnp.all, self, ax, keepdim)


# ----------------------------------------------------------------------------------------------
# logsumexp, scans
# ----------------------------------------------------------------------------------------------
@register(aten.logsumexp.default)
def logsumexp(self, dim, keepdim=False):
    rt = float_type(self)
    x = cast(self, opmath(rt))
    ax = axes(dim, x.ndim)
    if any(x.shape[a] == 0 for a in ax):  # the log of an empty sum
        return cast(jnp.full(_reduced_shape(x.shape, ax, keepdim), -np.inf, x.dtype), rt)
    m = jnp.max(x, axis=ax, keepdims=True)
    m = jnp.where(jnp.isinf(m), jnp.zeros_like(m), m)
    out = jnp.log(jnp.sum(jnp.exp(x - m), axis=ax, keepdims=True)) + m
    return cast(out if keepdim else jnp.squeeze(out, axis=ax), rt)


def _reduced_shape(shape, ax, keepdim):
    return tuple(1 if i in ax else n for i, n in enumerate(shape) if keepdim or i not in ax)


def _scan(fn, self, dim, rt):
    ct = opmath(rt)
    x = cast(self, ct)
    if x.ndim == 0:
        return fresh(cast(x, rt))
    # XLA's SPMD partitioner reuses one halo exchange for every reduce_window (a cumulative op) of the
    # same value along the same sharded dim, padding included: a cumsum and a cumprod of ``x`` in one
    # program both padded with 0 (the cumprod all zeros). A barrier makes each scan's input its own.
    return cast(fn(lax.optimization_barrier(x), axis=_axis(dim, x.ndim)), rt)


@register(aten.cumsum.default)
def cumsum(self, dim, *, dtype=None):
    return _scan(jnp.cumsum, self, dim, _acc_dtype(self, dtype)[0])


@register(aten.cumprod.default)
def cumprod(self, dim, *, dtype=None):
    return _scan(jnp.cumprod, self, dim, _acc_dtype(self, dtype)[0])


@register(aten.logcumsumexp.default)
def logcumsumexp(self, dim):
    return _scan(lambda x, axis: lax.cumlogsumexp(x, axis=axis), self, dim, float_type(self))


def _cum_extreme(self, dim, better):
    """cummax/cummin: a later element replaces the running one if ``better(new, old)`` (ties: the
    later index wins, as torch), or if it is NaN; after a NaN nothing non-NaN replaces it."""
    if self.ndim == 0:
        return fresh(self), jnp.zeros((), INT64)
    ax = _axis(dim, self.ndim)
    idx = lax.broadcasted_iota(INT64, self.shape, ax)
    isnan = (
        (lambda v: jnp.isnan(v))
        if (is_float(self.dtype) or is_complex(self.dtype))
        else (lambda v: jnp.zeros(v.shape, BOOL))
    )

    def combine(a, b):
        (va, ia), (vb, ib) = a, b
        take_b = isnan(vb) | (~isnan(va) & better(vb, va))
        return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)

    return lax.associative_scan(combine, (self, idx), axis=ax)


@register(aten.cummax.default)
def cummax(self, dim):
    return _cum_extreme(self, dim, lambda new, old: new >= old)


@register(aten.cummin.default)
def cummin(self, dim):
    return _cum_extreme(self, dim, lambda new, old: new <= old)


# ----------------------------------------------------------------------------------------------
# softmax (owned here; nn.py has the other nn ops)
# ----------------------------------------------------------------------------------------------
def _softmax_out_dtype(self, half_to_float):
    dt = dtype_of(self)
    if half_to_float and dt in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        return np.dtype(np.float32)
    return dt


def _softmax_compute(x, dim):
    if x.ndim == 0:
        return jnp.ones_like(x)
    if x.size == 0:
        return x
    ax = _axis(dim, x.ndim)
    e = jnp.exp(x - jnp.max(x, axis=ax, keepdims=True))
    return e / jnp.sum(e, axis=ax, keepdims=True)


@register(aten._softmax.default)
def _softmax(self, dim, half_to_float):
    rt = _softmax_out_dtype(self, half_to_float)
    return cast(_softmax_compute(cast(self, opmath(rt)), dim), rt)


@register(aten._log_softmax.default)
def _log_softmax(self, dim, half_to_float):
    rt = _softmax_out_dtype(self, half_to_float)
    x = cast(self, opmath(rt))
    if x.ndim == 0:
        return cast(jnp.zeros_like(x), rt)
    if x.size == 0:
        return cast(x, rt)
    ax = _axis(dim, x.ndim)
    m = jnp.max(x, axis=ax, keepdims=True)
    lse = m + jnp.log(jnp.sum(jnp.exp(x - m), axis=ax, keepdims=True))  # torch's CPU kernel's order
    out = cast(x - lse, rt)
    # nll_loss picks one element per row of ``out``: from ``x`` it needs no ``lse`` first, so that pick
    # can share a pass over the rows with the max and the sum above (not one more pass of its own)
    remember(out, "log_softmax_of", (x, lse, ax))
    return out


@register(aten._safe_softmax.default)
def _safe_softmax(self, dim, dtype=None):
    rt = dtype_arg(dtype) if dtype is not None else dtype_of(self)
    x = cast(self, opmath(rt))
    out = _softmax_compute(x, dim)
    if x.ndim:
        all_masked = jnp.all(x == -jnp.inf, axis=_axis(dim, x.ndim), keepdims=True)
        out = jnp.where(all_masked, jnp.zeros_like(out), out)
    return cast(out, rt)


@register(aten._softmax_backward_data.default)
def _softmax_backward_data(grad_output, output, dim, input_dtype):
    rt = dtype_arg(input_dtype)
    ct = opmath(result_type(grad_output, output))
    g, y = cast(grad_output, ct), cast(output, ct)
    if y.ndim == 0:
        return cast(jnp.zeros_like(g), rt)
    ax = _axis(dim, y.ndim)
    return cast(y * (g - jnp.sum(g * y, axis=ax, keepdims=True)), rt)


@register(aten._log_softmax_backward_data.default)
def _log_softmax_backward_data(grad_output, output, dim, input_dtype):
    rt = dtype_arg(input_dtype)
    ct = opmath(result_type(grad_output, output))
    g, y = cast(grad_output, ct), cast(output, ct)
    if y.ndim == 0:
        return cast(jnp.zeros_like(g), rt)
    ax = _axis(dim, y.ndim)
    rows = recall(grad_output, "onehot_rows")  # nll_loss's gradient: one nonzero per row, known
    if rows is not None and rows[1] == ax:
        total = jnp.expand_dims(cast(rows[0], ct), ax)
    else:
        total = jnp.sum(g, axis=ax, keepdims=True)
    return cast(g - jnp.exp(y) * total, rt)


# ----------------------------------------------------------------------------------------------
# hash_tensor
# ----------------------------------------------------------------------------------------------
_HASHABLE_INTS = {np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8)}


@register(aten.hash_tensor.default)
def hash_tensor(self, dim=(), *, keepdim=False, mode=0):
    """torch.hash_tensor, mode 0: the xor of every element's 64-bit pattern (floats widened to float64,
    integers and bool to int64, NaN payloads and the sign of zero kept), as uint64."""
    if mode != 0:
        raise RuntimeError(f"Unknown hash_tensor mode: {mode}")
    dt = dtype_of(self)
    if is_float(dt):
        bits = lax.bitcast_convert_type(cast(self, np.float64), np.uint64)
    elif dt in _HASHABLE_INTS or is_bool(dt):
        bits = lax.bitcast_convert_type(cast(self, INT64), np.uint64)
    else:
        raise RuntimeError(f"\"xor_sum_cpu\" not implemented for '{dt}'")
    ax = axes(dim, self.ndim)
    if self.size == 0 and not (dim is not None and len(dim)):
        raise RuntimeError(
            "hash_tensor: Expected reduction dim to be specified for input.numel() == 0. "
            "Specify the reduction dim with the 'dim' argument."
        )
    for a in ax:
        if self.shape[a] == 0:
            raise RuntimeError(f"hash_tensor: Expected reduction dim {a} to have non-zero size.")
    # xor is per-bit parity. A sum of bit planes rather than an xor reduce: XLA's CPU all-reduce has no
    # xor, so a sharded xor reduction fails to run; a uint32 sum wraps but keeps its parity.
    shifts = jnp.arange(64, dtype=np.uint64)
    planes = ((bits[..., None] >> shifts) & np.uint64(1)).astype(np.uint32)
    parity = (jnp.sum(planes, axis=ax, dtype=np.uint32) & np.uint32(1)).astype(np.uint64)
    out = jnp.bitwise_or.reduce(parity << shifts, axis=-1)
    if keepdim:
        out = jnp.reshape(out, tuple(1 if i in ax else n for i, n in enumerate(self.shape)))
    return out
