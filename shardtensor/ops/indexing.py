"""Lowerings of indexing ops: advanced indexing and index_put, gather/scatter (and their reductions),
index_select/add/copy/fill/reduce, masked_scatter, take/put, embedding and its backward.

Integer index tensors may be int64 or int32 and negative (they count from the end, as in torch).
Bool masks are normally converted to integer indices by the dispatcher; here they work only on
concrete values (their result shape depends on the data).

Example::

    lookup(aten.index.Tensor).fn(x, [None, idx])       # x[:, idx]
    lookup(aten.gather.default).fn(logp, 1, target[:, None])
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from shardtensor.ops._layout import mesh_size
from shardtensor.ops._promote import acc_dtype, scalar_type_name
from shardtensor.ops.checks import fail_where, out_of_range
from shardtensor.ops.registry import register
from shardtensor.ops.shape import wrap_dim

aten = torch.ops.aten


# ----------------------------------------------------------------------------------------- helpers


def _index_tuple(indices):
    out = []
    for i in indices:
        if i is None:
            out.append(slice(None))
        elif i.dtype == jnp.uint8:  # legacy byte masks
            out.append(i.astype(jnp.bool_))
        else:
            out.append(i)
    return tuple(out)


def _along(ndim, dim, idx):
    """An index tuple selecting ``idx`` along ``dim`` and everything along the other dims."""
    return (slice(None),) * dim + (idx,) + (slice(None),) * (ndim - dim - 1)


def _scatter_index(index, dim):
    """The full index tuple of torch's scatter/gather: ``index`` along dim, a position elsewhere."""
    nd = index.ndim
    out = []
    for d in range(nd):
        if d == dim:
            out.append(index)
        else:
            shape = [1] * nd
            shape[d] = index.shape[d]
            out.append(np.arange(index.shape[d]).reshape(shape))
    return tuple(out)


def _crop(x, shape):
    """x[:shape[0], :shape[1], ...] — torch's gather/scatter only read the index-shaped corner."""
    if tuple(x.shape) == tuple(shape):
        return x
    return x[tuple(slice(0, s) for s in shape)]


def _lowest(dtype):
    if dtype == jnp.bool_:
        return False
    return -jnp.inf if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).min


def _highest(dtype):
    if dtype == jnp.bool_:
        return True
    return jnp.inf if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).max


# torch on bool tensors: add is logical or, mul is logical and
_BOOL_MODE = {"add": "max", "mul": "min"}
_AT_METHOD = {"set": "set", "add": "add", "mul": "multiply", "max": "max", "min": "min"}


def write_at(x, where, values, how, **at_kwargs):
    """``x.at[where]`` combined with ``values`` by ``how`` 'set'/'add'/'mul'/'max'/'min' (torch's meaning
    for bool); ``at_kwargs`` go to jax's ``.at[]`` method.

    XLA (jax 0.10.2) partitions a scatter whose index dimension is sharded unevenly by padding the
    indices with a valid position and keeping the padded updates: only 'set' masks them. So the other
    scatters run on flattened indices padded here to a multiple of the mesh size with out-of-range
    (dropped) positions: every sharding of that dimension is even, and it stays sharded."""
    if x.dtype == jnp.bool_:
        how = _BOOL_MODE.get(how, how)
    values = jnp.asarray(values).astype(x.dtype)
    arrays = [k for k, w in enumerate(where) if isinstance(w, (jax.Array, np.ndarray))]
    n_dev = mesh_size(x, values, *(where[k] for k in arrays))
    if how != "set" and n_dev and arrays and not any(where[k].dtype == jnp.bool_ for k in arrays):
        where, values = _padded_scatter_args(x, where, values, arrays, n_dev)
        at_kwargs.setdefault("mode", "drop")
    return getattr(x.at[where], _AT_METHOD[how])(values, **at_kwargs)


