"""Lowerings of upsampling (nearest, nearest-exact, linear/bilinear/trilinear; 1-3 spatial dims; bicubic
and antialiased bilinear/bicubic, 2 dims) and of reflection/replication padding, with their backward ops.

Source indices and interpolation weights are computed statically with torch's CPU formulas (in
float32, like torch's ``float`` index math), then applied per spatial dim with ``jnp.take``. Backward
ops are the transposes of the (linear) forwards.

Example::

    lookup(aten.upsample_bilinear2d.default).fn(x, [8, 8], False, None, None)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from shardtensor.ops._promote import acc_dtype
from shardtensor.ops.registry import register

aten = torch.ops.aten


def _scale_value(scale, n_in, n_out, T):
    """torch's compute_scales_value: 1/scale if given and positive, else in/out."""
    if scale is not None and scale > 0:
        return T(1.0 / scale)
    return T(n_in) / T(n_out)


def _nearest_src(n_in, n_out, scale, exact):
    o = np.arange(n_out)
    if exact:
        s = _scale_value(scale, n_in, n_out, np.float32)
        src = np.floor(((o + 0.5) * np.float64(s)).astype(np.float32)).astype(np.int64)
    elif n_out == n_in:
        return o
    elif n_out == 2 * n_in:
        return o >> 1
    else:
        s = _scale_value(scale, n_in, n_out, np.float32)
        src = np.floor(o.astype(np.float32) * s).astype(np.int64)
    return np.minimum(src, n_in - 1)


def _area_scale(n_in, n_out, align_corners, scale, T):
    """torch's area_pixel_compute_scale."""
    if align_corners:
        return T(n_in - 1) / T(n_out - 1) if n_out > 1 else T(0)
    return _scale_value(scale, n_in, n_out, T)


def _src_coord(n_in, n_out, align_corners, scale, T, cubic=False):
    """torch's area_pixel_compute_source_index for every output position (cubic: no clamp at 0)."""
    o = np.arange(n_out)
    sc = _area_scale(n_in, n_out, align_corners, scale, T)
    if align_corners:
        return (sc * o.astype(T)).astype(T)
    src = (sc * (o.astype(T) + T(0.5)) - T(0.5)).astype(T)
    return src if cubic else np.maximum(src, T(0))


def _linear_src(n_in, n_out, align_corners, scale, T):
    """(i0, i1, w0, w1): torch's linear interpolation indices and weights along one dim."""
    src = _src_coord(n_in, n_out, align_corners, scale, T)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    w1 = np.clip(src - i0.astype(T), T(0), T(1)).astype(T)
    w0 = (T(1) - w1).astype(T)
    i1 = i0 + (i0 < n_in - 1)
    return i0, i1, w0, w1


def _scales(args, nsp):
    scales = list(args) + [None] * nsp
    return scales[:nsp]


