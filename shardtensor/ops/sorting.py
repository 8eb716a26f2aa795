"""Sorting-based ops: sort, topk, median, nanmedian, kthvalue, mode, searchsorted, bucketize, isin.

torch orders NaN above every number (last in an ascending sort, first in a descending one); indices
are int64. Equal elements come out in the order torch's CPU kernels leave them (a stable sort for
stable=True; std::sort / nth_element / quickselect replayed by ops/_cpu_order.py otherwise).
searchsorted / bucketize replay torch's bisection step by step, so unsorted or NaN-holding boundaries
give torch's answers too.

Example::

    lookup(aten.searchsorted.Tensor).fn(jnp.array([1.0, 2.0, 3.0]), jnp.array([2.0]), right=True)  # [2]
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from shardtensor.ops import _cpu_order
from shardtensor.ops._promote import BOOL, INT64, cast, dtype_of, fresh, is_complex, is_float, result_type
from shardtensor.ops.registry import register

aten = torch.ops.aten


def _axis(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _descending_key(x):
    """A key whose ascending order is ``x``'s descending order (exact, no overflow)."""
    if is_float(x.dtype):
        return -x
    if x.dtype == BOOL:
        return jnp.logical_not(x)
    return lax.bitwise_not(x)  # ~x = -x - 1 for signed, max - x for unsigned: order-reversing


def sort_along(x, axis: int, descending: bool):
    """(values, int64 indices) of a stable sort of ``x`` along ``axis``, NaN above every number."""
    if x.ndim == 0:
        return fresh(x), jnp.zeros((), INT64)
    idx = lax.broadcasted_iota(INT64, x.shape, axis)
    keys = []
    if is_float(x.dtype):
        nan = jnp.isnan(x)
        keys.append(jnp.logical_not(nan) if descending else nan)  # NaN last (ascending) / first (descending)
        x_key = jnp.where(nan, jnp.zeros_like(x), x)
    else:
        x_key = x
    keys.append(_descending_key(x_key) if descending else x_key)
    out = lax.sort((*keys, x, idx), dimension=axis, is_stable=True, num_keys=len(keys))
    return out[-2], out[-1]


def _cpu_ties(x, ax, values, indices, order, fast, ties_matter, always=False):
    """(values, indices) with equal elements in the order torch's CPU kernel leaves them: ``order``
    (rows of ranks -> m positions, from ops/_cpu_order.py) replays its algorithm. It runs only when two
    sorted neighbours named by ``ties_matter`` (a slice) are equal; otherwise the positions ``fast``
    (a slice of m) of the stable sort are the answer."""
    v, i = jnp.moveaxis(values, ax, -1), jnp.moveaxis(indices, ax, -1)
    n, lead = v.shape[-1], v.shape[:-1]
    v2, i2 = v.reshape(-1, n), i.reshape(-1, n)

    def replay():
        perm = order(_cpu_order.rank_keys(v2, i2)).astype(INT64)
        return jnp.take_along_axis(jnp.moveaxis(x, ax, -1).reshape(-1, n), perm, axis=-1), perm

    if always:
        out_v, perm = replay()
    else:
        tie = jnp.any(_cpu_order.neighbours_equal(v)[..., ties_matter])
        out_v, perm = lax.cond(tie, replay, lambda: (v2[:, fast], i2[:, fast].astype(INT64)))
    m = perm.shape[-1]
    return (jnp.moveaxis(out_v.reshape(lead + (m,)), -1, ax), jnp.moveaxis(perm.reshape(lead + (m,)), -1, ax))


def unstable_sort(x, axis: int, descending: bool):
    """torch's sort(stable=False) on CPU: std::sort, whose order of equal elements is replayed; a
    1-D integer ascending sort of 32768+ elements is fbgemm's radix sort (stable)."""
    values, idx = sort_along(x, axis, descending)
    n = x.shape[axis] if x.ndim else 1
    radix = x.ndim == 1 and n >= 32768 and not descending and jnp.issubdtype(x.dtype, jnp.integer)
    if n <= 16 or radix:  # std::sort on 16 elements is an insertion sort: stable
        return values, idx
    return _cpu_ties(x, axis, values, idx, _cpu_order.sort_order, slice(None), slice(None))


@register(aten.sort.default)
def sort(self, dim=-1, descending=False):
    return unstable_sort(self, _axis(dim, self.ndim), descending)


@register(aten.sort.stable)
def sort_stable(self, *, stable=None, dim=-1, descending=False):
    if stable:
        return sort_along(self, _axis(dim, self.ndim), descending)
    return unstable_sort(self, _axis(dim, self.ndim), descending)


@register(aten.topk.default)
def topk(self, k, dim=-1, largest=True, sorted=True):
    if self.ndim == 0:
        return fresh(self), jnp.zeros((), INT64)
    ax = _axis(dim, self.ndim)
    values, indices = sort_along(self, ax, descending=largest)
    k, n = int(k), self.shape[ax]
    if k == 0 or n <= 1:
        return lax.slice_in_dim(values, 0, k, axis=ax), lax.slice_in_dim(indices, 0, k, axis=ax)

    def order(rows):
        return _cpu_order.topk_order(rows, k, sort_prefix=sorted)

    # unique unless two of the first k + 1 are equal; sorted=False keeps std::nth_element's order
    return _cpu_ties(self, ax, values, indices, order, slice(0, k), slice(0, k), always=not sorted and k * 64 > n)