def _padded_scatter_args(x, where, values, arrays, n_dev):
    """(where, values) with the index arrays broadcast and flattened to one dim of M positions, padded
    to a multiple of ``n_dev`` (the first index array with the out-of-range x.shape[k])."""
    batch = jnp.broadcast_shapes(*(where[k].shape for k in arrays))
    # numpy's rule: adjacent index arrays put the batch dims where they stand, separated ones in front
    adjacent = arrays == list(range(arrays[0], arrays[0] + len(arrays)))
    pos = arrays[0] if adjacent else 0
    windows = [x.shape[k] for k in range(len(where)) if k not in arrays] + list(x.shape[len(where) :])
    values = jnp.broadcast_to(values, tuple(windows[:pos]) + tuple(batch) + tuple(windows[pos:]))
    m = int(np.prod(batch, dtype=np.int64))
    pad = -m % n_dev
    values = values.reshape(tuple(windows[:pos]) + (m,) + tuple(windows[pos:]))
    if pad:
        values = jnp.pad(values, [(0, pad) if d == pos else (0, 0) for d in range(values.ndim)])
    flat = list(where)
    for j, k in enumerate(arrays):
        i = jnp.broadcast_to(where[k], batch).reshape(m)
        i = jnp.where(i < 0, i + x.shape[k], i)  # torch's negative positions, before padding with N
        flat[k] = jnp.pad(i, (0, pad), constant_values=x.shape[k] if j == 0 else 0) if pad else i
    return tuple(flat), values


def _as_nd(x):
    """Scatter/gather treat a 0-d tensor as 1-d with one element."""
    return x.reshape(1) if x.ndim == 0 else x


# torch's messages for an index out of range (``{value}``: the first offending index)
_BOUNDS = "index {{value}} is out of bounds for dimension {dim} with size {size}"
_IN_SELF = "index out of range in self"


def check_indices(x, indices):
    """torch's IndexError for advanced indexing: each integer index tensor within [-size, size) of
    the dimension it indexes (a bool mask covers as many dimensions as it has)."""
    d = 0
    for i in indices:
        if i is None:
            d += 1
        elif i.dtype in (jnp.bool_, jnp.uint8):
            d += i.ndim
        else:
            fail_where(
                out_of_range(i, x.shape[d], negative_ok=True),
                IndexError,
                _BOUNDS.format(dim=d, size=x.shape[d]),
                value=i,
            )
            d += 1


# Which exception torch's CPU kernel raises for an index out of range depends on the path it takes
# (by the rank, the dim and the index dtype; shown here for contiguous tensors): its generic loops
# raise IndexError("index out of range in self"), its vectorised paths RuntimeError with their own
# message.
_DATA_BOUNDS = "INDICES element is out of DATA bounds, id={{value}} axis_dim={size}"


def index_select_error(ndim: int, d: int):
    """(exception, message) of index_select: its dim-1 path of a 2-D+ tensor checks with TORCH_CHECK."""
    return (RuntimeError, _DATA_BOUNDS) if ndim >= 2 and d == 1 else (IndexError, _IN_SELF)


def index_add_error(ndim: int, d: int, index_dtype):
    """(exception, message) of index_add_: an int64 index into the first or last dim of a 2-D+ tensor
    takes scatter_add's path; others (a 1-D tensor, an int32 index, a middle dim) the generic loop."""
    if ndim >= 2 and index_dtype == jnp.int64 and d in (0, ndim - 1):
        return RuntimeError, _BOUNDS
    return IndexError, _IN_SELF


def check_along(x, dim, index, error, message, negative_ok=False):
    """torch's ``error`` when ``index`` leaves dimension ``dim`` of ``x`` (0-d x: one element)."""
    x1 = _as_nd(x)
    d = wrap_dim(dim, x1.ndim)
    n = x1.shape[d]
    fail_where(out_of_range(index, n, negative_ok=negative_ok), error, message.format(dim=d, size=n), value=index)


# ------------------------------------------------------------------------------ advanced indexing


