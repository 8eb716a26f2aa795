"""Lowerings of normalization ops: layer norm, batch norm (every aten form) and group norm, with
their backward ops.

Statistics are computed in float32 for half/bfloat16 inputs (torch's CPU accumulation type). Saved
statistics have the input dtype, except when a half input meets float32 parameters (torch's "mixed
type" batch/layer norm): then they are float32. torch's meta kernels say float32 for every half
input, so these ops are registered with ``dtypes_from_lowering``: the dispatcher takes their result
dtypes from the lowering.

Running statistics. ``aten.native_batch_norm`` (what ``nn.BatchNorm*d`` reaches in training) updates
``running_mean``/``running_var`` in place although its schema does not say so. Its lowering returns
only the schema's three outputs; the dispatcher gets the updated running stats from
:func:`batch_norm_update_stats` (or, equivalently, outputs 3 and 4 of
``aten._native_batch_norm_legit_functional``) and writes them back into the two tensors.

Example::

    out, mean, invstd = lookup(aten.native_batch_norm.default).fn(x, w, b, rm, rv, True, 0.1, 1e-5)
    new_rm, new_rv = batch_norm_update_stats(x, rm, rv, 0.1)
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from shardtensor.ops._promote import acc_dtype
from shardtensor.ops.registry import register

aten = torch.ops.aten

_HALF = (jnp.bfloat16, jnp.float16)


def _stat_dtype(x, *params):
    """torch's dtype for saved statistics: float32 for a half input with any float32 parameter."""
    if x.dtype in _HALF and any(p is not None and p.dtype == jnp.float32 for p in params):
        return jnp.float32
    return x.dtype


def _bshape(x, axis=1):
    """Shape that broadcasts a per-channel vector against x (channels at ``axis``)."""
    return tuple(-1 if i == axis else 1 for i in range(x.ndim))


# -------------------------------------------------------------------------------------- layer norm


@register(aten.native_layer_norm.default, dtypes_from_lowering=True)
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    axis = x.ndim - len(normalized_shape)
    if tuple(x.shape[axis:]) != tuple(normalized_shape):
        raise RuntimeError(
            f"Given normalized_shape={list(normalized_shape)}, expected input with shape "
            f"[*, {', '.join(map(str, normalized_shape))}], but got input of size{list(x.shape)}"
        )
    axes = tuple(range(axis, x.ndim))
    acc = acc_dtype(x.dtype)
    xf = x.astype(acc)
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = (xf - mean) * rstd
    if weight is not None:
        out = out * weight.astype(acc)
    if bias is not None:
        out = out + bias.astype(acc)
    sd = _stat_dtype(x, weight, bias)
    return out.astype(x.dtype), mean.astype(sd), rstd.astype(sd)