def upsample_nearest(x, output_size, scales, exact):
    nsp = len(output_size)
    for i, (n_out, sc) in enumerate(zip(output_size, scales)):
        axis = x.ndim - nsp + i
        n_in = x.shape[axis]
        idx = _nearest_src(n_in, n_out, sc, exact)
        if np.array_equal(idx, np.arange(n_in)):
            continue
        if n_in and n_out % n_in == 0 and np.array_equal(idx, np.arange(n_out) // (n_out // n_in)):
            x = jnp.repeat(x, n_out // n_in, axis=axis)  # integer factor: broadcast, no gather
        else:
            x = jnp.take(x, idx, axis=axis)
    return x


def upsample_linear(x, output_size, align_corners, scales):
    nsp = len(output_size)
    acc = acc_dtype(x.dtype)
    T = np.float64 if acc == jnp.float64 else np.float32
    y = x.astype(acc)
    for i, (n_out, sc) in enumerate(zip(output_size, scales)):
        axis = y.ndim - nsp + i
        i0, i1, w0, w1 = _linear_src(y.shape[axis], n_out, align_corners, sc, T)
        shape = [1] * y.ndim
        shape[axis] = n_out
        y = jnp.take(y, i0, axis=axis) * jnp.asarray(w0.reshape(shape), acc) + jnp.take(y, i1, axis=axis) * jnp.asarray(
            w1.reshape(shape), acc
        )
    return y.astype(x.dtype)


def _cubic1(x, a):
    return ((a + 2) * x - (a + 3)) * x * x + 1  # |x| <= 1


def _cubic2(x, a):
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a  # 1 < |x| < 2


def _cubic_taps(n_in, n_out, align_corners, scale, T):
    """(idx, w), both (n_out, 4): torch's bicubic taps (Keys, A = -0.75), indices clamped to the edge."""
    src = _src_coord(n_in, n_out, align_corners, scale, T, cubic=True)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    t = np.clip(src - i0.astype(T), T(0), T(1)).astype(T)
    a = T(-0.75)
    w = np.stack([_cubic2(t + 1, a), _cubic1(t, a), _cubic1(1 - t, a), _cubic2(2 - t, a)], axis=-1).astype(T)
    return np.clip(i0[:, None] + np.arange(-1, 3), 0, n_in - 1), w


def _aa_bilinear(x):
    return np.maximum(1 - np.abs(x), 0)


def _aa_bicubic(x):  # Keys with a = -0.5, as PIL
    x = np.abs(x)
    return np.where(x < 1, _cubic1(x, -0.5), np.where(x < 2, _cubic2(x, -0.5), 0))


def _aa_taps(n_in, n_out, align_corners, scale, T, interp_size, filt):
    """(idx, w), both (n_out, K): torch's antialiased (PIL-style) resampling taps: the filter is
    stretched by the downscale factor and its weights normalised to sum to 1; unused taps weigh 0."""
    sc = float(_area_scale(n_in, n_out, align_corners, scale, T))
    support = interp_size * 0.5 * sc if sc >= 1 else interp_size * 0.5
    k = math.ceil(support) * 2 + 1
    invscale = 1.0 / sc if sc >= 1 else 1.0
    center = sc * (np.arange(n_out) + 0.5)
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)  # C casts truncate
    xsize = np.clip(np.minimum((center + support + 0.5).astype(np.int64), n_in) - xmin, 0, k)
    j = np.arange(k)
    w = np.where(j < xsize[:, None], filt((j + xmin[:, None] - center[:, None] + 0.5) * invscale), 0.0)
    total = w.sum(axis=1, keepdims=True)
    w = np.where(total != 0, w / np.where(total != 0, total, 1), w)
    return np.minimum(xmin[:, None] + j, n_in - 1), w.astype(T)


def _apply_taps(y, axis, idx, w):
    """sum_k y[..., idx[:, k], ...] * w[:, k] along ``axis``."""
    shape = [1] * y.ndim
    shape[axis] = idx.shape[0]
    out = None
    for k in range(idx.shape[1]):
        term = jnp.take(y, idx[:, k], axis=axis) * jnp.asarray(w[:, k].reshape(shape), y.dtype)
        out = term if out is None else out + term
    return out


def upsample_cubic(x, output_size, align_corners, scales):
    acc = acc_dtype(x.dtype)
    T = np.float64 if acc == jnp.float64 else np.float32
    y = x.astype(acc)
    for i, (n_out, sc) in enumerate(zip(output_size, scales)):
        axis = y.ndim - 2 + i
        y = _apply_taps(y, axis, *_cubic_taps(y.shape[axis], n_out, align_corners, sc, T))
    return y.astype(x.dtype)


def upsample_aa(x, output_size, align_corners, scales, interp_size, filt):
    """Antialiased resize, separable: the last dim first, then the one before (dims whose size does not
    change are left alone, as torch does)."""
    acc = acc_dtype(x.dtype)
    T = np.float64 if acc == jnp.float64 else np.float32
    y = x.astype(acc)
    for i in reversed(range(len(output_size))):
        axis = y.ndim - len(output_size) + i
        if y.shape[axis] != output_size[i]:
            taps = _aa_taps(y.shape[axis], output_size[i], align_corners, scales[i], T, interp_size, filt)
            y = _apply_taps(y, axis, *taps)
    return y.astype(x.dtype)


def _transpose(fwd, input_size, grad):
    acc = acc_dtype(grad.dtype)
    (gx,) = jax.linear_transpose(fwd, jax.ShapeDtypeStruct(tuple(input_size), acc))(grad.astype(acc))
    return gx.astype(grad.dtype)


def _register_nearest(op, bwd, nsp, exact):
    @register(op)
    def forward(x, output_size, *scales):
        return upsample_nearest(x, list(output_size), _scales(scales, nsp), exact)

    @register(bwd)
    def backward(grad, output_size, input_size, *scales):
        fwd = lambda v: upsample_nearest(v, list(output_size), _scales(scales, nsp), exact)  # noqa: E731
        return _transpose(fwd, input_size, grad)

    return forward, backward


def _register_linear(op, bwd, nsp):
    @register(op)
    def forward(x, output_size, align_corners, *scales):
        return upsample_linear(x, list(output_size), align_corners, _scales(scales, nsp))

    @register(bwd)
    def backward(grad, output_size, input_size, align_corners, *scales):
        fwd = lambda v: upsample_linear(v, list(output_size), align_corners, _scales(scales, nsp))  # noqa: E731
        return _transpose(fwd, input_size, grad)

    return forward, backward


def _register_resample(op, bwd, fwd):
    """fwd(x, output_size, align_corners, scales): a linear resampling of the last two dims."""

    @register(op)
    def forward(x, output_size, align_corners, *scales):
        return fwd(x, list(output_size), align_corners, _scales(scales, 2))

    @register(bwd)
    def backward(grad, output_size, input_size, align_corners, *scales):
        return _transpose(lambda v: fwd(v, list(output_size), align_corners, _scales(scales, 2)), input_size, grad)

    return forward, backward


_register_resample(aten.upsample_bicubic2d.default, aten.upsample_bicubic2d_backward.default, upsample_cubic)
_register_resample(
    aten._upsample_bilinear2d_aa.default,
    aten._upsample_bilinear2d_aa_backward.default,
    lambda x, o, a, s: upsample_aa(x, o, a, s, 2, _aa_bilinear),
)
_register_resample(
    aten._upsample_bicubic2d_aa.default,
    aten._upsample_bicubic2d_aa_backward.default,
    lambda x, o, a, s: upsample_aa(x, o, a, s, 4, _aa_bicubic),
)
_register_nearest(aten.upsample_nearest1d.default, aten.upsample_nearest1d_backward.default, 1, False)
_register_nearest(aten.upsample_nearest2d.default, aten.upsample_nearest2d_backward.default, 2, False)
_register_nearest(aten.upsample_nearest3d.default, aten.upsample_nearest3d_backward.default, 3, False)
_register_nearest(aten._upsample_nearest_exact1d.default, aten._upsample_nearest_exact1d_backward.default, 1, True)
_register_nearest(aten._upsample_nearest_exact2d.default, aten._upsample_nearest_exact2d_backward.default, 2, True)
_register_nearest(aten._upsample_nearest_exact3d.default, aten._upsample_nearest_exact3d_backward.default, 3, True)
_register_linear(aten.upsample_linear1d.default, aten.upsample_linear1d_backward.default, 1)
_register_linear(aten.upsample_bilinear2d.default, aten.upsample_bilinear2d_backward.default, 2)
_register_linear(aten.upsample_trilinear3d.default, aten.upsample_trilinear3d_backward.default, 3)


# ------------------------------------------------------------------------ reflection/replication pad


def pad_mode(x, padding, mode):
    """torch's reflection/replication pad: padding = (left, right, top, bottom, front, back) from the last dim."""
    nsp = len(padding) // 2
    widths = [(0, 0)] * (x.ndim - nsp) + [
        (padding[2 * (nsp - 1 - i)], padding[2 * (nsp - 1 - i) + 1]) for i in range(nsp)
    ]
    if mode == "reflect":
        for i in range(nsp):
            n = x.shape[x.ndim - nsp + i]
            lo, hi = widths[x.ndim - nsp + i]
            if lo >= n or hi >= n:
                raise RuntimeError(
                    "Padding size should be less than the corresponding input dimension, but got: "
                    f"padding ({lo}, {hi}) at dimension {x.ndim - nsp + i} of input {list(x.shape)}"
                )
    if mode == "edge":
        for axis, (lo, hi) in enumerate(widths):
            n = x.shape[axis]
            if (lo < 0 or hi < 0) and n + min(lo, 0) + min(hi, 0) <= 0:
                # cropped away entirely: torch's replicate index is clip(j - lo, 0, n - 1) on the
                # uncropped input (one repeated edge value), which crop-then-pad cannot express
                x = jnp.take(x, np.clip(np.arange(n + lo + hi) - lo, 0, n - 1), axis=axis)
                widths[axis] = (0, 0)
    crop = [(min(lo, 0), min(hi, 0)) for lo, hi in widths]
    if any(lo or hi for lo, hi in crop):  # negative padding crops
        x = lax.pad(x, jnp.zeros((), x.dtype), [(lo, hi, 0) for lo, hi in crop])
    return jnp.pad(x, [(max(lo, 0), max(hi, 0)) for lo, hi in widths], mode=mode)


def _register_pad(op, bwd, mode):
    @register(op)
    def forward(x, padding):
        return pad_mode(x, padding, mode)

    @register(bwd)
    def backward(grad, x, padding):
        return _transpose(lambda v: pad_mode(v, padding, mode), x.shape, grad)

    return forward, backward


for _n in (1, 2, 3):
    _register_pad(
        getattr(aten, f"reflection_pad{_n}d").default, getattr(aten, f"reflection_pad{_n}d_backward").default, "reflect"
    )
    _register_pad(
        getattr(aten, f"replication_pad{_n}d").default, getattr(aten, f"replication_pad{_n}d_backward").default, "edge"
    )