@register(aten._unsafe_index.Tensor)  # indices known to be in range (decompositions'): no check
def unsafe_index(x, indices):
    return x[_index_tuple(indices)]


@register(aten.index.Tensor, checked=True)
def index(x, indices):
    check_indices(x, indices)
    return unsafe_index(x, indices)


@register(aten._unsafe_index_put.default)
def unsafe_index_put(x, indices, values, accumulate=False):
    return write_at(x, _index_tuple(indices), values, "add" if accumulate else "set")


@register(aten.index_put.default, checked=True)
def index_put(x, indices, values, accumulate=False):
    check_indices(x, indices)
    return unsafe_index_put(x, indices, values, accumulate)


@register(aten._index_put_impl.default, checked=True)
def index_put_impl(x, indices, values, accumulate=False, unsafe=False):
    return index_put(x, indices, values, accumulate)


@register(aten.index_select.default, checked=True)
def index_select(x, dim, index):
    if index.ndim > 1:
        raise IndexError("index_select(): Index is supposed to be a vector")
    check_along(x, dim, index, *index_select_error(x.ndim, wrap_dim(dim, max(x.ndim, 1))))
    if x.ndim == 0:
        return jnp.take(x.reshape(1), index.reshape(-1), axis=0).reshape(())
    d = wrap_dim(dim, x.ndim)
    return jnp.take(x, index.reshape(-1), axis=d)


def _check_flat(x, index):
    n = int(np.prod(x.shape, dtype=np.int64))
    fail_where(
        out_of_range(index, n, negative_ok=True),
        IndexError,
        f"out of range: tried to access index {{value}} on a tensor of {n} elements.",
        value=index,
    )


@register(aten.take.default, checked=True)
def take(x, index):
    _check_flat(x, index)
    return jnp.reshape(x, (-1,))[index]


@register(aten.put.default, checked=True)
def put(x, index, source, accumulate=False):
    _check_flat(x, index)
    out = write_at(jnp.reshape(x, (-1,)), (index.reshape(-1),), source.reshape(-1), "add" if accumulate else "set")
    return out.reshape(x.shape)


# --------------------------------------------------------------------------------- gather/scatter


@register(aten.gather.default, checked=True)
def gather(x, dim, index, *, sparse_grad=False):
    if index.size == 0:
        return jnp.zeros(index.shape, x.dtype)
    check_along(x, dim, index, RuntimeError, _BOUNDS)
    x1, i1 = _as_nd(x), _as_nd(index)
    d = wrap_dim(dim, x1.ndim)
    if i1.ndim != x1.ndim:
        raise RuntimeError("gather(): Index tensor must have the same number of dimensions as input tensor")
    crop = [s if k != d else x1.shape[d] for k, s in enumerate(i1.shape)]
    out = jnp.take_along_axis(_crop(x1, crop), i1, axis=d)
    return out.reshape(index.shape)


def _scatter_apply(x, dim, index, src, mode):
    """x with src (index-shaped) written at torch's scatter positions by mode 'set'/'add'/'mul'/'max'/'min'."""
    x1, i1 = _as_nd(x), _as_nd(index)
    d = wrap_dim(dim, x1.ndim)
    if i1.ndim != x1.ndim:
        raise RuntimeError("scatter(): Index tensor must have the same number of dimensions as self tensor")
    if i1.size == 0:
        return x
    src = jnp.broadcast_to(src, ()) if jnp.ndim(src) == 0 else _crop(_as_nd(src), i1.shape)
    return write_at(x1, _scatter_index(i1, d), src, mode).reshape(x.shape)


@register(aten.scatter.src, aten.scatter.value, checked=True)
def scatter(x, dim, index, src):
    check_along(x, dim, index, RuntimeError, _BOUNDS)
    return _scatter_apply(x, dim, index, src, "set")


_LEGACY_REDUCE = {"add": "add", "multiply": "mul"}


