"""Histograms: histc, histogram (bin count or bin edges), histogramdd — torch's CPU kernel, reproduced.

An element outside [first edge, last edge], or NaN, is skipped; the last bin includes its right edge.
With a bin count the edges are ``linspace(left, right, bins + 1)``, bit for bit as torch's, over the
given range or the data's (none: [0, 1]; equal ends widened by 1 each side for histc, 0.5 for
histogram), and an element's bin is ``trunc((x - left) * bins / (right - left))`` in the input dtype;
histc stops there, histogram / histogramdd then correct it against the neighbouring edges so that the
counts agree with the returned edges. Explicit edges are searched by bisection (``std::upper_bound``).
Counts and densities are in the input dtype.

A range taken from the data cannot be checked inside a compiled graph: where torch raises for a NaN
or infinite data range, the edges here are NaN and nothing is counted. torch has no meta kernels for
histogram and histogramdd; this module registers shape-only ones (the output shapes are static).

Example::

    lookup(aten.histc.default).fn(jnp.array([1.0, 2.0, 1.0]), 4, 0, 4)   # [0., 2., 1., 0.]
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from shardtensor.ops._promote import FLOAT64, INT64, cast, dtype_of, is_float
from shardtensor.ops.registry import register
from shardtensor.ops.sorting import binary_search, left_of_lower_bound, left_of_upper_bound

aten = torch.ops.aten


# ----------------------------------------------------------------------------------------------
# edges and bins
# ----------------------------------------------------------------------------------------------
def _check_float(x, name):
    dt = dtype_of(x)
    if not is_float(dt):
        raise NotImplementedError(f"\"{name}\" not implemented for '{dt}'")
    return dt


def _check_range_dtype(x, rng):
    # torch finds a range from the data for float32 / float64 only
    if rng is None and x.size > 0 and dtype_of(x) not in (np.dtype(np.float32), FLOAT64):
        raise NotImplementedError(f"\"histogramdd\" not implemented for '{dtype_of(x)}'")


def _outer_edges(x2, rng, widen):
    """(left, right) float64 arrays of shape (N,): ``rng`` if given, else the data's min and max per
    column (0 and 1 for no data); equal ends are widened by ``widen`` each side."""
    n = x2.shape[1]
    if rng is not None:
        left = jnp.asarray([rng[2 * d] for d in range(n)], FLOAT64)
        right = jnp.asarray([rng[2 * d + 1] for d in range(n)], FLOAT64)
    elif x2.shape[0] > 0:
        left, right = cast(jnp.min(x2, axis=0), FLOAT64), cast(jnp.max(x2, axis=0), FLOAT64)
    else:
        left, right = jnp.zeros((n,), FLOAT64), jnp.ones((n,), FLOAT64)
    same = left == right
    return jnp.where(same, left - widen, left), jnp.where(same, right + widen, right)


def exact_div(a, b):
    """a / b, rounded as IEEE division. XLA rewrites ``x / broadcast(y)`` as ``x * broadcast(1 / y)``
    (and ``x * c / y`` as ``x * (c / y)``), which moves results by an ulp; a divisor that is already
    full-shaped behind an optimization barrier is divided by as written."""
    b = lax.optimization_barrier(jnp.broadcast_to(b, jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))))
    return a / b


def _fma64(a, b, c):
    """a * b + c for float64 values, rounded once (as a hardware fma), without an fma instruction:
    the exact product as p + err (Veltkamp / Dekker), then the sum with its rounding error kept."""
    p = a * b
    split = 134217729.0  # 2**27 + 1
    ta, tb = split * a, split * b
    ah, bh = ta - (ta - a), tb - (tb - b)
    al, bl = a - ah, b - bh
    err = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    s = p + c
    v = s - p
    return s + (((p - (s - v)) + (c - v)) + err)


def exact_linspace(start, end, steps, dt):
    """torch's CPU ``linspace`` bit for bit on an fma-capable CPU (AVX2 / AVX-512 kernels): the step is
    ``(end - start) / (steps - 1)`` in ``dt``, the first half ``start + step * i`` and the second half
    ``end - step * (steps - 1 - i)``, each a fused multiply-add. (The bin edges must be exact: an
    element on an edge is counted in the bin the edges say.)"""
    dt = np.dtype(dt)
    s, e = cast(start, dt), cast(end, dt)
    if steps == 1:
        return jnp.reshape(s, (1,))
    if dt not in (np.dtype(np.float32), FLOAT64):
        return _linspace_low(s, e, steps, dt)
    step = exact_div(e - s, jnp.asarray(steps - 1, dt))
    i = jnp.arange(steps, dtype=FLOAT64)
    s64, e64, step64 = cast(s, FLOAT64), cast(e, FLOAT64), cast(step, FLOAT64)
    if dt == FLOAT64:
        lo, hi = _fma64(step64, i, s64), _fma64(-step64, (steps - 1) - i, e64)
    else:  # float32: the product of two float32 values is exact in float64, the sum rounds once there
        lo, hi = s64 + step64 * i, e64 - step64 * ((steps - 1) - i)
    return cast(jnp.where(i < steps // 2, lo, hi), dt)


def _linspace_low(s, e, steps, dt):
    """linspace in float16 / bfloat16: torch's c10::Half / BFloat16 arithmetic rounds after every
    operation (computed in float32), and the integer factors are converted to ``dt`` first."""
    f32 = np.dtype(np.float32)

    def rnd(v):
        return cast(cast(v, dt), f32)

    i = jnp.arange(steps, dtype=f32)
    step = rnd(exact_div(rnd(cast(e, f32) - cast(s, f32)), rnd(jnp.asarray(steps - 1, f32))))
    lo = cast(s, f32) + rnd(step * rnd(i))
    hi = cast(e, f32) - rnd(step * rnd((steps - 1) - i))
    return cast(jnp.where(i < steps // 2, lo, hi), dt)


def _linear_edges(left, right, bins, dt):
    return [exact_linspace(left[d], right[d], int(b) + 1, dt) for d, b in enumerate(bins)]


def _bin_positions(col, edges, how):
    """(bin of each element of ``col``, whether it is counted) against ``edges`` of one dimension.
    ``how``: 'linear' (histc), 'local' (linear, then checked against the neighbour edges) or 'search'."""
    n_edges = edges.shape[0]
    lo, hi = edges[0], edges[-1]
    inside = (col >= lo) & (col <= hi)  # False for NaN
    if how == "search":
        pos = binary_search(edges, col, left_of_upper_bound) - 1
    else:
        guess = exact_div((col - lo) * jnp.asarray(n_edges - 1, col.dtype), hi - lo)
        pos = jnp.trunc(jnp.where(inside, guess, 0)).astype(INT64)
        if how == "local":
            start = jnp.maximum(pos - 1, 0)
            end = jnp.minimum(pos + 2, n_edges)
            pos = binary_search(edges, col, left_of_upper_bound, start=start, end=end, width=3) - 1
    pos = jnp.where(pos == n_edges - 1, pos - 1, pos)  # the last bin includes its right edge
    return pos, inside


def _count(x2, edges, weight, density, how):
    """The histogram of the rows of ``x2`` (M, N) over the N edge sequences, shaped by the bins."""
    dt = dtype_of(x2)
    edges = lax.optimization_barrier(list(edges))  # (not constant-folded and simplified with what follows)
    shape = tuple(e.shape[0] - 1 for e in edges)
    total = math.prod(shape)
    flat = jnp.zeros(x2.shape[:1], INT64)
    keep = jnp.ones(x2.shape[:1], bool)
    for d, e in enumerate(edges):
        pos, inside = _bin_positions(x2[:, d], e, how)
        flat = flat * shape[d] + pos
        keep = keep & inside
    w = jnp.ones(x2.shape[:1], dt) if weight is None else cast(jnp.ravel(weight), dt)
    hist = _sum_by_bin(jnp.where(keep, flat, total), w, total).reshape(shape)  # skipped: bin `total`
    if density:
        hist = exact_div(hist, jnp.sum(hist))
        for d, e in enumerate(edges):
            hist = exact_div(hist, jnp.diff(e).reshape(tuple(-1 if i == d else 1 for i in range(len(shape)))))
    return hist


def _sum_by_bin(idx, w, total):
    """For each bin b < total, the sum of the ``w`` whose ``idx`` is b. Sort-based, not a scatter-add:
    XLA (jax 0.10.2) partitions a scatter whose updates are sharded unevenly (shardtensor's padded
    layout) by padding its indices with 0, so the padding would be counted in bin 0."""
    if idx.shape[0] == 0:
        return jnp.zeros((total,), w.dtype)
    idx, w = lax.sort((idx, w), num_keys=1)
    new_bin = jnp.concatenate([jnp.ones((1,), bool), idx[1:] != idx[:-1]])

    def segmented_sum(a, b):  # running sum that restarts where a bin starts
        (va, fa), (vb, fb) = a, b
        return jnp.where(fb, vb, va + vb), fa | fb

    running, _ = lax.associative_scan(segmented_sum, (w, new_bin))
    bins = jnp.arange(total + 1, dtype=INT64)
    bounds = binary_search(idx, bins, left_of_lower_bound)  # where each bin's run starts
    start, end = bounds[:-1], bounds[1:]
    return jnp.where(end > start, jnp.take(running, end - 1, mode="clip"), jnp.zeros((), w.dtype))


def _rows(self):
    """``self`` as (M, N) rows of N-dimensional points (histogramdd's layout)."""
    n = self.shape[-1]
    return jnp.reshape(self, (-1, n))


# ----------------------------------------------------------------------------------------------
# lowerings
# ----------------------------------------------------------------------------------------------
@register(aten.histc.default, static_scalars=True)
def histc(self, bins=100, min=0, max=0):
    if jnp.issubdtype(self.dtype, jnp.integer):
        # integer input: torch's CUDA kernel counts it (its CPU kernel refuses), and transformers' MoE
        # layers rely on that on any non-CPU device; counted here on float64 values, counts in its dtype
        return histc(self.astype(FLOAT64), bins, min, max).astype(self.dtype)
    dt = _check_float(self, "histogram_cpu")
    x2 = jnp.reshape(self, (-1, 1))
    rng = None if (min == max and x2.shape[0] > 0) else (float(min), float(max))
    if rng is not None and not all(math.isfinite(v) for v in rng):
        raise RuntimeError(f"torch.histc: range of [{rng[0]:g}, {rng[1]:g}] is not finite")
    left, right = _outer_edges(x2, rng, 1.0)
    edges = _linear_edges(left, right, [bins], dt)
    return _count(x2, edges, None, False, "linear")


@register(aten.histogram.bin_ct)
def histogram_bin_ct(self, bins=100, *, range=None, weight=None, density=False):
    dt = _check_float(self, "histogramdd")
    _check_range_dtype(self, range)
    x2 = jnp.reshape(self, (-1, 1))
    left, right = _outer_edges(x2, range, 0.5)
    edges = _linear_edges(left, right, [bins], dt)
    return _count(x2, edges, weight, density, "local"), edges[0]


@register(aten.histogram.bins_tensor)
def histogram_bins_tensor(self, bins, *, weight=None, density=False):
    _check_float(self, "histogram_cpu")
    x2 = jnp.reshape(self, (-1, 1))
    return _count(x2, [bins], weight, density, "search"), jnp.copy(bins)


@register(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(self, bins, *, range=None, weight=None, density=False):
    dt = _check_float(self, "histogramdd")
    _check_range_dtype(self, range)
    left, right = _outer_edges(_rows(self), range, 0.5)
    return _linear_edges(left, right, bins, dt)


@register(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(self, bins, *, range=None, weight=None, density=False):
    edges = histogramdd_bin_edges(self, bins, range=range)
    return _count(_rows(self), edges, weight, density, "local")


@register(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(self, bins, *, weight=None, density=False):
    _check_float(self, "histogram_cpu")
    return _count(_rows(self), list(bins), weight, density, "search")


# ----------------------------------------------------------------------------------------------
# meta kernels (torch has none for these ops; the dispatcher takes output shapes from meta kernels)
# ----------------------------------------------------------------------------------------------
def _check_inputs(self, n_bins_list, weight, rng=None, bins_tensors=None):
    """torch's own argument checks (histogramdd_check_inputs, select_outer_bin_edges, prepare_out)."""
    if self.dim() < 2:
        raise RuntimeError("torch.histogramdd: input tensor should have at least 2 dimensions")
    n = self.shape[-1]
    if len(n_bins_list) != n:
        raise RuntimeError("histogramdd: The size of bins must be equal to the innermost dimension of the input.")
    for d, b in enumerate(n_bins_list):
        if b <= 0:
            raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {b} for dimension {d}")
    for d, e in enumerate(bins_tensors or ()):
        if e.dtype != self.dtype:
            raise RuntimeError(
                "torch.histogramdd: input tensor and bins tensors should have the same dtype, but "
                f"got input with dtype {self.dtype} and bins for dimension {d} with dtype {e.dtype}"
            )
        if e.dim() != 1:
            raise RuntimeError(
                "torch.histogramdd: bins tensor should have one dimension, but got "
                f"{e.dim()} dimensions in the bins tensor for dimension {d}"
            )
    if weight is not None:
        if weight.dtype != self.dtype:
            raise RuntimeError(
                "torch.histogramdd: if weight tensor is provided, input tensor and weight tensor "
                f"should have the same dtype, but got input({self.dtype}), and weight({weight.dtype})"
            )
        if tuple(weight.shape) != tuple(self.shape[:-1]):
            raise RuntimeError(
                "torch.histogramdd: if weight tensor is provided it should have the same shape as "
                "the input tensor excluding its innermost dimension, but got input with shape "
                f"{list(self.shape)} and weight with shape {list(weight.shape)}"
            )
    if rng is not None:
        if len(rng) != 2 * n:
            raise RuntimeError(
                f"torch.histogramdd: for a {n}-dimensional histogram range should have {2 * n} "
                f"elements, but got {len(rng)}"
            )
        for d in range(n):
            lo, hi = rng[2 * d], rng[2 * d + 1]
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise RuntimeError(f"torch.histogramdd: dimension {d}'s range [{lo:g}, {hi:g}] is not finite")
            if lo > hi:
                raise RuntimeError(
                    f"torch.histogramdd: min should not exceed max, but got min {lo:g} max {hi:g} for dimension {d}"
                )
    if not self.dtype.is_floating_point:
        raise NotImplementedError(f"\"histogramdd\" not implemented for '{self.dtype}'")


def _as_points(self, weight):
    """histogram's 1-D view of its arguments as histogramdd's: (numel, 1) points, (numel,) weights."""
    pts = self.reshape(-1, 1)
    if weight is not None and weight.numel() == self.numel():
        weight = weight.reshape(-1)
    return pts, weight


def _meta_histogram_bin_ct(self, bins=100, *, range=None, weight=None, density=False):
    pts, w = _as_points(self, weight)
    _check_inputs(pts, [bins], w, range)
    return self.new_empty((bins,)), self.new_empty((bins + 1,))


def _meta_histogram_bins_tensor(self, bins, *, weight=None, density=False):
    pts, w = _as_points(self, weight)
    _check_inputs(pts, [bins.numel() - 1], w, bins_tensors=[bins])
    return self.new_empty((bins.numel() - 1,)), bins.new_empty(bins.shape)


def _meta_histogramdd_bin_edges(self, bins, *, range=None, weight=None, density=False):
    _check_inputs(self, list(bins), weight, range)
    return [self.new_empty((b + 1,)) for b in bins]


def _meta_histogramdd_from_bin_cts(self, bins, *, range=None, weight=None, density=False):
    _check_inputs(self, list(bins), weight, range)
    return self.new_empty(tuple(bins))


def _meta_histogramdd_from_bin_tensors(self, bins, *, weight=None, density=False):
    _check_inputs(self, [b.numel() - 1 for b in bins], weight, bins_tensors=list(bins))
    return self.new_empty(tuple(b.numel() - 1 for b in bins))


_META_LIB = torch.library.Library("aten", "IMPL")
for _name, _fn in (
    ("histogram.bin_ct", _meta_histogram_bin_ct),
    ("histogram.bins_tensor", _meta_histogram_bins_tensor),
    ("_histogramdd_bin_edges", _meta_histogramdd_bin_edges),
    ("_histogramdd_from_bin_cts", _meta_histogramdd_from_bin_cts),
    ("_histogramdd_from_bin_tensors", _meta_histogramdd_from_bin_tensors),
):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_name}", "Meta"):  # a later torch may have one
        _META_LIB.impl(_name, _fn, "Meta")
