"""Lowerings of pooling ops: max/avg pooling (1-3 spatial dims, with their backward), adaptive
avg/max pooling, fractional max pooling (2-3 dims), im2col/col2im (``F.unfold``/``F.fold``).

Windows are built from strided slices of the padded input (one per kernel offset), so batch- and
channel-sharded inputs stay local. Max pooling follows torch's CPU kernel exactly: the first maximum
wins, a NaN wins over everything (the last NaN of the window), and indices are flat positions in the
input plane. Backward ops are the transposes of the forwards (``jax.linear_transpose``), no scatter.

Example::

    out, idx = lookup(aten.max_pool2d_with_indices.default).fn(x, [3, 3], [2, 2], [1, 1], [1, 1], False)
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from shardtensor.ops._promote import acc_dtype
from shardtensor.ops.registry import register

aten = torch.ops.aten


# ----------------------------------------------------------------------------------------- helpers


def expand_param(v, n, default=None):
    """torch's int[n] argument: a length-1 list (or int) repeats; an empty list means ``default``."""
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        v = default
    if isinstance(v, int):
        return (v,) * n
    v = tuple(v)
    return v * n if len(v) == 1 else v


def lowest(dtype):
    return jnp.asarray(-jnp.inf if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).min, dtype)


def pool_out_size(n, k, s, p, d, ceil_mode):
    """torch's pooling_output_shape."""
    out = (n + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= n + p:
        out -= 1
    return out


def windows(x, kernel, stride, padding, dilation, out_sizes, pad_value):
    """(..., *spatial) -> (..., *out_sizes, K): the pooling windows, K = prod(kernel) in row-major order."""
    nsp = len(kernel)
    lead = x.ndim - nsp
    config = [(0, 0, 0)] * lead
    for n, k, s, p, d, o in zip(x.shape[lead:], kernel, stride, padding, dilation, out_sizes):
        config.append((p, max((o - 1) * s + d * (k - 1) + 1 - n - p, 0), 0))
    xp = lax.pad(x, jnp.asarray(pad_value, x.dtype), config)
    slices = []
    for offs in itertools.product(*[range(k) for k in kernel]):
        start = [0] * lead + [o * d for o, d in zip(offs, dilation)]
        limit = list(x.shape[:lead]) + [st + (o - 1) * s + 1 for st, o, s in zip(start[lead:], out_sizes, stride)]
        slices.append(lax.slice(xp, start, limit, [1] * lead + list(stride)))
    return jnp.stack(slices, axis=-1)


def _window_geometry(in_sizes, kernel, stride, padding, dilation, out_sizes):
    """Static arrays: flat input position of every (out position, kernel offset) and its validity."""
    nsp = len(kernel)
    instr = [math.prod(in_sizes[i + 1 :]) for i in range(nsp)]
    base = np.zeros(out_sizes, np.int64)
    valid = np.ones(tuple(out_sizes) + tuple(kernel), bool)
    off = np.zeros(kernel, np.int64)
    for i in range(nsp):
        o = np.arange(out_sizes[i]) * stride[i] - padding[i]
        k = np.arange(kernel[i]) * dilation[i]
        shp = [1] * nsp
        shp[i] = -1
        base = base + (o * instr[i]).reshape(shp)
        off = off + (k * instr[i]).reshape(shp)
        coord = o[:, None] + k[None, :]
        vshape = [1] * (2 * nsp)
        vshape[i], vshape[nsp + i] = out_sizes[i], kernel[i]
        valid = valid & ((coord >= 0) & (coord < in_sizes[i])).reshape(vshape)
    return base, off.reshape(-1), valid.reshape(tuple(out_sizes) + (-1,))


def select_max(win, valid):
    """torch's max selection over the last axis: (max value, window position) — first max, last NaN."""
    k = win.shape[-1]
    m = jnp.max(jnp.where(valid, win, lowest(win.dtype)), axis=-1)
    pick = jnp.argmax(valid & (win == m[..., None]), axis=-1)
    if jnp.issubdtype(win.dtype, jnp.inexact):
        nan = valid & jnp.isnan(win)
        last_nan = k - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
        pick = jnp.where(jnp.any(nan, axis=-1), last_nan, pick)
        m = jnp.where(jnp.any(nan, axis=-1), jnp.asarray(jnp.nan, win.dtype), m)
    return m, pick


def _pool_args(x, nsp, kernel_size, stride, padding, dilation=1):
    kernel = expand_param(kernel_size, nsp)
    stride = expand_param(stride, nsp, kernel)
    padding = expand_param(padding, nsp, 0)
    dilation = expand_param(dilation, nsp, 1)
    if x.ndim not in (nsp + 1, nsp + 2):
        raise RuntimeError(f"pooling: expected {nsp + 1}D or {nsp + 2}D input, got {x.ndim}D")
    for k, p in zip(kernel, padding):
        if p > k // 2:
            raise RuntimeError(f"pad should be at most half of effective kernel size, but got pad={p}, kernel_size={k}")
    return kernel, stride, padding, dilation


# ------------------------------------------------------------------------------------ max pooling


def max_pool(x, nsp, kernel_size, stride, padding, dilation, ceil_mode):
    kernel, stride, padding, dilation = _pool_args(x, nsp, kernel_size, stride, padding, dilation)
    in_sizes = x.shape[-nsp:]
    outs = [pool_out_size(*a, ceil_mode) for a in zip(in_sizes, kernel, stride, padding, dilation)]
    win = windows(x, kernel, stride, padding, dilation, outs, lowest(x.dtype))
    base, off, valid = _window_geometry(in_sizes, kernel, stride, padding, dilation, outs)
    val, pick = select_max(win, valid)
    return val, (jnp.asarray(base) + jnp.asarray(off)[pick]).astype(jnp.int64)


def max_pool_backward(grad, x, nsp, kernel_size, stride, padding, dilation, ceil_mode, indices):
    kernel, stride, padding, dilation = _pool_args(x, nsp, kernel_size, stride, padding, dilation)
    in_sizes = x.shape[-nsp:]
    outs = [pool_out_size(*a, ceil_mode) for a in zip(in_sizes, kernel, stride, padding, dilation)]
    base, off, _ = _window_geometry(in_sizes, kernel, stride, padding, dilation, outs)
    # which window offset each output picked, as a dense one-hot: no scatter, stays local
    onehot = (indices - jnp.asarray(base))[..., None] == jnp.asarray(off)
    acc = acc_dtype(grad.dtype)
    spread = jnp.where(onehot, grad.astype(acc)[..., None], jnp.zeros((), acc))
    zero = jnp.zeros((), acc)
    fwd = lambda v: windows(v, kernel, stride, padding, dilation, outs, zero)  # noqa: E731
    (gx,) = jax.linear_transpose(fwd, jax.ShapeDtypeStruct(x.shape, acc))(spread)
    return gx.astype(grad.dtype)


@register(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return max_pool(x, 2, kernel_size, stride, padding, dilation, ceil_mode)


@register(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return max_pool(x, 3, kernel_size, stride, padding, dilation, ceil_mode)


@register(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return max_pool_backward(grad, x, 2, kernel_size, stride, padding, dilation, ceil_mode, indices)


@register(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return max_pool_backward(grad, x, 3, kernel_size, stride, padding, dilation, ceil_mode, indices)


# ------------------------------------------------------------------------------------ avg pooling


def _avg_divisor(in_sizes, kernel, stride, padding, outs, count_include_pad, divisor_override):
    if divisor_override:
        return np.asarray(divisor_override, np.int64)
    div = np.ones((), np.int64)
    for i, (n, k, s, p, o) in enumerate(zip(in_sizes, kernel, stride, padding, outs)):
        start = np.arange(o) * s - p
        end = np.minimum(start + k, n + p)
        size = end - start
        if not count_include_pad:
            size = np.minimum(end, n) - np.maximum(start, 0)
        shp = [1] * len(outs)
        shp[i] = -1
        div = div * size.reshape(shp)
    return np.maximum(div, 1)


def window_sum(x, kernel, stride, padding, out_sizes):
    """Sum over each pooling window (zero padding, extra zeros past the end for ceil_mode)."""
    nsp = len(kernel)
    lead = x.ndim - nsp
    pads = [(0, 0)] * lead
    for n, k, s, p, o in zip(x.shape[lead:], kernel, stride, padding, out_sizes):
        pads.append((p, max((o - 1) * s + k - n - p, 0)))
    out = lax.reduce_window(
        x, np.zeros((), x.dtype), lax.add, (1,) * lead + tuple(kernel), (1,) * lead + tuple(stride), pads
    )
    return out[(Ellipsis,) + tuple(slice(0, o) for o in out_sizes)]


def avg_pool(x, nsp, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    kernel, stride, padding, _ = _pool_args(x, nsp, kernel_size, stride, padding)
    in_sizes = x.shape[-nsp:]
    dil = (1,) * nsp
    outs = [pool_out_size(*a, ceil_mode) for a in zip(in_sizes, kernel, stride, padding, dil)]
    acc = acc_dtype(x.dtype)
    total = window_sum(x.astype(acc), kernel, stride, padding, outs)
    div = _avg_divisor(in_sizes, kernel, stride, padding, outs, count_include_pad, divisor_override)
    if jnp.issubdtype(acc, jnp.integer):
        # C++ division truncates
        return lax.div(total, jnp.broadcast_to(jnp.asarray(div, acc), total.shape)).astype(x.dtype)
    return (total / jnp.asarray(div, acc)).astype(x.dtype)


def avg_pool_backward(grad, x, nsp, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    acc = acc_dtype(grad.dtype)
    fwd = lambda v: avg_pool(v, nsp, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)  # noqa: E731
    (gx,) = jax.linear_transpose(fwd, jax.ShapeDtypeStruct(x.shape, acc))(grad.astype(acc))
    return gx.astype(grad.dtype)


@register(aten.avg_pool2d.default)
def avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return avg_pool(x, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@register(aten.avg_pool3d.default)
def avg_pool3d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return avg_pool(x, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@register(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return avg_pool_backward(grad, x, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@register(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return avg_pool_backward(grad, x, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


# ------------------------------------------------------------------------------- adaptive pooling


def _adaptive_ranges(n, o):
    start = (np.arange(o) * n) // o
    end = -((-(np.arange(o) + 1) * n) // o)
    return start, end


def _adaptive_windows(x, out_sizes):
    """(..., *spatial) -> (..., *out, L) windows of adaptive pooling (L = product of the longest
    window per dim), with a validity mask and the flat input position of every element."""
    nsp = len(out_sizes)
    lead = x.ndim - nsp
    in_sizes = x.shape[lead:]
    instr = [math.prod(in_sizes[i + 1 :]) for i in range(nsp)]
    valid = np.ones((), bool)
    flat = np.zeros((), np.int64)
    for i, (n, o) in enumerate(zip(in_sizes, out_sizes)):
        start, end = _adaptive_ranges(n, o)
        length = int((end - start).max()) if o else 1
        pos = start[:, None] + np.arange(length)[None, :]
        ok = pos < end[:, None]
        pos = np.minimum(pos, n - 1)
        x = jnp.take(x, pos.reshape(-1), axis=lead + 2 * i).reshape(
            x.shape[: lead + 2 * i] + (o, length) + x.shape[lead + 2 * i + 1 :]
        )
        shp = [1] * (2 * nsp)
        shp[2 * i], shp[2 * i + 1] = o, length
        valid = valid & ok.reshape(shp)
        flat = flat + (pos * instr[i]).reshape(shp)
    perm = list(range(lead)) + [lead + 2 * i for i in range(nsp)] + [lead + 2 * i + 1 for i in range(nsp)]
    x = jnp.transpose(x, perm).reshape(x.shape[:lead] + tuple(out_sizes) + (-1,))
    sp_perm = [2 * i for i in range(nsp)] + [2 * i + 1 for i in range(nsp)]
    valid = np.transpose(valid, sp_perm).reshape(tuple(out_sizes) + (-1,))
    flat = np.transpose(flat, sp_perm).reshape(tuple(out_sizes) + (-1,))
    return x, valid, flat


def adaptive_avg_pool(x, out_sizes):
    """Separable: per spatial dim, sum each adaptive window (a reshape when the size divides evenly,
    else a static gather with a mask), then divide by the window sizes."""
    nsp = len(out_sizes)
    acc = acc_dtype(x.dtype)
    y = x.astype(acc)
    count = np.ones((), np.int64)
    for i, o in enumerate(out_sizes):
        axis = y.ndim - nsp + i
        n = y.shape[axis]
        start, end = _adaptive_ranges(n, o)
        if o and n % o == 0:
            y = jnp.sum(y.reshape(y.shape[:axis] + (o, n // o) + y.shape[axis + 1 :]), axis=axis + 1)
        else:
            length = int((end - start).max()) if o else 1
            pos = start[:, None] + np.arange(length)[None, :]
            ok = pos < end[:, None]
            win = jnp.take(y, np.minimum(pos, n - 1).reshape(-1), axis=axis)
            win = win.reshape(y.shape[:axis] + (o, length) + y.shape[axis + 1 :])
            mask = ok.reshape((o, length) + (1,) * (y.ndim - axis - 1))
            y = jnp.sum(jnp.where(mask, win, jnp.zeros((), acc)), axis=axis + 1)
        shape = [1] * nsp
        shape[i] = o
        count = count * (end - start).reshape(shape)
    return (y / jnp.asarray(count, acc)).astype(x.dtype)


def _adaptive_out(out_size, nsp):
    return expand_param(out_size, nsp)


@register(aten._adaptive_avg_pool2d.default)
def adaptive_avg_pool2d(x, output_size):
    return adaptive_avg_pool(x, _adaptive_out(output_size, 2))


def _adaptive_avg_pool3d_half(x, out_sizes):
    """torch's CPU adaptive_avg_pool3d for bf16/f16 sums each window in the input dtype, rounding after
    every addition in (d, h, w) order: the same sequence of roundings, one window offset per loop
    step (an offset past a shorter window adds an exact 0)."""
    (sd, ed), (sh, eh), (sw, ew) = (_adaptive_ranges(n, o) for n, o in zip(x.shape[-3:], out_sizes))
    ld, lh, lw = (int((e - s).max()) if len(s) else 0 for s, e in ((sd, ed), (sh, eh), (sw, ew)))
    zero = jnp.zeros((), x.dtype)

    def axis_positions(start, end, off, n):
        pos = start + off
        return jnp.minimum(pos, n - 1), pos < end

    def body(t, acc):
        (pd, vd), (ph, vh), (pw, vw) = (
            axis_positions(s, e, off, n)
            for s, e, off, n in (
                (sd, ed, t // (lh * lw), x.shape[-3]),
                (sh, eh, (t // lw) % lh, x.shape[-2]),
                (sw, ew, t % lw, x.shape[-1]),
            )
        )
        v = x[..., pd[:, None, None], ph[None, :, None], pw[None, None, :]]
        ok = vd[:, None, None] & vh[None, :, None] & vw[None, None, :]
        return (acc.astype(jnp.float32) + jnp.where(ok, v, zero).astype(jnp.float32)).astype(x.dtype)

    total = lax.fori_loop(0, ld * lh * lw, body, jnp.zeros(x.shape[:-3] + tuple(out_sizes), x.dtype))
    count = ((ed - sd)[:, None, None] * (eh - sh)[None, :, None] * (ew - sw)[None, None, :]).astype(np.float32)
    count = jnp.asarray(count).astype(x.dtype).astype(jnp.float32)  # torch divides by the count as bf16
    return (total.astype(jnp.float32) / count).astype(x.dtype)


@register(aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool3d(x, output_size):
    out_sizes = _adaptive_out(output_size, 3)
    if x.dtype in (jnp.bfloat16, jnp.float16) and x.size and all(out_sizes):
        return _adaptive_avg_pool3d_half(x, out_sizes)
    return adaptive_avg_pool(x, out_sizes)


def _adaptive_avg_backward(grad, x, nsp):
    acc = acc_dtype(grad.dtype)
    fwd = lambda v: adaptive_avg_pool(v, grad.shape[-nsp:])  # noqa: E731
    (gx,) = jax.linear_transpose(fwd, jax.ShapeDtypeStruct(x.shape, acc))(grad.astype(acc))
    return gx.astype(grad.dtype)


@register(aten._adaptive_avg_pool2d_backward.default)
def adaptive_avg_pool2d_backward(grad, x):
    return _adaptive_avg_backward(grad, x, 2)


@register(aten._adaptive_avg_pool3d_backward.default)
def adaptive_avg_pool3d_backward(grad, x):
    return _adaptive_avg_backward(grad, x, 3)


def adaptive_max_pool(x, out_sizes):
    win, valid, flat = _adaptive_windows(x, out_sizes)
    val, pick = select_max(win, jnp.asarray(valid))
    idx = jnp.take_along_axis(jnp.broadcast_to(jnp.asarray(flat), win.shape), pick[..., None], axis=-1)[..., 0]
    return val, idx.astype(jnp.int64)


def _scatter_plane_grad(grad, x, indices, nsp):
    lead = x.shape[: x.ndim - nsp]
    b, plane = math.prod(lead), math.prod(x.shape[x.ndim - nsp :])
    acc = acc_dtype(grad.dtype)
    g = grad.reshape(b, -1).astype(acc)
    i = indices.reshape(b, -1)
    out = jnp.zeros((b, plane), acc).at[jnp.arange(b)[:, None], i].add(g)
    return out.reshape(x.shape).astype(grad.dtype)


@register(aten.adaptive_max_pool2d.default)
def adaptive_max_pool2d(x, output_size):
    return adaptive_max_pool(x, _adaptive_out(output_size, 2))


@register(aten.adaptive_max_pool3d.default)
def adaptive_max_pool3d(x, output_size):
    return adaptive_max_pool(x, _adaptive_out(output_size, 3))


@register(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad, x, indices):
    return _scatter_plane_grad(grad, x, indices, 2)


@register(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad, x, indices):
    return _scatter_plane_grad(grad, x, indices, 3)


# ---------------------------------------------------------------------------------- im2col/col2im


def im2col(x, kernel_size, dilation, padding, stride):
    kernel = expand_param(kernel_size, 2)
    dilation, padding, stride = (expand_param(v, 2) for v in (dilation, padding, stride))
    outs = [
        (n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, d, p, s in zip(x.shape[-2:], kernel, dilation, padding, stride)
    ]
    win = windows(x, kernel, stride, padding, dilation, outs, 0)  # (..., C, OH, OW, K)
    lead = x.shape[:-3]
    c = x.shape[-3]
    win = jnp.moveaxis(win, -1, -3)  # (..., C, K, OH, OW)
    return win.reshape(lead + (c * math.prod(kernel), outs[0] * outs[1]))


register(aten.im2col.default)(im2col)


@register(aten.col2im.default)
def col2im(x, output_size, kernel_size, dilation, padding, stride):
    kernel = expand_param(kernel_size, 2)
    c = x.shape[-2] // math.prod(kernel)
    shape = x.shape[:-2] + (c,) + tuple(output_size)
    fwd = lambda v: im2col(v, kernel_size, dilation, padding, stride)  # noqa: E731
    acc = acc_dtype(x.dtype)
    (out,) = jax.linear_transpose(fwd, jax.ShapeDtypeStruct(shape, acc))(x.astype(acc))
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------- fractional max pool


def _fractional_starts(sample, n_in, n_out, k):
    """torch's generate_intervals: window starts (..., n_out) from one uniform sample per plane, in the
    sample's dtype (float32 arithmetic for float32 input, as torch); the last window ends at the edge."""
    if n_out > 1:
        alpha = jnp.asarray(n_in - k, sample.dtype) / jnp.asarray(n_out - 1, sample.dtype)
        i = jnp.arange(n_out - 1, dtype=sample.dtype)
        s = sample[..., None]
        starts = (jnp.trunc((i + s) * alpha) - jnp.trunc(s * alpha)).astype(jnp.int64)
        return jnp.concatenate([starts, jnp.full(sample.shape + (1,), n_in - k, jnp.int64)], axis=-1)
    return jnp.full(sample.shape + (n_out,), n_in - k, jnp.int64)


def fractional_max_pool(x, kernel_size, output_size, samples, sample_order):
    """Max over windows of size ``kernel_size`` starting at pseudo-random positions (one draw per plane
    and spatial dim in ``samples`` (N, C, nsp), used in ``sample_order``). Returns (values, flat indices)."""
    nsp = len(sample_order)
    kernel, outs = expand_param(kernel_size, nsp), expand_param(output_size, nsp)
    batched = x.ndim == nsp + 2
    xb = x if batched else x[None]
    in_sizes = xb.shape[2:]
    for n, k, o in zip(in_sizes, kernel, outs):
        if o + k - 1 > n or (nsp == 3 and o + k - 1 == n):  # (torch's 3-d check is strict)
            raise RuntimeError(
                f"fractional_max_pool{nsp}d(): pool size {k} too large relative to input size {n} (output size {o})"
            )
    smp = samples.astype(acc_dtype(samples.dtype)) if samples.dtype != xb.dtype else samples
    nb, c = xb.shape[:2]
    starts = [_fractional_starts(smp[:, :, sample_order[d]], in_sizes[d], outs[d], kernel[d]) for d in range(nsp)]
    # flat input position of every (output position, kernel offset) of each plane: (N, C, *outs, K),
    # window offsets in row-major order so that the first maximum is torch's
    idx = jnp.zeros((nb, c) + tuple(outs) + tuple(kernel), jnp.int64)
    for d in range(nsp):
        pos = starts[d][..., :, None] + jnp.arange(kernel[d])
        shape = [nb, c] + [1] * (2 * nsp)
        shape[2 + d], shape[2 + nsp + d] = outs[d], kernel[d]
        idx = idx * in_sizes[d] + pos.reshape(shape)
    idx = idx.reshape((nb, c) + tuple(outs) + (-1,))
    win = jnp.take_along_axis(xb.reshape(nb, c, -1), idx.reshape(nb, c, -1), axis=2).reshape(idx.shape)
    val, pick = select_max(win, jnp.ones((), bool))
    ind = jnp.take_along_axis(idx, pick[..., None], axis=-1)[..., 0]
    if not batched:
        val, ind = val[0], ind[0]
    return val, ind


@register(aten.fractional_max_pool2d.default)
def fractional_max_pool2d(x, kernel_size, output_size, random_samples):
    return fractional_max_pool(x, kernel_size, output_size, random_samples, (1, 0))  # samples are (w, h)


@register(aten.fractional_max_pool3d.default)
def fractional_max_pool3d(x, kernel_size, output_size, random_samples):
    return fractional_max_pool(x, kernel_size, output_size, random_samples, (0, 1, 2))  # samples are (t, h, w)


@register(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad, x, kernel_size, output_size, indices):
    return _scatter_plane_grad(grad, x, indices, 2)


@register(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad, x, kernel_size, output_size, indices):
    return _scatter_plane_grad(grad, x, indices, 3)


# torch 2.13 has no meta kernel for fractional_max_pool3d_backward (the dispatcher takes output shapes
# from meta kernels): the gradient is shaped like the input.
_META_LIB = torch.library.Library("aten", "IMPL")
if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::fractional_max_pool3d_backward", "Meta"):
    _META_LIB.impl(
        "fractional_max_pool3d_backward", lambda grad, x, kernel_size, output_size, indices: torch.empty_like(x), "Meta"
    )
