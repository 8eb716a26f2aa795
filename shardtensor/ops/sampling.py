"""Lowerings of ``grid_sampler_2d`` / ``grid_sampler_3d`` (``F.grid_sample``) and their backward.

Modes follow torch's CPU kernels: interpolation 0 bilinear, 1 nearest (round half to even), 2 bicubic
(2-d only, Keys with A = -0.75); padding 0 zeros, 1 border, 2 reflection; ``align_corners`` maps -1/1
to the centres (True) or the outer edges (False) of the corner pixels. Bilinear and nearest apply the
padding to the source coordinate; bicubic applies it to each of its 16 taps, as torch does.

Every sample point reads its taps from its own batch item (one batched gather over the flattened
spatial dims for all taps), so a batch-sharded input stays local. The forward runs in the input's dtype
with torch's order of operations, so a half-precision sample rounds at every step exactly as torch's
CPU kernel does. The backward is the vjp of the (float32 for halves) forward: clipping and reflection
are written with ``where`` so their derivative at the boundary is torch's (1, not 1/2).

Example::

    out = lookup(aten.grid_sampler_2d.default).fn(x, grid, 0, 0, False)   # x (N,C,H,W), grid (N,h,w,2)
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import torch

from shardtensor.ops._promote import acc_dtype
from shardtensor.ops.registry import register

aten = torch.ops.aten

BILINEAR, NEAREST, BICUBIC = 0, 1, 2
ZEROS, BORDER, REFLECTION = 0, 1, 2


def _unnormalize(coord, size, align_corners):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _clip(x, size):
    """torch's clip_coordinates, with derivative 1 on the closed interval."""
    hi = size - 1
    return jnp.where(x < 0, jnp.zeros_like(x), jnp.where(x > hi, jnp.full_like(x, hi), x))


def _reflect(x, twice_low, twice_high):
    """torch's reflect_coordinates: fold x into [low, high] by mirroring."""
    if twice_low == twice_high:
        return jnp.zeros_like(x)
    lo = twice_low / 2
    span = (twice_high - twice_low) / 2
    x = x - lo
    x = jnp.where(x < 0, -x, x)
    extra = jnp.fmod(x, span)
    flips = jnp.floor(x / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + lo, span - extra + lo)


def _pad_coord(x, size, padding_mode, align_corners):
    """torch's compute_coordinates: apply border / reflection padding to an unnormalised coordinate."""
    if padding_mode == BORDER:
        return _clip(x, size)
    if padding_mode == REFLECTION:
        x = _reflect(x, 0, 2 * (size - 1)) if align_corners else _reflect(x, -1, 2 * size - 1)
        return _clip(x, size)
    return x


def _gather(flat, sizes, coords):
    """flat (N, C, prod(sizes)); coords: per spatial dim an int array (N, K, *out) of K taps per output
    point. One batched gather for all taps; out-of-range taps read 0. Returns (N, C, K, *out)."""
    n, c = flat.shape[:2]
    tap_shape = coords[0].shape[1:]
    valid = jnp.ones(coords[0].shape, bool)
    index = jnp.zeros(coords[0].shape, jnp.int64)
    for coord, size in zip(coords, sizes):
        valid = valid & (coord >= 0) & (coord < size)
        index = index * size + jnp.clip(coord, 0, size - 1)
    vals = jnp.take_along_axis(flat, index.reshape(n, 1, -1), axis=2).reshape((n, c) + tap_shape)
    return jnp.where(valid[:, None], vals, jnp.zeros((), flat.dtype))


def _cubic_weights(t):
    """torch's get_cubic_upsample_coefficients (A = -0.75), in its evaluation order."""
    a = -0.75
    cc1 = lambda x: ((a + 2) * x - (a + 3)) * x * x + 1  # noqa: E731
    cc2 = lambda x: ((a * x - 5 * a) * x + 8 * a) * x - 4 * a  # noqa: E731
    u = 1 - t
    return [cc2(t + 1), cc1(t), cc1(u), cc2(u + 1)]


