"""Lowerings of bag and segment reductions: ``_embedding_bag`` (``F.embedding_bag``: sum / mean / max
bags given by offsets, per-sample weights, padding_idx) with its dense and per-sample-weight backward,
and ``segment_reduce`` (``torch._segment_reduce``: sum / mean / max / min / prod over segments given by
lengths or offsets) with its backward.

Both compute the segment of every element with ``searchsorted`` and reduce with scatters into a static
number of segments (``_segment``), so the shapes stay static whatever the offsets hold.

``_embedding_bag`` returns ``(output, offset2bag, bag_size, max_indices)`` shaped as torch's meta kernel
(the layout torch uses off-CPU): offset2bag has one entry per index, bag_size one per offset, and
max_indices is (bags, D) in max mode and empty otherwise. mode is 0 sum, 1 mean, 2 max.

Example::

    out, offset2bag, bag_size, max_idx = lookup(aten._embedding_bag.default).fn(w, idx, offsets, False, 1)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from shardtensor.ops._promote import acc_dtype
from shardtensor.ops.checks import fail_where, out_of_range
from shardtensor.ops.indexing import _highest, _lowest, write_at
from shardtensor.ops.registry import register

aten = torch.ops.aten

SUM, MEAN, MAX = 0, 1, 2


def _segment(how, data, ids, n):
    """``jax.ops.segment_{sum,prod,max,min}(data, ids, n)`` for how 'add'/'mul'/'max'/'min'. Through
    write_at: the elements' dimension may be sharded unevenly, where XLA's own scatter adds padding."""
    empty = {"add": 0, "mul": 1, "max": _lowest(data.dtype), "min": _highest(data.dtype)}[how]
    out = jnp.full((n,) + data.shape[1:], empty, data.dtype)
    return write_at(out, (ids,), data, how)


# ---------------------------------------------------------------------------------- embedding bag


def _bags(indices, offsets, include_last_offset):
    """(offset2bag, number of bags): the bag of every index (as torch's CPU kernel, indices past the
    last offset belong to the last bag when include_last_offset)."""
    n_bags = offsets.shape[0] - (1 if include_last_offset else 0)
    if n_bags < 0:
        raise RuntimeError("embedding_bag: include_last_offset needs at least one offset")
    pos = jnp.arange(indices.shape[0], dtype=offsets.dtype)
    bag = jnp.searchsorted(offsets, pos, side="right").astype(jnp.int64) - 1
    return jnp.clip(bag, 0, max(n_bags - 1, 0)), n_bags


def _first_max(rows, keep, bag, n_bags, positions):
    """Per bag and feature, torch's CPU fold ``if first or x > cur: cur = x``: (max, position of the
    first max). NaNs are skipped, unless the bag starts with one, which then sticks."""
    low = jnp.asarray(-jnp.inf, rows.dtype)
    big = jnp.iinfo(jnp.int64).max
    nan = jnp.isnan(rows)
    ok = keep[:, None] & ~nan
    top = _segment("max", jnp.where(ok, rows, low), bag, n_bags)
    hit = ok & (rows == top[bag])
    first = _segment("min", jnp.where(hit, positions[:, None], big), bag, n_bags)
    start = _segment("min", jnp.where(keep, positions, big), bag, n_bags)  # the bag's first element
    starts_nan = jnp.take_along_axis(nan, jnp.clip(start, 0, rows.shape[0] - 1)[:, None], axis=0)
    starts_nan = starts_nan & (start < big)[:, None]
    # (a bag of NaNs only: its first element)
    first = jnp.where(starts_nan | (first == big), start[:, None], first)
    return jnp.where(starts_nan, jnp.asarray(jnp.nan, rows.dtype), top), first


def embedding_bag(
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=SUM,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    if indices.ndim != 1 or offsets.ndim != 1:
        raise ValueError(f"embedding_bag: expected 1-D indices and offsets, got {indices.ndim}-D and {offsets.ndim}-D")
    if per_sample_weights is not None and mode != SUM:
        raise NotImplementedError(
            "embedding_bag: per_sample_weights was not None. per_sample_weights is only supported for mode='sum'"
        )
    n = weight.shape[0]
    fail_where(
        out_of_range(indices, n, negative_ok=False),
        RuntimeError,
        f"Index {{position}} of input takes value {{value}} which is not in the valid range [0, {n})",
        value=indices,
    )
    acc = acc_dtype(weight.dtype)
    bag, n_bags = _bags(indices, offsets, include_last_offset)
    keep = indices != padding_idx if padding_idx >= 0 else jnp.ones(indices.shape, bool)
    counts = _segment("add", keep.astype(jnp.int64), bag, n_bags)
    bag_size = jnp.zeros(offsets.shape, jnp.int64).at[:n_bags].set(counts)
    rows = jnp.take(weight, indices, axis=0).astype(acc)
    d = weight.shape[1]
    if mode == MAX:
        if indices.shape[0] == 0:  # every bag is empty
            return (jnp.zeros((n_bags, d), weight.dtype), bag, bag_size, jnp.zeros((n_bags, d), indices.dtype))
        val, first = _first_max(rows, keep, bag, n_bags, jnp.arange(indices.shape[0]))
        nonempty = (counts > 0)[:, None]
        out = jnp.where(nonempty, val, jnp.zeros((), acc))
        max_idx = jnp.where(nonempty, indices[jnp.clip(first, 0, indices.shape[0] - 1)], 0)
        return out.astype(weight.dtype), bag, bag_size, max_idx.astype(indices.dtype)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.astype(acc)[:, None]
    out = _segment("add", jnp.where(keep[:, None], rows, jnp.zeros((), acc)), bag, n_bags)
    if mode == MEAN:
        out = out / jnp.maximum(counts, 1).astype(acc)[:, None]
    elif mode != SUM:
        raise ValueError(f"embedding_bag: unknown mode {mode}")
    return out.astype(weight.dtype), bag, bag_size, jnp.zeros((0,), indices.dtype)


register(aten._embedding_bag.default, aten._embedding_bag_forward_only.default, checked=True)(embedding_bag)


@register(aten._embedding_bag_dense_backward.default)
def embedding_bag_dense_backward(
    grad,
    indices,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    per_sample_weights=None,
    padding_idx=-1,
):
    acc = acc_dtype(grad.dtype)
    g = grad.astype(acc)
    n = int(num_weights)
    if mode == MAX:
        # each (bag, feature) sends its gradient to the row that held the maximum
        valid = (bag_size[: g.shape[0]] > 0)[:, None]
        rows = jnp.where(valid, maximum_indices, 0)
        cols = jnp.broadcast_to(jnp.arange(g.shape[1]), rows.shape)
        out = write_at(jnp.zeros((n, g.shape[1]), acc), (rows, cols), jnp.where(valid, g, jnp.zeros((), acc)), "add")
    else:
        contrib = jnp.take(g, offset2bag, axis=0)
        if mode == MEAN:
            contrib = contrib / jnp.maximum(jnp.take(bag_size, offset2bag), 1).astype(acc)[:, None]
        if per_sample_weights is not None:
            contrib = contrib * per_sample_weights.astype(acc)[:, None]
        if scale_grad_by_freq:
            freq = write_at(jnp.zeros((n,), acc), (indices,), 1, "add")
            contrib = contrib / freq[indices][:, None]
        if padding_idx >= 0:
            contrib = jnp.where((indices != padding_idx)[:, None], contrib, jnp.zeros((), acc))
        out = write_at(jnp.zeros((n, g.shape[1]), acc), (indices,), contrib, "add")
    if padding_idx >= 0:
        out = out.at[padding_idx].set(0)
    return out.astype(grad.dtype)


@register(aten._embedding_bag_backward.default)
def embedding_bag_backward(
    grad,
    indices,
    offsets,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    sparse,
    per_sample_weights=None,
    padding_idx=-1,
):
    if sparse:
        raise NotImplementedError(
            "shardtensor: embedding_bag(sparse=True) has no sparse gradient here; use sparse=False"
        )
    return embedding_bag_dense_backward(
        grad,
        indices,
        offset2bag,
        bag_size,
        maximum_indices,
        num_weights,
        scale_grad_by_freq,
        mode,
        per_sample_weights,
        padding_idx,
    )


@register(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    if mode != SUM:
        raise NotImplementedError("embedding_bag_backward: per_sample_weights only supported for mode='sum'")
    acc = acc_dtype(grad.dtype)
    rows = jnp.take(weight, indices, axis=0).astype(acc)
    out = jnp.sum(jnp.take(grad, offset2bag, axis=0).astype(acc) * rows, axis=1)
    if padding_idx >= 0:
        out = jnp.where(indices != padding_idx, out, jnp.zeros((), acc))
    return out.astype(grad.dtype)


# --------------------------------------------------------------------------------- segment reduce


def _segments(data, lengths, offsets, axis):
    """(data moved to (outer, N, *inner), segment id per (outer, N) — or S where past the last
    segment —, lengths (outer, S))."""
    if lengths is None:
        if offsets is None:
            raise RuntimeError("segment_reduce: either lengths or offsets must be defined")
        lengths = offsets[..., 1:] - offsets[..., :-1]
    axis = axis % data.ndim
    if lengths.ndim != axis + 1:
        raise RuntimeError(f"segment_reduce: expected lengths of {axis + 1} dims for axis {axis}, got {lengths.ndim}")
    outer = int(np.prod(data.shape[:axis], dtype=np.int64))
    x = data.reshape((outer,) + data.shape[axis:])
    lengths = lengths.reshape(outer, -1).astype(jnp.int64)
    ends = jnp.cumsum(lengths, axis=1)
    pos = jnp.arange(x.shape[1], dtype=jnp.int64)
    seg = jax.vmap(lambda e: jnp.searchsorted(e, pos, side="right"))(ends)
    return x, seg, lengths


def _flat_ids(seg, s):
    """Segment ids over (outer * (S + 1)) segments: the extra one per row collects ignored elements."""
    return (seg + jnp.arange(seg.shape[0])[:, None] * (s + 1)).reshape(-1)


@register(aten.segment_reduce.default)
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    if indices is not None:
        raise NotImplementedError("segment_reduce(): indices based reduction is not supported yet.")
    x, seg, lens = _segments(data, lengths, offsets, axis)
    outer, s = lens.shape
    inner = x.shape[2:]
    acc = acc_dtype(data.dtype)
    flat = x.astype(acc).reshape((-1,) + inner)
    ids = _flat_ids(seg, s)
    nseg = outer * (s + 1)
    init = None if initial is None else jnp.asarray(initial, acc)
    nan = _segment("max", jnp.isnan(flat).astype(jnp.int32), ids, nseg) > 0
    if reduce in ("sum", "mean"):
        out = _segment("add", flat, ids, nseg)
        out = out if init is None else init + out
    elif reduce == "prod":
        out = _segment("mul", flat, ids, nseg)
        out = out if init is None else init * out
    elif reduce in ("max", "min"):
        how, pick, fill = ("max", jnp.maximum, -jnp.inf) if reduce == "max" else ("min", jnp.minimum, jnp.inf)
        out = _segment(how, jnp.where(jnp.isnan(flat), jnp.asarray(fill, acc), flat), ids, nseg)
        out = out if init is None else pick(init, out)
        out = jnp.where(nan, jnp.asarray(jnp.nan, acc), out)  # a NaN in the segment wins
    else:
        raise RuntimeError(f"unsupported reduction given! {reduce}")
    out = out.reshape((outer, s + 1) + inner)[:, :s]
    if reduce == "mean":
        n = lens.reshape((outer, s) + (1,) * len(inner)).astype(acc)
        empty = jnp.asarray(jnp.nan, acc) if init is None else out
        out = jnp.where(n > 0, out / jnp.maximum(n, 1), empty)
    return out.reshape(data.shape[: axis % data.ndim] + (s,) + inner).astype(data.dtype)


@register(aten._segment_reduce_backward.default)
def segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0, initial=None):
    x, seg, lens = _segments(data, lengths, offsets, axis)
    outer, s = lens.shape
    inner = x.shape[2:]
    acc = acc_dtype(data.dtype)
    pad = [(0, 0), (0, 1)] + [(0, 0)] * len(inner)  # segment S (past the end) reads 0

    def per_element(v):  # (outer, S, *inner) -> (outer, N, *inner): each element's segment value
        v = jnp.pad(v.reshape((outer, s) + inner).astype(acc), pad)
        return jnp.take_along_axis(v, seg.reshape(seg.shape + (1,) * len(inner)), axis=1)

    ids, nseg = _flat_ids(seg, s), outer * (s + 1)
    xv = x.astype(acc)
    g, out = per_element(grad), per_element(output)
    live = (seg < s).reshape(seg.shape + (1,) * len(inner))
    zero = jnp.zeros((), acc)
    if reduce in ("max", "min"):
        hit = live & (jnp.isnan(xv) | (xv == out))
        counter = per_element(
            _segment("add", hit.reshape((-1,) + inner).astype(acc), ids, nseg).reshape((outer, s + 1) + inner)[:, :s]
        )
        gi = jnp.where(hit, g, zero)
        # torch averages over tied extrema, but only the positive gradients
        gi = jnp.where((counter >= 2) & (gi > 0), gi / jnp.maximum(counter, 1), gi)
    elif reduce == "mean":
        n = per_element(lens.reshape((outer, s) + (1,) * len(inner)) * jnp.ones(inner, jnp.int64))
        gi = jnp.where(live, g / jnp.maximum(n, 1), zero)
    elif reduce == "sum":
        gi = jnp.where(live, g, zero)
    elif reduce == "prod":
        flat = xv.reshape((-1,) + inner)
        is_zero, is_nan = flat == 0, jnp.isnan(flat)
        regular = _segment("mul", jnp.where(is_zero | is_nan, jnp.ones((), acc), flat), ids, nseg)
        if initial is not None:
            regular = regular * jnp.asarray(initial, acc)
        n_zero = _segment("add", is_zero.astype(jnp.int64), ids, nseg)
        n_nan = _segment("add", is_nan.astype(jnp.int64), ids, nseg)
        unflat = lambda v: per_element(v.reshape((outer, s + 1) + inner)[:, :s])  # noqa: E731
        regular, n_zero, n_nan = unflat(regular), unflat(n_zero), unflat(n_nan)
        special = (xv == 0) | jnp.isnan(xv)
        # the product of the other elements, for a zero or NaN element (torch computes it explicitly)
        others_nan = n_nan - jnp.isnan(xv) > 0
        others_zero = n_zero - (xv == 0) > 0
        excl = jnp.where(others_nan, jnp.asarray(jnp.nan, acc), jnp.where(others_zero, zero, regular))
        gi = jnp.where(special, g * excl, g * out / jnp.where(special, jnp.ones((), acc), xv))
        gi = jnp.where(live, gi, zero)
    else:
        raise RuntimeError(f"unsupported reduction given! {reduce}")
    return gi.reshape(data.shape).astype(data.dtype)