@register(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    axis = x.ndim - len(normalized_shape)
    axes = tuple(range(axis, x.ndim))
    lead = tuple(range(axis))
    acc = acc_dtype(x.dtype)
    g, xf = grad.astype(acc), x.astype(acc)
    mean, rstd = mean.astype(acc), rstd.astype(acc)
    xhat = (xf - mean) * rstd
    gx = gw = gb = None
    if output_mask[0]:
        gw_in = g * weight.astype(acc) if weight is not None else g
        a = jnp.mean(gw_in, axis=axes, keepdims=True)
        b = jnp.mean(gw_in * xhat, axis=axes, keepdims=True)
        gx = (rstd * (gw_in - a - xhat * b)).astype(x.dtype)
    if output_mask[1] and weight is not None:
        gw = jnp.sum(g * xhat, axis=lead).astype(weight.dtype)
    if output_mask[2] and bias is not None:
        gb = jnp.sum(g, axis=lead).astype(bias.dtype)
    return gx, gw, gb


# -------------------------------------------------------------------------------------- batch norm


def _bn_axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _batch_stats(x):
    """Per-channel mean and biased variance in the accumulation dtype."""
    axes = _bn_axes(x)
    xf = x.astype(acc_dtype(x.dtype))
    mean = jnp.mean(xf, axis=axes)
    var = jnp.mean(jnp.square(xf - mean.reshape(_bshape(x))), axis=axes)
    return mean, var


def _bn_apply(x, weight, bias, mean, invstd):
    acc = acc_dtype(x.dtype)
    out = (x.astype(acc) - mean.astype(acc).reshape(_bshape(x))) * invstd.astype(acc).reshape(_bshape(x))
    if weight is not None:
        out = out * weight.astype(acc).reshape(_bshape(x))
    if bias is not None:
        out = out + bias.astype(acc).reshape(_bshape(x))
    return out.astype(x.dtype)


def batch_norm_update_stats(x, running_mean, running_var, momentum, batch_mean=None, batch_var=None):
    """torch's running-stat update of a training batch norm: (new_running_mean, new_running_var).

    running = (1 - momentum) * running + momentum * batch statistic (unbiased variance).
    """
    if batch_mean is None:
        batch_mean, batch_var = _batch_stats(x)
    n = x.size // x.shape[1] if x.shape[1] else 0
    if n > 1:
        unbiased = batch_var * (n / (n - 1))
    else:
        unbiased = batch_var * jnp.asarray(jnp.nan if n == 0 else jnp.inf, batch_var.dtype)
    acc = batch_mean.dtype
    new_m = momentum * batch_mean + (1 - momentum) * running_mean.astype(acc)
    new_v = momentum * unbiased + (1 - momentum) * running_var.astype(acc)
    return new_m.astype(running_mean.dtype), new_v.astype(running_var.dtype)


def batch_norm_forward(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """(out, save_mean, save_invstd, new_running_mean or None, new_running_var or None)."""
    sd = _stat_dtype(x, weight, bias, running_mean, running_var)
    if training:
        mean, var = _batch_stats(x)
        invstd = 1 / jnp.sqrt(var + eps)
        out = _bn_apply(x, weight, bias, mean, invstd)
        new_m = new_v = None
        if running_mean is not None and running_var is not None:
            new_m, new_v = batch_norm_update_stats(x, running_mean, running_var, momentum, mean, var)
        return out, mean.astype(sd), invstd.astype(sd), new_m, new_v
    if running_mean is None or running_var is None:
        raise RuntimeError("batch_norm: running_mean and running_var must be defined in evaluation mode")
    acc = acc_dtype(x.dtype)
    invstd = 1 / jnp.sqrt(running_var.astype(acc) + eps)
    out = _bn_apply(x, weight, bias, running_mean, invstd)
    empty = jnp.zeros((0,), sd)
    return out, empty, empty, running_mean, running_var


@register(aten.native_batch_norm.default, dtypes_from_lowering=True)
def native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    # NOTE: in training torch also updates running_mean/var in place: see batch_norm_update_stats
    return batch_norm_forward(x, weight, bias, running_mean, running_var, training, momentum, eps)[:3]


@register(aten._native_batch_norm_legit_functional.default, dtypes_from_lowering=True)
def native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    out, m, s, new_m, new_v = batch_norm_forward(x, weight, bias, running_mean, running_var, training, momentum, eps)
    return out, m, s, new_m, new_v


@register(aten._native_batch_norm_legit.no_stats, dtypes_from_lowering=True)
def native_batch_norm_legit_no_stats(x, weight, bias, training, momentum, eps):
    return batch_norm_forward(x, weight, bias, None, None, True, momentum, eps)[:3]


@register(aten._native_batch_norm_legit_no_training.default, dtypes_from_lowering=True)
def native_batch_norm_legit_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    return batch_norm_forward(x, weight, bias, running_mean, running_var, False, momentum, eps)[:3]


def _reserve():
    return jnp.zeros((0,), jnp.uint8)


@register(aten._batch_norm_with_update_functional.default, dtypes_from_lowering=True)
def batch_norm_with_update_functional(x, weight, bias, running_mean, running_var, momentum, eps):
    out, m, s, new_m, new_v = batch_norm_forward(x, weight, bias, running_mean, running_var, True, momentum, eps)
    return out, m, s, _reserve(), new_m, new_v


@register(aten._batch_norm_no_update.default, dtypes_from_lowering=True)
def batch_norm_no_update(x, weight, bias, running_mean, running_var, momentum, eps):
    training = running_mean is None or running_var is None
    out, m, s, _, _ = batch_norm_forward(x, weight, bias, running_mean, running_var, training, momentum, eps)
    return out, m, s, _reserve()


@register(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(
    grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
):
    acc = acc_dtype(x.dtype)
    axes = _bn_axes(x)
    bs = _bshape(x)
    if train:
        mean, invstd = save_mean.astype(acc), save_invstd.astype(acc)
    else:
        mean, invstd = running_mean.astype(acc), 1 / jnp.sqrt(running_var.astype(acc) + eps)
    g, xf = grad.astype(acc), x.astype(acc)
    xc = xf - mean.reshape(bs)
    sum_g = jnp.sum(g, axis=axes)
    dot = jnp.sum(g * xc, axis=axes)
    w = weight.astype(acc) if weight is not None else jnp.ones((), acc)
    gx = gw = gb = None
    if output_mask[0]:
        if train:
            n = x.size // x.shape[1]
            proj = (dot * invstd * invstd / n).reshape(bs)
            gx = (g - sum_g.reshape(bs) / n - xc * proj) * (invstd * w).reshape(bs)
        else:
            gx = g * (invstd * w).reshape(bs)
        gx = gx.astype(x.dtype)
    pdt = weight.dtype if weight is not None else _stat_dtype(x, running_mean, save_mean)
    if output_mask[1]:
        gw = (dot * invstd).astype(pdt)
    if output_mask[2]:
        gb = sum_g.astype(pdt)
    return gx, gw, gb


@register(aten.batch_norm_backward.default)
def batch_norm_backward(
    grad, x, weight, running_mean, running_var, save_mean, save_var, update, eps, output_mask, reserve
):
    return native_batch_norm_backward(
        grad, x, weight, running_mean, running_var, save_mean, save_var, update, eps, output_mask
    )


# -------------------------------------------------------------------------------------- group norm


def _group_norm(x, weight, bias, n, c, group, eps):
    acc = acc_dtype(x.dtype)
    xg = x.astype(acc).reshape(n, group, -1)
    mean = jnp.mean(xg, axis=-1)
    var = jnp.mean(jnp.square(xg - mean[..., None]), axis=-1)
    rstd = lax.rsqrt(var + eps)
    out = ((xg - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    if weight is not None:
        out = out * weight.astype(acc).reshape(_bshape(x))
    if bias is not None:
        out = out + bias.astype(acc).reshape(_bshape(x))
    return out, mean, rstd


@register(aten.native_group_norm.default)
def native_group_norm(x, weight, bias, N, C, HxW, group, eps):
    out, mean, rstd = _group_norm(x, weight, bias, N, C, group, eps)
    sd = _stat_dtype(x, weight, bias)
    return out.astype(x.dtype), mean.astype(sd), rstd.astype(sd)


@register(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad, x, mean, rstd, weight, N, C, HxW, group, output_mask):
    acc = acc_dtype(x.dtype)
    g = grad.astype(acc).reshape(N, C, -1)
    mean = mean.astype(acc).reshape(N, group, 1)
    rstd = rstd.astype(acc).reshape(N, group, 1)
    xhat = ((x.astype(acc).reshape(N, group, -1) - mean) * rstd).reshape(N, C, -1)
    gx = gw = gb = None
    if output_mask[0]:
        dxhat = g * weight.astype(acc).reshape(1, C, 1) if weight is not None else g
        dxhat, xh = dxhat.reshape(N, group, -1), xhat.reshape(N, group, -1)
        a = jnp.mean(dxhat, axis=-1, keepdims=True)
        b = jnp.mean(dxhat * xh, axis=-1, keepdims=True)
        gx = (rstd * (dxhat - a - xh * b)).reshape(x.shape).astype(x.dtype)
    pdt = weight.dtype if weight is not None else x.dtype
    if output_mask[1]:
        gw = jnp.sum(g * xhat, axis=(0, 2)).astype(pdt)
    if output_mask[2]:
        gb = jnp.sum(g, axis=(0, 2)).astype(pdt)
    return gx, gw, gb
