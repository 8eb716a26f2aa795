"""Reading and writing through view chains.

A view is its Cell plus a chain of ``ViewStep``s (the view ops applied to the Cell's value). Reading
replays the chain; writing runs it backwards with scatters, so ``x.t().mul_(2)`` or ``x[:, 0] = 1``
updates the base exactly as torch does.

Ops that address torch's storage directly (``as_strided``, ``resize_``, ``set_``) get a
``storage_step``: the Cell's value laid out by its root strides is the storage, so the step picks
storage elements by position, as torch does, whatever views came before.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from shardtensor.graph.ir import Failed, Leaf, Node, Pending
from shardtensor.graph.state import STATE, set_pending

aten = torch.ops.aten

_RESHAPES = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.alias.default,
    aten.detach.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten._reshape_alias.default,
    aten.reshape.default,
}
_TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}


class ViewStep:
    """One view op in a chain: forward ``caller(base) -> (view,)`` and the scatter that inverts it."""

    __slots__ = ("func", "args", "kwargs", "caller", "index", "key", "in_shape", "out_shape", "_scatter")

    def __init__(self, func, args, kwargs, caller, index, key, in_shape, out_shape):
        self.func, self.args, self.kwargs = func, args, kwargs  # args without the base
        self.caller, self.index, self.key = caller, index, key
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self._scatter = None

    def scatter(self):
        """A function (base, src) -> base with the viewed elements replaced by src."""
        if self._scatter is None:
            self._scatter = _make_scatter(self)
        return self._scatter


def apply(step: ViewStep, ref):
    """Record (or run) the view op on a value reference; returns a reference to the view."""
    node = Node(step.caller, ("view", step.key), (ref,))
    return Pending(node, step.index)


def scatter(step: ViewStep, base, src):
    """Reference to ``base`` with the part ``step`` views replaced by ``src``."""
    node = Node(step.scatter(), ("scatter", step.key), (base, src))
    return Pending(node, 0)


def _make_scatter(step: ViewStep):
    func, args = step.func, step.args
    if func in _RESHAPES:
        return lambda base, src: (src.reshape(base.shape).astype(base.dtype),)
    if func in _TRANSPOSES:
        perm = _permutation(func, args, len(step.in_shape))
        inverse = tuple(int(i) for i in np.argsort(perm))
        return lambda base, src: (jnp.transpose(src, inverse).astype(base.dtype),)
    if func is aten.slice.Tensor:
        dim, start, end, stepsize = (list(args) + [0, None, None, 1][len(args) :])[:4]
        dim = dim % len(step.in_shape)
        start, _, stepsize = slice(start, end, stepsize).indices(step.in_shape[dim])
        if stepsize == 1:
            return _update_slice(dim, start, squeeze=False)
        index = (slice(None),) * dim + (slice(start, end, stepsize),)
        return lambda base, src: (base.at[index].set(src.astype(base.dtype)),)
    if func is aten.select.int:
        dim = args[0] % len(step.in_shape)
        return _update_slice(dim, args[1] % step.in_shape[dim], squeeze=True)
    if func is aten._conj.default:  # a conjugated view (there is no conj bit): write back conjugated
        return lambda base, src: (jnp.conj(src).astype(base.dtype),)
    if func is aten.view_as_real.default:
        return lambda base, src: (jax.lax.complex(src[..., 0], src[..., 1]).astype(base.dtype),)
    return _generic_scatter(step)


def _update_slice(dim, start, squeeze):
    # dynamic_update_slice rather than .at[].set: XLA (jax 0.10.2) miscompiles a sharded
    # dynamic_update_slice followed by a scatter, so every contiguous write uses the same primitive.
    def scatter_fn(base, src):
        src = src.astype(base.dtype)
        if squeeze:
            src = jnp.expand_dims(src, dim)
        return (jax.lax.dynamic_update_slice_in_dim(base, src, start, axis=dim),)

    return scatter_fn


def _permutation(func, args, ndim):
    if func is aten.t.default:
        return (1, 0) if ndim == 2 else tuple(range(ndim))
    if func is aten.transpose.int:
        perm = list(range(ndim))
        a, b = args[0] % ndim, args[1] % ndim
        perm[a], perm[b] = perm[b], perm[a]
        return tuple(perm)
    return tuple(d % ndim for d in args[0])


# --- views addressed by storage position (as_strided, resize_, set_) -------------------------------
def storage_extent(shape, strides, offset) -> int:
    """Elements of storage a tensor of this geometry reaches (one past its last element)."""
    if any(n == 0 for n in shape):
        return offset
    return offset + sum((n - 1) * s for n, s in zip(shape, strides)) + 1


def _positions(shape, strides, offset):
    """Storage position of each element of a tensor of this geometry, row-major, as int64."""
    pos = np.full(tuple(shape), offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(shape, strides)):
        pos = pos + (np.arange(n, dtype=np.int64) * s).reshape((n,) + (1,) * (len(shape) - d - 1))
    return pos.reshape(-1)


def cell_storage(cell):
    """(root strides, root offset, storage size in elements) of a Cell's value as torch storage."""
    strides, offset = cell.root or (contiguous_strides(cell.shape), 0)
    return strides, offset, storage_extent(cell.shape, strides, offset)