def _weighted_sum(vals, weights, axis):
    """sum_k vals[k] * weights[k] along ``axis``, left to right as torch accumulates."""
    out = None
    for k in range(vals.shape[axis]):
        term = jnp.take(vals, k, axis=axis) * jnp.take(weights, k, axis=axis)
        out = term if out is None else out + term
    return out


def grid_sample(x, grid, mode, padding_mode, align_corners, dtype=None):
    """x (N, C, *in), grid (N, *out, nsp) with the coordinates in (W, H[, D]) order -> (N, C, *out).

    Computed in ``dtype`` (default: the input's, as torch's CPU kernels, which round every step of a
    half-precision sample), with torch's order of operations."""
    nsp = x.ndim - 2
    if grid.ndim != nsp + 2 or grid.shape[-1] != nsp or grid.shape[0] != x.shape[0]:
        raise RuntimeError(
            f"grid_sampler(): expected grid of shape (N, *out, {nsp}) for input {list(x.shape)}, got {list(grid.shape)}"
        )
    if mode == BICUBIC and nsp != 2:
        raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")
    if mode not in (BILINEAR, NEAREST, BICUBIC):
        raise RuntimeError(f"grid_sampler(): unknown interpolation mode {mode}")
    dt = x.dtype if dtype is None else dtype
    sizes = x.shape[2:]
    flat = x.astype(dt).reshape(x.shape[:2] + (-1,))
    g = grid.astype(dt)
    # per spatial dim (D, H, W order): the unnormalised source coordinate
    src = [_unnormalize(g[..., nsp - 1 - d], sizes[d], align_corners) for d in range(nsp)]
    if mode == NEAREST:
        src = [_pad_coord(c, n, padding_mode, align_corners) for c, n in zip(src, sizes)]
        return _gather(flat, sizes, [jnp.round(c).astype(jnp.int64)[:, None] for c in src])[:, :, 0].astype(x.dtype)
    base = [jnp.floor(c) for c in src]
    if mode == BICUBIC:  # padding applies to each of the 4 x 4 taps, not to the source point
        offs = list(itertools.product(range(4), repeat=2))
        coords = [
            jnp.stack(
                [_pad_coord(base[d] + (o[d] - 1), sizes[d], padding_mode, align_corners) for o in offs], axis=1
            ).astype(jnp.int64)
            for d in range(2)
        ]
        vals = _gather(flat, sizes, coords)  # (N, C, 16, h, w), rows of 4 along x
        vals = vals.reshape(vals.shape[:2] + (4, 4) + vals.shape[3:])
        wy, wx = (jnp.stack(_cubic_weights(c - b), axis=1)[:, None] for c, b in zip(src, base))
        rows = _weighted_sum(vals, wx[:, :, None], axis=3)  # interpolate along x, then along y
        return _weighted_sum(rows, wy, axis=2).astype(x.dtype)
    src = [_pad_coord(c, n, padding_mode, align_corners) for c, n in zip(src, sizes)]
    base = [jnp.floor(c) for c in src]
    w1d = [[(b + 1) - c, c - b] for c, b in zip(src, base)]
    offs = list(itertools.product(range(2), repeat=nsp))
    coords = [jnp.stack([base[d] + o[d] for o in offs], axis=1).astype(jnp.int64) for d in range(nsp)]
    # corner weights multiply the x, y(, z) factors in that order, as torch
    weights = jnp.stack([math.prod(w1d[d][o[d]] for d in reversed(range(nsp))) for o in offs], axis=1)
    return _weighted_sum(_gather(flat, sizes, coords), weights[:, None], axis=2).astype(x.dtype)


@register(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def grid_sampler(x, grid, interpolation_mode, padding_mode, align_corners):
    return grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)


@register(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
def grid_sampler_backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    acc = acc_dtype(x.dtype)  # (half inputs: the gradient of the float32 computation)
    fwd = lambda v, g: grid_sample(v, g, interpolation_mode, padding_mode, align_corners, acc)  # noqa: E731
    _, vjp = jax.vjp(fwd, x.astype(acc), grid.astype(acc))
    gx, gg = vjp(grad.astype(acc))
    mask = list(output_mask) + [True] * (2 - len(output_mask))
    return (gx.astype(x.dtype) if mask[0] else None), gg.astype(grid.dtype)
