"""Lowerings of pairwise distances: ``_cdist_forward`` / ``_cdist_backward`` (``torch.cdist``),
``_euclidean_dist``, and ``_pdist_forward`` / ``_pdist_backward`` (``F.pdist``).

p-norms follow torch's CPU kernels: p = 0 counts the differing coordinates, p = inf takes the largest
difference, p = 2 in "mm" mode (``compute_mode`` 1, or 0 with more than 25 rows) expands
|a - b|^2 = |a|^2 - 2 a.b + |b|^2 into one matmul as torch's ``_euclidean_dist`` does. The gradients
are torch's closed forms, 0 where a distance is 0.

Example::

    d = lookup(aten._cdist_forward.default).fn(x1, x2, 2.0, None)   # (..., P, M), (..., R, M) -> (..., P, R)
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from shardtensor.ops._promote import acc_dtype
from shardtensor.ops.indexing import write_at
from shardtensor.ops.precision import precision
from shardtensor.ops.registry import register

aten = torch.ops.aten


def _norm(diff, p, nan_skipped=False):
    """The p-norm of ``diff`` over its last axis, as torch's cdist/pdist kernels compute it.
    ``nan_skipped``: p = inf keeps the running maximum where a difference is NaN (torch's cdist
    kernel compares ``running < diff``; its pdist kernel propagates NaN)."""
    a = jnp.abs(diff)
    if nan_skipped and math.isinf(p):
        a = jnp.where(jnp.isnan(a), jnp.zeros_like(a), a)
    if p == 0:
        return jnp.sum((a != 0).astype(diff.dtype), axis=-1)
    if p == 1:
        return jnp.sum(a, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=-1))
    if math.isinf(p):
        return jnp.max(a, axis=-1, initial=0.0)
    return jnp.sum(a**p, axis=-1) ** (1.0 / p)


def _norm_grad(diff, dist, grad, p):
    """d(p-norm)/d(diff) * grad, elementwise over (..., M) with dist and grad broadcast from (...)."""
    dist, grad = dist[..., None], grad[..., None]
    zero = jnp.zeros((), diff.dtype)
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        return jnp.sign(diff) * grad
    live = dist != 0
    safe = jnp.where(live, dist, jnp.ones((), diff.dtype))
    if p == 2:
        return jnp.where(live, grad * diff / safe, zero)
    if math.isinf(p):
        return grad * jnp.sign(diff) * (jnp.abs(diff) == dist).astype(diff.dtype)
    if p < 2:
        ok = live & ~((diff == 0) & (p < 1))
        g = jnp.sign(diff) * jnp.abs(diff) ** (p - 1) * grad / safe ** (p - 1)
        return jnp.where(ok, g, zero)
    return jnp.where(live, diff * jnp.abs(diff) ** (p - 2) * grad / safe ** (p - 1), zero)


def _batch(x1, x2):
    """Broadcast the batch dims of (..., P, M) and (..., R, M)."""
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    return (jnp.broadcast_to(x1, batch + x1.shape[-2:]), jnp.broadcast_to(x2, batch + x2.shape[-2:]))


def euclidean_dist(x1, x2):
    """torch's _euclidean_dist: sqrt(clamp(|a|^2 - 2 a.b + |b|^2, 0)) through one matmul."""
    acc = acc_dtype(x1.dtype)
    a, b = _batch(x1.astype(acc), x2.astype(acc))
    an = jnp.sum(a * a, axis=-1, keepdims=True)
    bn = jnp.sum(b * b, axis=-1, keepdims=True)
    a_ = jnp.concatenate([-2 * a, an, jnp.ones_like(an)], axis=-1)
    b_ = jnp.concatenate([b, jnp.ones_like(bn), bn], axis=-1)
    d2 = jnp.matmul(a_, jnp.swapaxes(b_, -1, -2), precision=precision())
    return jnp.sqrt(jnp.maximum(d2, 0)).astype(x1.dtype)


register(aten._euclidean_dist.default, products=True)(euclidean_dist)


def _check(x1, x2, p):
    if p < 0:
        raise RuntimeError(f"cdist only supports non-negative p values, got {p}")
    if x1.ndim < 2 or x2.ndim < 2 or x1.shape[-1] != x2.shape[-1]:
        raise RuntimeError(
            f"cdist: X1 and X2 must have at least 2 dimensions and the same number of columns, got "
            f"{list(x1.shape)} and {list(x2.shape)}"
        )


@register(aten._cdist_forward.default, products=True)
def cdist_forward(x1, x2, p, compute_mode=None):
    _check(x1, x2, p)
    mode = 0 if compute_mode is None else compute_mode
    r1, r2 = x1.shape[-2], x2.shape[-2]
    if p == 2 and (mode == 1 or (mode == 0 and (r1 > 25 or r2 > 25))) and x1.size and x2.size:
        return euclidean_dist(x1, x2)
    acc = acc_dtype(x1.dtype)
    a, b = _batch(x1.astype(acc), x2.astype(acc))
    return _norm(a[..., :, None, :] - b[..., None, :, :], p, nan_skipped=True).astype(x1.dtype)


@register(aten._cdist_backward.default, products=True)
def cdist_backward(grad, x1, x2, p, cdist):
    """Gradient with respect to x1 (torch gets the one of x2 by swapping the arguments)."""
    acc = acc_dtype(x1.dtype)
    a, b = _batch(x1.astype(acc), x2.astype(acc))
    if a.size == 0 or b.size == 0:  # torch: zeros shaped like x1
        return jnp.zeros(x1.shape, x1.dtype)
    diff = a[..., :, None, :] - b[..., None, :, :]
    # (shaped with the broadcast batch dims, as torch's: autograd sums them back)
    return jnp.sum(_norm_grad(diff, cdist.astype(acc), grad.astype(acc), p), axis=-2).astype(x1.dtype)


def _pairs(n):
    return np.triu_indices(n, 1)


@register(aten._pdist_forward.default)
def pdist_forward(x, p=2.0):
    if x.ndim != 2:
        raise RuntimeError(f"pdist only supports 2D tensors, got: {x.ndim}D")
    if p < 0:
        raise RuntimeError("pdist only supports non-negative p values")
    i, j = _pairs(x.shape[0])
    acc = acc_dtype(x.dtype)
    xf = x.astype(acc)
    return _norm(jnp.take(xf, i, axis=0) - jnp.take(xf, j, axis=0), p).astype(x.dtype)


@register(aten._pdist_backward.default)
def pdist_backward(grad, x, p, pdist):
    n = x.shape[0]
    i, j = _pairs(n)
    acc = acc_dtype(x.dtype)
    xf = x.astype(acc)
    # pair k = (i, j) with i < j: d/dx_i = f(x_i - x_j), d/dx_j = -f(x_i - x_j)
    g = _norm_grad(jnp.take(xf, i, axis=0) - jnp.take(xf, j, axis=0), pdist.astype(acc), grad.astype(acc), p)
    # (write_at: the pairs' dimension may be sharded unevenly, where XLA's own scatter adds padding)
    out = write_at(write_at(jnp.zeros_like(xf), (i,), g, "add"), (j,), -g, "add")
    return out.astype(x.dtype)