_CONTIGUOUS: dict = {}  # shape -> strides (a program has few shapes; cleared if it ever grows large)


def contiguous_strides(shape) -> tuple:
    """torch's strides of a contiguous tensor of ``shape`` (what ``make_contiguous_strides_for``
    gives, without its symbolic-size machinery: this runs for every new tensor, and that costs ~25 us).

    Example: ``contiguous_strides((2, 3)) == (3, 1)``.
    """
    if not isinstance(shape, tuple):
        shape = tuple(shape)
    found = _CONTIGUOUS.get(shape)
    if found is not None:
        return found
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    found = tuple(reversed(strides))
    if len(_CONTIGUOUS) >= 4096:
        _CONTIGUOUS.clear()
    _CONTIGUOUS[shape] = found
    return found


def _is_contiguous(shape, strides) -> bool:
    expected = contiguous_strides(shape)
    return all(n == 1 or s == e for n, s, e in zip(shape, strides, expected))


def storage_indices(cell, size, stride, offset, what="as_strided"):
    """Where each element of the view (size, stride, offset) of ``cell``'s storage sits in the Cell's
    row-major value: an int ``start`` when they are the run start, start+1, ... (no index array is
    built), else a numpy int64 array. RuntimeError, as torch's, if the view leaves the storage."""
    root_strides, root_offset, extent = cell_storage(cell)
    size, stride = tuple(int(n) for n in size), tuple(int(s) for s in stride)
    need = storage_extent(size, stride, offset)
    if need > extent or offset < 0 or any(s < 0 for s in stride):
        itemsize = cell.dtype.itemsize
        raise RuntimeError(
            f"{what}: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, and itemsize "
            f"{itemsize} requiring a storage size of {need * itemsize} are out of bounds for storage of "
            f"size {extent * itemsize}"
        )
    dense_root = root_offset == 0 and _is_contiguous(cell.shape, root_strides)
    if dense_root and _is_contiguous(size, stride):
        return offset
    wanted = _positions(size, stride, offset)
    if dense_root or not wanted.size:
        return wanted
    held = _positions(cell.shape, root_strides, root_offset)
    where = np.full(extent, -1, dtype=np.int64)
    where[held] = np.arange(held.size, dtype=np.int64)
    idx = where[wanted]
    if (idx < 0).any():
        raise RuntimeError(
            f"{what}: the view reads storage elements that no tensor holds (gaps of a "
            "strided storage); make the source contiguous first"
        )
    if np.array_equal(idx, np.arange(idx[0], idx[0] + idx.size)):
        return int(idx[0])
    return idx


_STEPS: dict = {}  # storage steps by geometry (their index arrays cost a little to build)


