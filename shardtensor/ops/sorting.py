"""Sorting-based ops: sort, topk, median, nanmedian, kthvalue.

torch orders NaN above every number (last in an ascending sort, first in a descending one); sorts are
stable here (ties keep their original order), indices are int64.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from shardtensor.ops._promote import BOOL, INT64, fresh, is_complex, is_float
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


@register(aten.sort.default)
def sort(self, dim=-1, descending=False):
    return sort_along(self, _axis(dim, self.ndim), descending)


@register(aten.sort.stable)
def sort_stable(self, *, stable=None, dim=-1, descending=False):
    return sort_along(self, _axis(dim, self.ndim), descending)


@register(aten.topk.default)
def topk(self, k, dim=-1, largest=True, sorted=True):
    if self.ndim == 0:
        return fresh(self), jnp.zeros((), INT64)
    ax = _axis(dim, self.ndim)
    values, indices = sort_along(self, ax, descending=largest)
    k = int(k)
    return lax.slice_in_dim(values, 0, k, axis=ax), lax.slice_in_dim(indices, 0, k, axis=ax)


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
    return _pick(values, indices, int(k) - 1, ax, keepdim)
