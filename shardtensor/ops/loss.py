"""Lowerings of loss ops: nll_loss (1-d and 2-d/K-d, weight, ignore_index, reduction) and its
backward, mse, binary cross entropy (plain and with logits), smooth L1, Huber, soft margin.

nll_loss picks the target class with a one-hot comparison against an iota (``where(t == c, x, 0)``
summed over classes), never with a gather, so batch-sharded targets stay local (see DESIGN pitfalls)
and a class-sharded input needs only a reduction. ``reduction`` is 0 none, 1 mean, 2 sum.

Example::

    loss, total_weight = lookup(aten.nll_loss_forward.default).fn(logp, target, None, 1, -100)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from shardtensor.ops.pooling import acc_dtype
from shardtensor.ops.registry import register

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2


def reduce_loss(loss, reduction, dtype=None):
    """torch's apply_loss_reduction; sums in float32 for half types."""
    dtype = loss.dtype if dtype is None else dtype
    if reduction == NONE:
        return loss.astype(dtype)
    acc = acc_dtype(loss.dtype)
    if reduction == MEAN:
        return jnp.mean(loss, dtype=acc).astype(dtype)
    if reduction == SUM:
        return jnp.sum(loss, dtype=acc).astype(dtype)
    raise ValueError(f"{reduction} is not a valid value for reduction")


def _grad_norm(reduction, numel):
    return 1.0 / numel if reduction == MEAN else 1.0


# --------------------------------------------------------------------------------------- nll loss


def _nll_parts(x, target, weight, ignore_index):
    """(one-hot over the class axis, class axis, per-element weight with ignored -> 0, valid mask)."""
    cdim = 0 if x.ndim == 1 else 1
    if target.ndim != x.ndim - 1:
        raise RuntimeError(f"nll_loss: expected target of {x.ndim - 1} dims for input of {x.ndim} dims, got {target.ndim}")
    nclass = x.shape[cdim]
    classes = jax.lax.broadcasted_iota(target.dtype, tuple(nclass if i == cdim else 1 for i in range(x.ndim)), cdim)
    onehot = jnp.expand_dims(target, cdim) == classes
    valid = target != ignore_index
    acc = acc_dtype(x.dtype)
    if weight is None:
        w = jnp.ones(target.shape, acc)
    else:
        wb = weight.astype(acc).reshape(tuple(nclass if i == cdim else 1 for i in range(x.ndim)))
        w = jnp.sum(jnp.where(onehot, wb, jnp.zeros((), acc)), axis=cdim)
    w = jnp.where(valid, w, jnp.zeros((), acc))
    return onehot, cdim, w, valid


def nll_forward(x, target, weight, reduction, ignore_index):
    onehot, cdim, w, valid = _nll_parts(x, target, weight, ignore_index)
    acc = acc_dtype(x.dtype)
    picked = jnp.sum(jnp.where(onehot, x.astype(acc), jnp.zeros((), acc)), axis=cdim)
    loss = jnp.where(valid, -picked * w, jnp.zeros((), acc))
    total = jnp.sum(w)
    if reduction == NONE:  # torch reports a total weight only for 1-d input
        return loss.astype(x.dtype), (total if x.ndim == 1 else jnp.zeros((), acc)).astype(x.dtype)
    out = jnp.sum(loss)
    if reduction == MEAN:
        out = out / total
    return out.astype(x.dtype), total.astype(x.dtype)


def nll_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    onehot, cdim, w, valid = _nll_parts(x, target, weight, ignore_index)
    acc = acc_dtype(x.dtype)
    g = grad.astype(acc)
    if reduction == MEAN:
        g = g / total_weight.astype(acc)
    coef = jnp.where(valid, -w * g, jnp.zeros((), acc))
    return jnp.where(onehot, jnp.expand_dims(coef, cdim), jnp.zeros((), acc)).astype(x.dtype)


@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    return nll_forward(x, target, weight, reduction, ignore_index)


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    return nll_backward(grad, x, target, weight, reduction, ignore_index, total_weight)


# ------------------------------------------------------------------------------ regression losses


@register(aten.mse_loss.default)
def mse_loss(x, target, reduction=MEAN):
    return reduce_loss(jnp.square(x - target), reduction)


@register(aten.mse_loss_backward.default)
def mse_loss_backward(grad, x, target, reduction):
    diff = x - target
    norm = 2.0 / diff.size if reduction == MEAN else 2.0
    return ((diff * norm) * grad).astype(x.dtype)


@register(aten.smooth_l1_loss.default)
def smooth_l1_loss(x, target, reduction=MEAN, beta=1.0):
    z = jnp.abs(x - target)
    if beta == 0:
        return reduce_loss(z, reduction)
    return reduce_loss(jnp.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta).astype(x.dtype), reduction)


@register(aten.smooth_l1_loss_backward.default)
def smooth_l1_loss_backward(grad, x, target, reduction, beta):
    d = x - target
    norm = _grad_norm(reduction, d.size)
    g = jnp.where(d <= -beta, -norm * grad, jnp.where(d >= beta, norm * grad, (norm * d * grad / beta) if beta else 0))
    return g.astype(x.dtype)


@register(aten.huber_loss.default)
def huber_loss(x, target, reduction=MEAN, delta=1.0):
    z = jnp.abs(x - target)
    return reduce_loss(jnp.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta)).astype(x.dtype), reduction)


@register(aten.huber_loss_backward.default)
def huber_loss_backward(grad, x, target, reduction, delta):
    d = x - target
    norm = _grad_norm(reduction, d.size)
    g = jnp.where(d < -delta, -norm * grad * delta, jnp.where(d > delta, norm * grad * delta, norm * d * grad))
    return g.astype(x.dtype)


# ------------------------------------------------------------------------------- classification


@register(aten.binary_cross_entropy.default)
def binary_cross_entropy(x, target, weight=None, reduction=MEAN):
    acc = acc_dtype(x.dtype)
    xf, t = x.astype(acc), target.astype(acc)
    loss = (t - 1) * jnp.maximum(jnp.log1p(-xf), -100) - t * jnp.maximum(jnp.log(xf), -100)
    if weight is not None:
        loss = loss * weight.astype(acc)
    return reduce_loss(loss.astype(x.dtype), reduction)


@register(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad, x, target, weight=None, reduction=MEAN):
    acc = acc_dtype(x.dtype)
    xf, t = x.astype(acc), target.astype(acc)
    g = grad.astype(acc) * (xf - t) / jnp.maximum((1 - xf) * xf, 1e-12)
    if weight is not None:
        g = g * weight.astype(acc)
    if reduction == MEAN:
        g = g / xf.size
    return jnp.broadcast_to(g, x.shape).astype(x.dtype)


@register(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits(x, target, weight=None, pos_weight=None, reduction=MEAN):
    log_sig = jax.nn.log_sigmoid(x)
    if pos_weight is not None:
        log_sig = log_sig * ((pos_weight - 1) * target + 1)
    loss = (1 - target) * x - log_sig
    if weight is not None:
        loss = loss * weight
    return reduce_loss(loss.astype(x.dtype), reduction)


@register(aten.soft_margin_loss.default)
def soft_margin_loss(x, target, reduction=MEAN):
    return reduce_loss(jnp.log1p(jnp.exp(-target * x)).astype(x.dtype), reduction)


@register(aten.soft_margin_loss_backward.default)
def soft_margin_loss_backward(grad, x, target, reduction):
    norm = _grad_norm(reduction, x.size)
    z = jnp.exp(-target * x)
    return (-norm * target * z / (1 + z) * grad).astype(x.dtype)