@register(aten.scatter.reduce, aten.scatter.value_reduce, checked=True)
def scatter_reduce_legacy(x, dim, index, src, *, reduce):
    if reduce not in _LEGACY_REDUCE:
        raise RuntimeError(f"reduce argument must be either add or multiply, got {reduce!r}")
    check_along(x, dim, index, RuntimeError, _BOUNDS)
    return _scatter_apply(x, dim, index, src, _LEGACY_REDUCE[reduce])


@register(aten.scatter_add.default, checked=True)
def scatter_add(x, dim, index, src):
    check_along(x, dim, index, RuntimeError, _BOUNDS)
    return _scatter_apply(x, dim, index, src, "add")


_REDUCE = {"sum": ("add", 0), "prod": ("mul", 1), "mean": ("add", 0), "amax": ("max", None), "amin": ("min", None)}


def _reduce_into(x, reduce, include_self, scatter_fn):
    """torch's scatter_reduce/index_reduce: ``scatter_fn(base, mode, values)`` writes into base."""
    if reduce not in _REDUCE:
        raise RuntimeError(f"reduce argument must be one of sum, prod, mean, amax, amin, got {reduce!r}")
    mode, ident = _REDUCE[reduce]
    if reduce == "amax":
        ident = _lowest(x.dtype)
    elif reduce == "amin":
        ident = _highest(x.dtype)
    base = x
    hit: Any = None  # per element: how many indices hit it (when needed)
    if not include_self or reduce == "mean":
        hit = scatter_fn(jnp.zeros(x.shape, jnp.int64), "add", jnp.ones((), jnp.int64))
    if not include_self:
        base = jnp.where(hit > 0, jnp.asarray(ident, x.dtype), x)
    out = scatter_fn(base, mode, None)
    if reduce == "mean":
        count = hit + (1 if include_self else 0)
        count = jnp.maximum(count, 1)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            out = (out / count.astype(x.dtype)).astype(x.dtype)
        else:
            out = jnp.floor_divide(out, count.astype(x.dtype))
    return out


@register(aten.scatter_reduce.two, checked=True)
def scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    if reduce == "mean" and x.dtype == jnp.bool_:
        raise RuntimeError("\"scatter_gather_tensor_cpu_reduce_mean\" not implemented for 'Bool'")
    check_along(x, dim, index, RuntimeError, _BOUNDS)

    def fn(base, mode, values):
        return _scatter_apply(base, dim, index, src if values is None else values, mode)

    return _reduce_into(x, reduce, include_self, fn)


# ------------------------------------------------------------------------------ index_add & co


def _source_checked(name):
    """``validate`` of index_add_ / index_reduce_ (torch's CPU checks): ``source`` shaped like ``x``
    but in ``dim``, where it has one slice per index."""

    def validate(x, dim, index, source, *args, **kwargs):
        if not isinstance(source, torch.Tensor) or source.dim() == 0:
            return
        xs, ss = tuple(x.shape) or (1,), tuple(source.shape)
        d = wrap_dim(dim, len(xs))
        if len(ss) != len(xs) or any(a != b for i, (a, b) in enumerate(zip(xs, ss)) if i != d):
            raise RuntimeError(
                "source tensor shape must match self tensor shape, excluding the specified dimension. "
                f"Got self.shape = {list(x.shape)} source.shape = {list(ss)}"
            )
        if ss[d] != index.numel():
            raise RuntimeError(
                f"{name}(): Number of indices ({index.numel()}) should be equal to source.size(dim): "
                f"({ss[d]}), for dim: {dim}"
            )

    return validate


def _long_index(x, dim, index, *args, **kwargs):
    """``validate`` of index_copy_ (torch's CPU kernel takes int64 indices only)."""
    if index.dtype != torch.int64:
        raise RuntimeError(f"index_copy_(): Expected a long tensor for index, but got {scalar_type_name(index.dtype)}")


def _int64_index(x, dim, index, *args, **kwargs):
    """``validate`` of index_fill_ (int64 indices only, an IndexError in torch)."""
    if index.dtype != torch.int64:
        raise IndexError("index_fill_(): Expected dtype int64 for index.")