def _pick(values, indices, pos, ax, keepdim):
    """values/indices at position ``pos`` (int, or an array broadcastable with keepdims) along ``ax``."""
    if isinstance(pos, (int, np.integer)):
        v = lax.index_in_dim(values, int(pos), axis=ax, keepdims=keepdim)
        i = lax.index_in_dim(indices, int(pos), axis=ax, keepdims=keepdim)
        return v, i
    v = jnp.take_along_axis(values, pos, axis=ax)
    i = jnp.take_along_axis(indices, pos, axis=ax)
    if not keepdim:
        v, i = jnp.squeeze(v, ax), jnp.squeeze(i, ax)
    return v, i


def _median_dim(self, dim, keepdim, ignore_nan):
    if self.ndim == 0:
        return fresh(self), jnp.zeros((), INT64)
    ax = _axis(dim, self.ndim)
    n = self.shape[ax]
    values, indices = sort_along(self, ax, descending=False)  # NaNs sort last
    if not (is_float(self.dtype) or is_complex(self.dtype)):
        return _pick(values, indices, (n - 1) // 2, ax, keepdim)
    n_nan = jnp.sum(jnp.isnan(self), axis=ax, keepdims=True).astype(INT64)
    if ignore_nan:
        # lower median of the non-NaN values; all NaN -> position 0 (a NaN)
        pos = jnp.maximum((n - n_nan - 1) // 2, 0)
    else:
        # any NaN -> the first NaN (position n - n_nan in the sorted order)
        pos = jnp.where(n_nan > 0, n - n_nan, (n - 1) // 2)
    return _pick(values, indices, pos, ax, keepdim)


@register(aten.median.default)
def median(self):
    return _median_dim(jnp.ravel(self), 0, False, ignore_nan=False)[0]


@register(aten.median.dim)
def median_dim(self, dim, keepdim=False):
    return _median_dim(self, dim, keepdim, ignore_nan=False)


@register(aten.nanmedian.default)
def nanmedian(self):
    return _median_dim(jnp.ravel(self), 0, False, ignore_nan=True)[0]


@register(aten.nanmedian.dim)
def nanmedian_dim(self, dim, keepdim=False):
    return _median_dim(self, dim, keepdim, ignore_nan=True)


@register(aten.kthvalue.default)
def kthvalue(self, k, dim=-1, keepdim=False):
    if self.ndim == 0:
        return fresh(self), jnp.zeros((), INT64)
    ax = _axis(dim, self.ndim)
    values, indices = sort_along(self, ax, descending=False)
    k = int(k)
    if self.shape[ax] > 1:  # which of equal values: the one torch's quickselect leaves at k - 1

        def order(rows):
            return _cpu_order.select_order(rows, k - 1)[:, None]

        v, i = _cpu_ties(self, ax, values, indices, order, slice(k - 1, k), slice(max(k - 2, 0), k))
        return _pick(v, i, 0, ax, keepdim)
    return _pick(values, indices, k - 1, ax, keepdim)


# ----------------------------------------------------------------------------------------------
# mode
# ----------------------------------------------------------------------------------------------
@register(aten.mode.default)
def mode(self, dim=-1, keepdim=False):
    """The smallest most frequent value and the index of its last occurrence. (torch's CPU kernel
    picks the last element of the value's run after ``std::sort``, which is the last occurrence for
    slices of up to 16 elements; beyond that its choice among equal values is unspecified.) NaN never
    equals NaN, so each NaN counts once, sorted after every number."""
    if self.ndim == 0:
        return fresh(self), jnp.zeros((), INT64)
    ax = _axis(dim, self.ndim)
    if self.shape[ax] == 0:
        raise RuntimeError(f"mode(): Expected reduction dim {ax} to have non-zero size.")
    x = jnp.moveaxis(self, ax, -1)
    last = x.ndim - 1
    values, indices = sort_along(x, last, descending=False)
    differs = values[..., 1:] != values[..., :-1]
    edge = jnp.ones(values.shape[:-1] + (1,), BOOL)
    starts = jnp.concatenate([edge, differs], axis=-1)
    ends = jnp.concatenate([differs, edge], axis=-1)
    pos = lax.broadcasted_iota(INT64, values.shape, last)
    run_start = lax.cummax(jnp.where(starts, pos, 0), axis=last)
    count = jnp.where(ends, pos - run_start + 1, 0)
    best = jnp.argmax(count, axis=-1, keepdims=True)  # the first maximum: the smallest value
    v = jnp.take_along_axis(values, best, axis=-1)
    i = jnp.take_along_axis(indices, best, axis=-1)
    if keepdim:
        return jnp.moveaxis(v, -1, ax), jnp.moveaxis(i, -1, ax)
    return v[..., 0], i[..., 0]


# ----------------------------------------------------------------------------------------------
# searchsorted / bucketize / isin
# ----------------------------------------------------------------------------------------------
def _gather_last(seq, pos):
    """seq[..., pos] with ``seq`` 1-D (shared) or shaped like ``pos`` except in the last dim."""
    if seq.ndim == 1:
        return jnp.take(seq, pos, mode="clip")
    return jnp.take_along_axis(seq, jnp.clip(pos, 0, seq.shape[-1] - 1), axis=-1)


def binary_search(seq, values, goes_right, start=None, end=None, sorter=None, width=None):
    """torch's (and std::upper_bound's) bisection over ``seq``'s last dim, step for step, so that even
    unsorted or NaN-holding sequences give torch's answer: while start < end, look at
    mid = start + (end - start) // 2 and continue right of it if ``goes_right(seq[mid], value)``.
    ``seq`` is 1-D or has ``values``' leading dims; ``sorter`` (like ``seq``) reorders it. ``width``
    bounds end - start (default: the whole sequence)."""
    n = seq.shape[-1]
    start = jnp.zeros(values.shape, INT64) if start is None else start
    end = jnp.full(values.shape, n, INT64) if end is None else end
    for _ in range(max(n if width is None else width, 1).bit_length()):  # each step halves end - start
        active = start < end
        mid = start + (end - start) // 2
        probe = _gather_last(sorter, mid) if sorter is not None else mid
        right = goes_right(_gather_last(seq, probe), values)
        start = jnp.where(active & right, mid + 1, start)
        end = jnp.where(active & ~right, mid, end)
    return start


def left_of_lower_bound(mid_val, value):
    """Lower bound (first element not below ``value``): torch continues right if !(mid >= value)."""
    return jnp.logical_not(mid_val >= value)


def left_of_upper_bound(mid_val, value):
    """Upper bound (first element above ``value``): torch continues right if !(mid > value)."""
    return jnp.logical_not(mid_val > value)


def _search_dtype(name, seq, values):
    dt = result_type(seq, values)
    if dt == BOOL or is_complex(dt):
        raise NotImplementedError(f"\"{name}\" not implemented for '{'Bool' if dt == BOOL else 'complex'}'")
    return dt


@register(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(sorted_sequence, self, *, out_int32=False, right=False, side=None, sorter=None):
    if side is not None:
        if side not in ("left", "right"):
            raise RuntimeError(f"torch.searchsorted(): side can only be 'left' or 'right' but got {side}")
        if right and side == "left":
            raise RuntimeError(
                "torch.searchsorted(): side and right can't be set to opposites, got side of left while right was True"
            )
        right = side == "right"
    dt = _search_dtype("searchsorted_out_cpu", sorted_sequence, self)
    seq, values = cast(sorted_sequence, dt), cast(self, dt)
    out_dt = np.dtype(np.int32) if out_int32 else INT64
    if values.size == 0 or seq.shape[-1] == 0:
        return jnp.zeros(values.shape, out_dt)
    if seq.ndim > 1 and values.ndim == 0:
        raise RuntimeError(
            "torch.searchsorted(): input value can be a scalar only when boundaries tensor "
            f"dimension is 1, but we got boundaries tensor dim({seq.ndim}) and input value's "
            "dim(0) numel(1)"
        )
    if sorter is not None:
        sorter = sorter.astype(INT64)
    pos = binary_search(seq, values, left_of_upper_bound if right else left_of_lower_bound, sorter=sorter)
    return pos.astype(out_dt)


@register(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(self, boundaries, *, out_int32=False, right=False):
    if boundaries.ndim != 1:
        raise RuntimeError(f"boundaries tensor must be 1 dimension, but got dim({boundaries.ndim})")
    return searchsorted(boundaries, self, out_int32=out_int32, right=right)


@register(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor)
def isin(elements, test_elements, *, assume_unique=False, invert=False):
    for d in (dtype_of(elements), dtype_of(test_elements)):
        if is_complex(d) or d == BOOL:
            raise RuntimeError(f"Unsupported input type encountered for isin(): {d}")
    dt = result_type(elements, test_elements)
    x, t = cast(elements, dt), jnp.ravel(cast(test_elements, dt))
    m = t.shape[0]
    if m == 0 or x.size == 0:
        found = jnp.zeros(x.shape, BOOL)
    elif m < 10.0 * float(max(x.size, 1)) ** 0.145:
        # few test elements: compare with each (torch's own threshold for its two algorithms)
        found = jnp.any(x[..., None] == t, axis=-1)
    else:
        # sort the test elements (NaN last), find each element's lower bound, compare there
        s = sort_along(t, 0, descending=False)[0]
        nan_last = (lambda v: jnp.isnan(v)) if is_float(dt) else (lambda v: jnp.zeros(v.shape, BOOL))
        flat = jnp.ravel(x)
        pos = binary_search(s, flat, lambda mid, v: ~(nan_last(mid) | (mid >= v)))
        found = ((pos < m) & (jnp.take(s, pos, mode="clip") == flat)).reshape(x.shape)
    return jnp.logical_not(found) if invert else found
