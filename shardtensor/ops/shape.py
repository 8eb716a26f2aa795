"""Lowerings of view and shape ops (view, permute, slice, cat, pad, ...) and of the ``*_scatter`` ops
the dispatcher uses to write through views.

Every lowering works on logical values: a view op returns the values the view would show, and its
``*_scatter`` inverse returns the base with the view's values replaced. ``as_strided`` assumes a
contiguous base (the values of ``self`` in row-major order are its storage).

Example::

    lookup(aten.slice.Tensor).fn(x, 1, -3, None, 2)   # x[:, -3::2]
"""

from __future__ import annotations

import contextlib
import math
import weakref

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from shardtensor import runtime as rt
from shardtensor.dtypes import to_jax, to_torch
from shardtensor.ops._traced import recall, remember
from shardtensor.ops.registry import register

aten = torch.ops.aten

_MAX = 2**63 - 1


# ----------------------------------------------------------------------------------------- helpers


def wrap_dim(dim: int, ndim: int) -> int:
    """A dim in [-ndim, ndim) (0-d tensors accept 0 and -1) as a non-negative axis; IndexError if not."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return dim % n


def _copy_variant(name: str, overload: str = "default"):
    """The ``*_copy`` twin of a view op (used by functionalized graphs), or None if torch lacks it."""
    packet = getattr(aten, name + "_copy", None)
    return getattr(packet, overload, None) if packet is not None else None


def _with_copy(*ops):
    """ops plus the existing ``*_copy`` variants of each (view ops return the same values)."""
    out = list(ops)
    for op in ops:
        name, overload = op._schema.name.split("::")[1], op._overloadname
        twin = _copy_variant(name, overload)
        if twin is not None:
            out.append(twin)
    return out


def infer_size(size, numel: int) -> tuple:
    """torch's view/reshape size with at most one -1, checked against numel."""
    size = list(size)
    neg = [i for i, s in enumerate(size) if s == -1]
    if len(neg) > 1:
        raise RuntimeError("only one dimension can be inferred")
    known = math.prod(s for s in size if s != -1)
    if neg:
        if known == 0 or numel % known:
            raise RuntimeError(f"shape '{list(size)}' is invalid for input of size {numel}")
        size[neg[0]] = numel // known
    elif known != numel:
        raise RuntimeError(f"shape '{list(size)}' is invalid for input of size {numel}")
    return tuple(size)


def slice_bounds(length: int, start, end, step: int):
    """torch's clamping of slice start/end (None, negative, out of range) for a dim of ``length``."""
    if step <= 0:
        raise ValueError("slice step must be positive")
    start = 0 if start is None else start
    end = _MAX if end is None else end
    if start < 0:
        start += length
    if end < 0:
        end += length
    start = min(max(start, 0), length)
    end = min(max(end, start), length)
    return start, end


def _index_at(ndim: int, dim: int, idx):
    return (slice(None),) * dim + (idx,)


def promote(tensors):
    """The torch result dtype of a list of tensors (cat/stack promote their inputs)."""
    dt = to_torch(tensors[0].dtype)
    for t in tensors[1:]:
        dt = torch.promote_types(dt, to_torch(t.dtype))
    return to_jax(dt)


# ---------------------------------------------------------------------------------------- views


@register(*_with_copy(aten.view.default, aten._unsafe_view.default), aten._reshape_alias.default)
def view(x, size, stride=None):
    out = jnp.reshape(x, infer_size(size, x.size))
    if x.ndim > 2 and out.ndim == 2 and out.shape[1] == x.shape[-1] and _unflattened_products():
        # torch flattens a Linear layer's (batch, tokens, features) to rows for its products and
        # sums: those read ``x`` itself (``rows_source``), as JAX's do, so that XLA never needs the
        # rows merged in memory (on a TPU, two layout copies of each attention gradient piece)
        remember(out, "rows_of", x)
    return out


def _unflattened_products() -> bool:
    """Whether products read the values torch flattened into rows (``view``): not on a CPU, whose XLA
    transposes more for the 3-D products (JAX's CPU program does too)."""
    return rt.platform() != "cpu"


def rows_source(x):
    """The value of 3 or more dims whose leading dims the 2-D ``x`` merges (a view of it made in the
    trace being lowered), else None."""
    return recall(x, "rows_of")