def _index_dim_apply(x, dim, index, source, mode):
    """x with ``source`` written at x.select(dim, index[i]) <- source.select(dim, i), by mode."""
    x1 = _as_nd(x)
    d = wrap_dim(dim, x1.ndim)
    idx = index.reshape(-1)
    want = x1.shape[:d] + (idx.shape[0],) + x1.shape[d + 1 :]
    src = jnp.asarray(source).reshape(want if jnp.ndim(source) else ())
    return write_at(x1, _along(x1.ndim, d, idx), src, mode).reshape(x.shape)


@register(aten.index_add.default, checked=True, validate=_source_checked("index_add_"))
def index_add(x, dim, index, source, *, alpha=1):
    check_along(x, dim, index, *index_add_error(x.ndim, wrap_dim(dim, max(x.ndim, 1)), index.dtype))
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        source = source * alpha
    return _index_dim_apply(x, dim, index, source, "add")


@register(aten.index_copy.default, checked=True, validate=_long_index)
def index_copy(x, dim, index, source):
    check_along(x, dim, index, IndexError, "index_copy_(): " + _BOUNDS)
    if index.size == 1 and x.ndim > 0:
        # one position (a KV cache's decode step): an in-place slice update, which XLA keeps in the
        # buffer, where a scatter may not be (the check above has ruled out a position out of range)
        d = wrap_dim(dim, x.ndim)
        starts = [0] * x.ndim
        starts[d] = index.reshape(())
        piece = jnp.asarray(source).astype(x.dtype).reshape(x.shape[:d] + (1,) + x.shape[d + 1 :])
        return jax.lax.dynamic_update_slice(x, piece, starts)
    return _index_dim_apply(x, dim, index, source, "set")


@register(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor, checked=True, validate=_int64_index)
def index_fill(x, dim, index, value):
    check_along(x, dim, index, IndexError, _BOUNDS, negative_ok=True)
    x1 = _as_nd(x)
    d = wrap_dim(dim, x1.ndim)
    return x1.at[_along(x1.ndim, d, index.reshape(-1))].set(jnp.asarray(value).astype(x.dtype)).reshape(x.shape)


@register(aten.index_reduce.default, checked=True, validate=_source_checked("index_reduce_"))
def index_reduce(x, dim, index, source, reduce, *, include_self=True):
    if x.dtype == jnp.bool_:
        raise RuntimeError("\"index_func_\" not implemented for 'Bool'")
    check_along(x, dim, index, IndexError, _IN_SELF)

    def fn(base, mode, values):
        src = source if values is None else jnp.broadcast_to(values, ())
        return _index_dim_apply(base, dim, index, src, mode)

    return _reduce_into(x, reduce, include_self, fn)


# ---------------------------------------------------------------------------------- masked_scatter


def _bool_mask(x, mask, source):
    """``validate`` of masked_scatter (torch's CPU kernel takes bool masks only)."""
    if mask.dtype != torch.bool:
        raise RuntimeError(
            f"masked_scatter_ only supports boolean masks, but got mask with dtype {scalar_type_name(mask.dtype)}"
        )


@register(aten.masked_scatter.default, validate=_bool_mask)
def masked_scatter(x, mask, source):
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    m = jnp.broadcast_to(mask, shape).reshape(-1)
    flat_src = source.reshape(-1).astype(x.dtype)
    pos = jnp.cumsum(m.astype(jnp.int64)) - 1
    if flat_src.shape[0]:
        vals = flat_src[jnp.clip(pos, 0, max(flat_src.shape[0] - 1, 0))]
    else:
        vals = jnp.zeros_like(pos, x.dtype)
    return jnp.where(m, vals, jnp.broadcast_to(x, shape).reshape(-1)).reshape(shape)