def storage_step(cell, size, stride, offset, what="as_strided") -> ViewStep:
    """A ViewStep from ``cell``'s value to the view (size, stride, offset) of its storage."""
    size, stride, offset = tuple(int(n) for n in size), tuple(int(s) for s in stride), int(offset)
    key = ("storage_view", cell.shape, cell_storage(cell)[:2], size, stride, offset)
    step = _STEPS.get(key)
    if step is not None:
        return step
    idx = storage_indices(cell, size, stride, offset, what)
    if len(_STEPS) > 4096:
        _STEPS.clear()
    step = _STEPS[key] = ViewStep(None, (), {}, None, 0, key, cell.shape, size)
    n = math.prod(size)
    if isinstance(idx, int):  # a contiguous run: slices, no gather

        def caller(base):
            return (jax.lax.slice_in_dim(base.reshape(-1), idx, idx + n).reshape(size),)

        def scatter_fn(base, src):
            flat = jax.lax.dynamic_update_slice_in_dim(
                base.reshape(-1), src.reshape(-1).astype(base.dtype), idx, axis=0
            )
            return (flat.reshape(base.shape),)
    else:

        def caller(base):
            return (base.reshape(-1)[idx].reshape(size),)

        def scatter_fn(base, src):
            out = base.reshape(-1).at[idx].set(src.reshape(-1).astype(base.dtype))
            return (out.reshape(base.shape),)

    step.caller, step._scatter = caller, scatter_fn
    return step


def is_dense(shape, strides) -> bool:
    """A geometry at offset 0 whose elements fill storage positions 0..numel-1, each once."""
    if any(n == 0 for n in shape):
        return True
    order = sorted((s, n) for n, s in zip(shape, strides) if n != 1)
    acc = 1
    for s, n in order:
        if s != acc:
            return False
        acc *= n
    return True


def storage_values(cell, shape, strides):
    """Reference to a new value for a storage that ``cell``'s storage grows (or shrinks) into: the
    tensor of dense geometry (shape, strides) over it. The old storage elements come first, then
    zeros (torch leaves them uninitialised)."""
    root_strides, root_offset, extent = cell_storage(cell)
    held = (
        None
        if root_offset == 0 and _is_contiguous(cell.shape, root_strides)
        else _positions(cell.shape, root_strides, root_offset)
    )
    total = math.prod(shape)
    keep = min(extent, total)
    order = None if _is_contiguous(shape, strides) else _positions(shape, strides, 0)

    def grow(base):
        flat = base.reshape(-1)
        if held is not None:
            flat = jnp.zeros((extent,), base.dtype).at[held].set(flat)
        flat = flat[:keep]
        if total > keep:
            flat = jnp.concatenate([flat, jnp.zeros((total - keep,), base.dtype)])
        return ((flat if order is None else flat[order]).reshape(shape),)

    key = ("storage_values", cell.shape, cell_storage(cell)[:2], tuple(shape), tuple(strides))
    return Pending(Node(grow, key, (base_ref(cell),)), 0)


def _generic_scatter(step: ViewStep):
    # Which base element each view element reads, worked out by running the same view op on indices.
    n = math.prod(step.in_shape)
    positions = torch.arange(n, dtype=torch.int64).reshape(step.in_shape)
    with torch._C._DisableTorchDispatch():
        viewed = step.func(positions, *step.args, **step.kwargs)
    if isinstance(viewed, (tuple, list)):
        viewed = viewed[step.index]
    flat = viewed.contiguous().reshape(-1).numpy()

    def scatter_fn(base, src):
        out = base.reshape(-1).at[flat].set(src.reshape(-1).astype(base.dtype))
        return (out.reshape(base.shape),)

    return scatter_fn


def read(t):
    """The value reference of ShardedTensor ``t`` (Pending or Leaf)."""
    cell = t._cell
    if not t._chain:
        return base_ref(cell)
    cached = t._vcache
    if cached is not None and cached[0] == STATE.epoch and cached[1] == cell.version and cached[2] is cell.value:
        return cached[3]
    ref = base_ref(cell)
    for step in t._chain:
        ref = apply(step, ref)
    t._vcache = (STATE.epoch, cell.version, cell.value, ref)
    return ref


def base_ref(cell):
    v = cell.value
    if isinstance(v, Pending):
        return v
    if isinstance(v, Failed):
        v.reraise()
    return cell.leaf()


def _identity(x):
    return (x,)


def write(t, ref) -> None:
    """Make ``ref`` the new value of ``t``, writing through its view chain into the Cell."""
    cell = t._cell
    if isinstance(ref, Leaf):  # a concrete value: copy it through a node so cells never share arrays
        ref = Pending(Node(_identity, ("identity",), (ref,)), 0)
    if t._chain:
        parts = [base_ref(cell)]
        for step in t._chain[:-1]:
            parts.append(apply(step, parts[-1]))
        for step, part in zip(reversed(t._chain), reversed(parts)):
            ref = scatter(step, part, ref)
    set_pending(cell, ref)