@register(*_with_copy(aten.view.dtype))
def view_dtype(x, dtype):
    new = to_jax(dtype)
    old = x.dtype
    if new == old:
        return x
    # jax bitcasts neither bool nor to bool: go through uint8 (same width)
    if old == jnp.bool_:
        x = x.astype(jnp.uint8)
    target = jnp.uint8 if new == jnp.bool_ else new
    a, b = np.dtype(x.dtype).itemsize, np.dtype(target).itemsize
    if a == b:
        out = lax.bitcast_convert_type(x, target)
    elif a > b:  # each element becomes a//b elements of the last dim
        if x.ndim == 0:
            raise RuntimeError("self.dim() cannot be 0 to view a tensor as a smaller element size")
        out = lax.bitcast_convert_type(x, target)
        out = out.reshape(x.shape[:-1] + (x.shape[-1] * (a // b),))
    else:
        r = b // a
        if x.ndim == 0 or x.shape[-1] % r:
            raise RuntimeError(f"the last dimension of self must be divisible by {r} to view as {dtype}")
        out = lax.bitcast_convert_type(x.reshape(x.shape[:-1] + (x.shape[-1] // r, r)), target)
    return out.astype(jnp.bool_) if new == jnp.bool_ else out


@register(*_with_copy(aten.alias.default, aten.detach.default))
def alias(x):
    return x


# 2-D transposes made by t()/transpose() in the trace being recorded: id(view) -> (view, source),
# both weakly held. The matmul lowerings contract the source directly instead of its transpose, and
# t(t(w)) is w itself. That is what keeps a Linear layer's weight gathered once under FSDP: torch
# runs ``addmm(b, x, t(w))`` forward and ``mm(grad, t(t(w)))`` backward, and XLA partitions the
# first as a gather of transpose(w) and the second (transposes folded) as a gather of w — the same
# bytes twice. With the transpose folded into the forward dot, both dots read w and the two
# all-gathers are one (as in JAX, whose backward reuses the forward's transposed operand).
_TRANSPOSED: dict = {}


def transposed_source(x):
    """The value ``x`` is the 2-D transpose of (made by t()/transpose() in this trace), else None."""
    entry = _TRANSPOSED.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry[1]()


def _transpose_2d(x):
    src = transposed_source(x)
    if src is not None:  # t(t(w)) is w: no transpose pair for XLA to fold after partitioning
        return src
    out = x.T
    key = id(out)

    def forget(_ref, k=key, memo=_TRANSPOSED):
        memo.pop(k, None)

    with contextlib.suppress(TypeError):  # a value that takes no weak reference: simply not folded
        _TRANSPOSED[key] = (weakref.ref(out, forget), weakref.ref(x))
    return out


@register(*_with_copy(aten.t.default))
def t(x):
    if x.ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {x.ndim}D")
    return _transpose_2d(x) if x.ndim == 2 else x


@register(*_with_copy(aten.transpose.int))
def transpose(x, dim0, dim1):
    if x.ndim == 0:
        wrap_dim(dim0, 0), wrap_dim(dim1, 0)
        return x
    dim0, dim1 = wrap_dim(dim0, x.ndim), wrap_dim(dim1, x.ndim)
    if x.ndim == 2 and dim0 != dim1:
        return _transpose_2d(x)
    return jnp.swapaxes(x, dim0, dim1)


@register(*_with_copy(aten.permute.default))
def permute(x, dims):
    dims = [wrap_dim(d, x.ndim) for d in dims]
    if sorted(dims) != list(range(x.ndim)):
        raise RuntimeError(f"permute(): dims {dims} are not a permutation of {x.ndim} dims")
    return jnp.transpose(x, dims) if x.ndim else x


@register(*_with_copy(aten.expand.default))
def expand(x, size, *, implicit=False):
    size = list(size)
    lead = len(size) - x.ndim
    if lead < 0:
        raise RuntimeError(f"expand: the number of sizes provided ({len(size)}) must be >= {x.ndim}")
    shape = []
    for i, s in enumerate(size):
        if s == -1:
            if i < lead:
                raise RuntimeError("expand: -1 is not allowed in a leading, non-existing dimension")
            s = x.shape[i - lead]
        shape.append(s)
    return jnp.broadcast_to(x, tuple(shape))


@register(*_with_copy(aten.unsqueeze.default))
def unsqueeze(x, dim):
    return jnp.expand_dims(x, wrap_dim(dim, x.ndim + 1))


@register(*_with_copy(aten.squeeze.default))
def squeeze(x):
    return jnp.reshape(x, tuple(s for s in x.shape if s != 1))


@register(*_with_copy(aten.squeeze.dim))
def squeeze_dim(x, dim):
    return squeeze_dims(x, [dim])


@register(*_with_copy(aten.squeeze.dims))
def squeeze_dims(x, dim):
    if x.ndim == 0:
        for d in dim:
            wrap_dim(d, 0)
        return x
    drop = {wrap_dim(d, x.ndim) for d in dim}
    return jnp.reshape(x, tuple(s for i, s in enumerate(x.shape) if not (i in drop and s == 1)))


@register(*_with_copy(aten.slice.Tensor))
def slice_(x, dim=0, start=None, end=None, step=1):
    dim = wrap_dim(dim, x.ndim)
    start, end = slice_bounds(x.shape[dim], start, end, step)
    return x[_index_at(x.ndim, dim, slice(start, end, step))]


@register(aten.narrow_copy.default)
def narrow_copy(x, dim, start, length):
    dim = wrap_dim(dim, x.ndim)
    if start < 0:
        start += x.shape[dim]
    if start < 0 or length < 0 or start + length > x.shape[dim]:
        raise IndexError(f"narrow: start {start} + length {length} exceeds dimension size {x.shape[dim]}")
    return lax.slice_in_dim(x, start, start + length, axis=dim)


@register(*_with_copy(aten.select.int))
def select(x, dim, index):
    dim = wrap_dim(dim, x.ndim)
    n = x.shape[dim]
    if not -n <= index < n:
        raise IndexError(f"select(): index {index} out of range for tensor of size {x.shape} at dimension {dim}")
    return lax.index_in_dim(x, index % n, axis=dim, keepdims=False)


def _split_sizes(length, split_size):
    if split_size == 0:
        if length:
            raise RuntimeError("split_size can only be 0 if dimension size is 0")
        return [0]
    n = max(1, -(-length // split_size))
    return [min(split_size, length - i * split_size) for i in range(n)]


@register(*_with_copy(aten.split_with_sizes.default), aten.unsafe_split_with_sizes.default)
def split_with_sizes(x, split_sizes, dim=0):
    dim = wrap_dim(dim, x.ndim)
    if sum(split_sizes) != x.shape[dim]:
        raise RuntimeError(f"split_with_sizes expects split_sizes to sum exactly to {x.shape[dim]}")
    out, pos = [], 0
    for s in split_sizes:
        out.append(lax.slice_in_dim(x, pos, pos + s, axis=dim))
        pos += s
    return out


@register(*_with_copy(aten.split.Tensor), aten.unsafe_split.Tensor)
def split(x, split_size, dim=0):
    d = wrap_dim(dim, x.ndim)
    return split_with_sizes(x, _split_sizes(x.shape[d], split_size), d)


@register(*_with_copy(aten.unbind.int))
def unbind(x, dim=0):
    dim = wrap_dim(dim, x.ndim)
    return [lax.index_in_dim(x, i, axis=dim, keepdims=False) for i in range(x.shape[dim])]


def _diag_setup(shape, offset, dim1, dim2):
    nd = len(shape)
    d1, d2 = wrap_dim(dim1, nd), wrap_dim(dim2, nd)
    if d1 == d2:
        raise RuntimeError("diagonal dimensions cannot be identical")
    r0, c0 = max(-offset, 0), max(offset, 0)
    n = max(0, min(shape[d1] - r0, shape[d2] - c0))
    return d1, d2, np.arange(n) + r0, np.arange(n) + c0


@register(*_with_copy(aten.diagonal.default))
def diagonal(x, offset=0, dim1=0, dim2=1):
    d1, d2, rows, cols = _diag_setup(x.shape, offset, dim1, dim2)
    return jnp.moveaxis(x, (d1, d2), (-2, -1))[..., rows, cols]


@register(aten.diagonal_scatter.default)
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    d1, d2, rows, cols = _diag_setup(x.shape, offset, dim1, dim2)
    moved = jnp.moveaxis(x, (d1, d2), (-2, -1))
    moved = moved.at[..., rows, cols].set(src.astype(x.dtype))
    return jnp.moveaxis(moved, (-2, -1), (d1, d2))


@register(aten.diagonal_backward.default)
def diagonal_backward(grad, input_sizes, offset, dim1, dim2):
    return diagonal_scatter(jnp.zeros(tuple(input_sizes), grad.dtype), grad, offset, dim1, dim2)


def _strided_index(size, stride, offset):
    idx = np.full(tuple(size), offset or 0, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return idx


@register(*_with_copy(aten.as_strided.default))
def as_strided(x, size, stride, storage_offset=None):
    idx = _strided_index(size, stride, storage_offset)
    if idx.size and (idx.min() < 0 or idx.max() >= x.size):
        raise RuntimeError(
            f"as_strided: size {list(size)} stride {list(stride)} is out of bounds for {x.size} elements"
        )
    return jnp.reshape(x, (-1,))[idx] if idx.size else jnp.zeros(tuple(size), x.dtype)


@register(aten.as_strided_scatter.default)
def as_strided_scatter(x, src, size, stride, storage_offset=None):
    idx = _strided_index(size, stride, storage_offset)
    flat = jnp.reshape(x, (-1,)).at[idx].set(src.astype(x.dtype))
    return jnp.reshape(flat, x.shape)


@register(*_with_copy(aten.unfold.default))
def unfold(x, dimension, size, step):
    if x.ndim == 0:
        if size > 1:
            raise RuntimeError(f"maximum size for tensor at dimension 0 is 1 but size is {size}")
        return jnp.reshape(x, (1,))
    d = wrap_dim(dimension, x.ndim)
    n = x.shape[d]
    if size > n or step <= 0:
        raise RuntimeError(f"unfold: size {size} > dimension size {n} or step {step} <= 0")
    windows = (n - size) // step + 1
    idx = (np.arange(windows)[:, None] * step + np.arange(size)[None, :]).reshape(-1)
    out = jnp.take(x, idx, axis=d).reshape(x.shape[:d] + (windows, size) + x.shape[d + 1 :])
    return jnp.moveaxis(out, d + 1, -1)


@register(aten.unfold_backward.default)
def unfold_backward(grad, input_sizes, dim, size, step):
    d = wrap_dim(dim, len(input_sizes))
    n = input_sizes[d] if input_sizes else 1
    if not input_sizes:
        return jnp.reshape(grad, ())
    windows = (n - size) // step + 1
    idx = (np.arange(windows)[:, None] * step + np.arange(size)[None, :]).reshape(-1)
    g = jnp.moveaxis(grad, -1, d + 1).reshape(tuple(input_sizes[:d]) + (windows * size,) + tuple(input_sizes[d + 1 :]))
    zeros = jnp.zeros(tuple(input_sizes), grad.dtype)
    return zeros.at[_index_at(len(input_sizes), d, idx)].add(g)


@register(*_with_copy(aten.view_as_real.default))
def view_as_real(x):
    if not jnp.iscomplexobj(x):
        raise RuntimeError("view_as_real is only supported for complex tensors")
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


@register(*_with_copy(aten.view_as_complex.default))
def view_as_complex(x):
    if x.ndim == 0 or x.shape[-1] != 2:
        raise RuntimeError("Tensor must have a last dimension of size 2")
    if x.dtype not in (jnp.float32, jnp.float64):
        raise RuntimeError(f"view_as_complex is only supported for float and double tensors, got {x.dtype}")
    return lax.complex(x[..., 0], x[..., 1])


# --------------------------------------------------------------------- view inverses (*_scatter)


@register(aten.slice_scatter.default)
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    """x with x[dim-slice] = src: a dynamic_update_slice for step 1, else a pad + select (no scatter)."""
    dim = wrap_dim(dim, x.ndim)
    n = x.shape[dim]
    start, end = slice_bounds(n, start, end, step)
    src = jnp.broadcast_to(src.astype(x.dtype), x.shape[:dim] + (len(range(start, end, step)),) + x.shape[dim + 1 :])
    count = src.shape[dim]
    if count == 0:
        return x
    if step == 1:
        return lax.dynamic_update_slice_in_dim(x, src, start, axis=dim)
    config = [(0, 0, 0)] * x.ndim
    config[dim] = (start, n - start - (count - 1) * step - 1, step - 1)
    spread = lax.pad(src, jnp.zeros((), x.dtype), config)
    hit = np.zeros(n, bool)
    hit[start:end:step] = True
    return jnp.where(hit.reshape((n,) + (1,) * (x.ndim - dim - 1)), spread, x)


@register(aten.select_scatter.default)
def select_scatter(x, src, dim, index):
    dim = wrap_dim(dim, x.ndim)
    n = x.shape[dim]
    if not -n <= index < n:
        raise IndexError(f"select_scatter(): index {index} out of range for size {n} at dimension {dim}")
    src = jnp.broadcast_to(src.astype(x.dtype), x.shape[:dim] + x.shape[dim + 1 :])
    return lax.dynamic_update_index_in_dim(x, src, index % n, axis=dim)


@register(aten.slice_backward.default)
def slice_backward(grad, input_sizes, dim, start, end, step):
    return slice_scatter(jnp.zeros(tuple(input_sizes), grad.dtype), grad, dim, start, end, step)


@register(aten.select_backward.default)
def select_backward(grad, input_sizes, dim, index):
    return select_scatter(jnp.zeros(tuple(input_sizes), grad.dtype), grad, dim, index)


# ------------------------------------------------------------------------------ copying shape ops


@register(aten.cat.default)
def cat(tensors, dim=0):
    # torch skips legacy 1-d empty tensors (shape (0,)) whatever the others' rank
    dtype = promote(tensors)
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        return jnp.zeros((0,), dtype)
    d = wrap_dim(dim, kept[0].ndim)
    return jnp.concatenate([t.astype(dtype) for t in kept], axis=d)


@register(aten.stack.default)
def stack(tensors, dim=0):
    dtype = promote(tensors)
    d = wrap_dim(dim, tensors[0].ndim + 1)
    return jnp.stack([t.astype(dtype) for t in tensors], axis=d)


@register(aten.flip.default)
def flip(x, dims):
    if x.ndim == 0:
        return x
    dims = tuple({wrap_dim(d, x.ndim) for d in dims})
    return jnp.flip(x, dims) if dims else x


@register(aten.roll.default)
def roll(x, shifts, dims=()):
    if not dims:
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    if len(shifts) != len(dims):
        raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, dims: {len(dims)}")
    return jnp.roll(x, tuple(shifts), tuple(wrap_dim(d, x.ndim) for d in dims))


@register(aten.repeat.default)
def repeat(x, repeats):
    repeats = tuple(repeats)
    if len(repeats) < x.ndim:
        raise RuntimeError("Number of dimensions of repeat dims can not be smaller than number of dimensions of tensor")
    x = jnp.reshape(x, (1,) * (len(repeats) - x.ndim) + x.shape)
    return jnp.tile(x, repeats)


@register(aten.constant_pad_nd.default)
def constant_pad_nd(x, pad, value=0):
    pad = list(pad)
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise RuntimeError(f"Length of pad must be even and at most twice the number of dims, got {len(pad)}")
    config = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        config[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    for s, (lo, hi, _) in zip(x.shape, config):
        if s + lo + hi < 0:
            raise RuntimeError(f"constant_pad_nd: padding {pad} gives a negative size")
    return lax.pad(x, jnp.asarray(value).astype(x.dtype), config)


@register(aten.pixel_shuffle.default)
def pixel_shuffle(x, upscale_factor):
    r = upscale_factor
    *b, c, h, w = x.shape
    y = x.reshape(*b, c // (r * r), r, r, h, w)
    nb = len(b)
    perm = list(range(nb)) + [nb, nb + 3, nb + 1, nb + 4, nb + 2]
    return jnp.transpose(y, perm).reshape(*b, c // (r * r), h * r, w * r)


@register(aten.pixel_unshuffle.default)
def pixel_unshuffle(x, downscale_factor):
    r = downscale_factor
    *b, c, h, w = x.shape
    y = x.reshape(*b, c, h // r, r, w // r, r)
    nb = len(b)
    perm = list(range(nb)) + [nb, nb + 2, nb + 4, nb + 1, nb + 3]
    return jnp.transpose(y, perm).reshape(*b, c * r * r, h // r, w // r)


@register(aten.channel_shuffle.default)
def channel_shuffle(x, groups):
    n, c = x.shape[:2]
    y = x.reshape((n, groups, c // groups) + x.shape[2:])
    return jnp.swapaxes(y, 1, 2).reshape(x.shape)


@register(aten.rot90.default)
def rot90(x, k=1, dims=(0, 1)):
    d0, d1 = (wrap_dim(d, x.ndim) for d in dims)
    if d0 == d1:
        raise RuntimeError("rot90: expected rotation dims to be different")
    return jnp.rot90(x, k, axes=(d0, d1))


# tril/triu reach dispatch (explicit causal masks; SDPA's math path on a PrivateUse1 device) but
# belong to no family. Registered here unless a module imported earlier already lowers them.
def _tri(fn):
    def lowering(x, diagonal=0):
        if x.ndim < 2:
            raise RuntimeError(f"{fn.__name__}: input tensor must have at least 2 dimensions")
        return fn(x, diagonal)

    return lowering


for _op, _fn in ((aten.tril.default, jnp.tril), (aten.triu.default, jnp.triu)):
    from shardtensor.ops.registry import lookup as _lookup

    if _lookup(_op) is None:
        register(_op)(_tri(_fn))