@register(aten.masked_scatter_backward.default)
def masked_scatter_backward(grad, mask, sizes):
    n = int(np.prod(sizes))
    m = jnp.broadcast_to(mask, grad.shape).reshape(-1)
    pos = jnp.where(m, jnp.cumsum(m.astype(jnp.int64)) - 1, n)  # unmasked -> out of range -> dropped
    out = write_at(jnp.zeros((n,), grad.dtype), (pos,), grad.reshape(-1), "add", mode="drop")
    return out.reshape(tuple(sizes))


# --------------------------------------------------------------------------------------- embedding


@register(aten.embedding.default, checked=True)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if weight.ndim != 2:
        raise RuntimeError("'weight' must be 2-D")
    check_along(weight, 0, indices, IndexError, _IN_SELF)
    # (clipped, not NaN-filled: the check above raises for a bad index; the fill's select after the
    # gather ran through every residual sum of a transformer, which a TPU's XLA then recomputed in
    # the backward from the embedding up, 0.5 ms of a float32 GPT step)
    return jnp.take(weight, indices, axis=0, mode="clip")


@register(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    # Accumulated in the gradient's own dtype, as torch's CPU kernel does (its index_add_ adds bf16
    # rows to bf16 rows in index order, which XLA:CPU's scatter reproduces exactly): JAX's program for
    # a bf16 embedding, which on a TPU scatter-adds into the tied weight's gradient in place.
    idx = indices.reshape(-1)
    dim = grad.shape[-1]
    g = grad.reshape(-1, dim)
    if scale_grad_by_freq:
        acc = acc_dtype(grad.dtype)
        counts = write_at(jnp.zeros((num_weights,), acc), (idx,), 1, "add")
        g = (g.astype(acc) / counts[idx][:, None]).astype(grad.dtype)
    if padding_idx >= 0:
        g = jnp.where((idx == padding_idx)[:, None], jnp.zeros((), grad.dtype), g)
    return write_at(jnp.zeros((num_weights, dim), grad.dtype), (idx,), g, "add")


@register(aten.embedding_renorm.default)
def embedding_renorm(weight, indices, max_norm, norm_type):
    """Rows named by ``indices`` whose ``norm_type``-norm exceeds max_norm are scaled to max_norm
    (torch: scale = max_norm / (norm + 1e-7)); the functional form of ``embedding_renorm_``."""
    acc = acc_dtype(weight.dtype)
    w = weight.astype(acc)
    if norm_type == 2:
        norm = jnp.sqrt(jnp.sum(w * w, axis=1))
    elif norm_type == float("inf"):
        norm = jnp.max(jnp.abs(w), axis=1)
    elif norm_type == 1:
        norm = jnp.sum(jnp.abs(w), axis=1)
    else:
        norm = jnp.sum(jnp.abs(w) ** norm_type, axis=1) ** (1.0 / norm_type)
    used = jnp.zeros((weight.shape[0],), jnp.bool_).at[indices.reshape(-1)].set(True)
    scale = jnp.where(used & (norm > max_norm), max_norm / (norm + 1e-7), jnp.ones((), acc))
    return (w * scale[:, None]).astype(weight.dtype)


@register(aten.one_hot.default, checked=True)
def one_hot(x, num_classes=-1):
    """``F.one_hot`` with a known number of classes (the dispatcher finds it from the data otherwise)."""
    fail_where(x < 0, RuntimeError, "Class values must be non-negative.")
    fail_where(x >= num_classes, RuntimeError, "Class values must be smaller than num_classes.")
    return (x[..., None] == jnp.arange(num_classes, dtype=x.dtype)).astype(jnp.int64)


@register(aten.nonzero_static.default)
def nonzero_static(x, *, size, fill_value=-1):
    """``nonzero`` padded (with ``fill_value`` rows) or cut to ``size`` rows: a fixed shape, so no host
    round trip (unlike ``nonzero``)."""
    if x.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    idx = jnp.nonzero(x, size=size, fill_value=fill_value)
    return jnp.stack(idx, axis=1).astype(jnp.int64)
