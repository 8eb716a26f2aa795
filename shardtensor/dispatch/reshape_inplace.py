"""In-place ops that change a tensor's shape, strides or storage: ``squeeze_``, ``unsqueeze_``,
``transpose_``, ``t_`` (``swapdims_``/``swapaxes_`` reach us as ``transpose_``), ``as_strided_``,
``resize_``, ``resize_as_``, ``_resize_output_`` (out= tensors of the wrong shape) and ``set_``; also
``as_strided``, which addresses storage.

The tensor object stays the same (autograd and the user hold it): it gets a new view chain, or a new
Cell when it outgrows its storage, and the C++ extension (``device_guard.cpp``) sets the sizes,
strides and storage offset in its TensorImpl. Without the extension these ops are a clear error.

Example::

    x = st.shard(torch.randn(4, 6), mesh, ("x", "y"))
    v = x[1]
    x.t_()            # x is now a (6, 4) view of the same storage; v still aliases it
    x.resize_(2, 3)   # a view of the first 6 storage elements, as in torch
"""

from __future__ import annotations

import torch

from shardtensor import sharding as sh
from shardtensor.dispatch.meta import as_meta
from shardtensor.dispatch.record import device_mismatch, zeros
from shardtensor.dispatch.table import special
from shardtensor.dispatch.view_ops import view_op
from shardtensor.graph import views
from shardtensor.graph.execute import run_cells
from shardtensor.graph.ir import Cell
from shardtensor.graph.state import STATE, set_pending
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor import device as torch_device
from shardtensor.tensor.geometry import contiguous_strides, meta_like

aten = torch.ops.aten

_INPLACE_VIEWS = {
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
}


def _retarget(func, t, cell, chain, shape, strides, offset, storage_of=None, fresh_storage=False):
    """Make ``t`` show ``chain`` of ``cell`` with this torch geometry."""
    ext = torch_device.EXT
    if ext is None:
        raise RuntimeError(
            f"{func}: changing the shape of a tensor in place (from {tuple(t.shape)} to {tuple(shape)}) needs "
            "shardtensor's C++ extension, which is not loaded (shardtensor tensors cannot be resized "
            "without it); use the out-of-place op"
        )
    root_strides, root_offset, _ = views.cell_storage(cell)
    if (tuple(shape), tuple(strides), offset) == (cell.shape, tuple(root_strides), root_offset):
        chain = ()  # back to the cell's own layout (t_() twice, unsqueeze_ then squeeze_)
    elif len(chain) > 8:  # repeated in-place view ops: one storage step says the same
        chain = (views.storage_step(cell, shape, strides, offset),)
    if cell is not t._cell and STATE.tracing:  # a replay could not move t to another cell
        STATE.trace_broken = STATE.trace_broken or f"{func} gave a tensor new storage"
    if storage_of is not None:
        ext.share_storage(t, storage_of)
    if fresh_storage:
        ext.fresh_storage(t, 0)
    ext.set_geometry(t, list(shape), list(strides), int(offset))
    if t._is_view():
        ext.forget_view_replay(t)
    t._cell, t._chain, t._vcache, t._sig = cell, chain, None, None
    return t


def _inplace_view(func, args, kwargs):
    t = args[0]
    v = view_op(_INPLACE_VIEWS[func], args, kwargs)
    assert v._cell is t._cell, func  # a view, not a copy
    return _retarget(func, t, v._cell, v._chain, v.shape, v.stride(), v.storage_offset())


def _storage_meta(t):
    """A meta tensor with ``t``'s geometry over a storage as large as its cell's (meta_like's only
    reaches ``t``'s own elements; as_strided and resize_ check against the whole storage)."""
    extent = views.cell_storage(t._cell)[2]
    storage = torch.empty(max(extent, t.storage_offset()), dtype=t.dtype, device="meta")
    return storage.as_strided(tuple(t.shape), t.stride(), t.storage_offset())


def _geometry_after(func, args, kwargs):
    """Run ``func`` on meta tensors (torch's checks and errors): the geometry of its result."""
    rest, mkw = as_meta((args[1:], kwargs))
    margs = [_storage_meta(args[0]), *rest]
    with torch._C._DisableTorchDispatch():
        m = func(*margs, **mkw)  # self for the in-place ops, the view for as_strided
    return tuple(m.shape), m.stride(), m.storage_offset()


def _as_strided(func, args, kwargs):
    """A view of ``self``'s storage, whatever views ``self`` went through (torch's semantics)."""
    t = args[0]
    shape, strides, offset = _geometry_after(func, args, kwargs)
    step = views.storage_step(t._cell, shape, strides, offset)
    v = ShardedTensor(t._cell, shape, t.dtype, chain=(step,), strides=strides, storage_offset=offset)
    if func is aten.as_strided_.default:
        return _retarget(func, t, v._cell, v._chain, shape, strides, offset)
    return v


def _resize(func, args, kwargs):
    """``resize_``, ``resize_as_``, ``_resize_output_``: as in torch, a tensor that still fits in its
    storage becomes a view of it (its old values, still shared with its views); one that outgrows it
    gets a new storage (a new Cell) holding the old storage's values first and zeros after (torch
    leaves them uninitialised), and no longer shares it with views taken before (in torch they would
    see the grown storage). The new Cell keeps the old spec when the tensor was not a view, the rank
    is unchanged and every sharded dimension keeps at least one element per shard; otherwise it is
    replicated over the old mesh (a tensor without a spec stays without: XLA chooses)."""
    t = args[0]
    shape, strides, offset = _geometry_after(func, args, kwargs)
    return resize_to(func, t, shape, strides, offset)


def resize_to(func, t, shape, strides, offset):
    """Give ``t`` the geometry (shape, strides, offset) over its storage, growing it if needed."""
    if (shape, tuple(strides), offset) == (tuple(t.shape), t.stride(), t.storage_offset()):
        return t
    need = views.storage_extent(shape, strides, offset)
    if need <= views.cell_storage(t._cell)[2]:
        step = views.storage_step(t._cell, shape, strides, offset, str(func))
        return _retarget(func, t, t._cell, (step,), shape, strides, offset)
    if offset == 0 and views.is_dense(shape, strides):
        cell_shape, cell_strides = shape, strides
    else:  # the tensor sits inside its new storage: keep the storage 1-D and view it
        cell_shape, cell_strides = (need,), (1,)
    ref = views.storage_values(t._cell, cell_shape, cell_strides)
    cell = Cell(ref, cell_shape, t.dtype)
    if tuple(cell_strides) != contiguous_strides(cell_shape):
        cell.root = (tuple(cell_strides), 0)
    old = t._cell
    if old.spec is not None:
        keep = (
            not t._chain
            and len(old.spec) == len(cell_shape)
            and all(n >= k for n, k in zip(cell_shape, sh.shard_counts(old.mesh, old.spec, len(cell_shape))))
        )
        cell.sharding = old.sharding if keep else sh.ShardingSpec(old.mesh, (None,) * len(cell_shape))
    set_pending(cell, ref)
    chain = () if cell_shape == shape else (views.storage_step(cell, shape, strides, offset),)
    _retarget(func, t, cell, chain, shape, strides, offset, fresh_storage=True)
    if STATE.eager:
        run_cells([cell])
    return t


def _set(func, args, kwargs):
    """``set_()`` (empty) and ``set_(source)`` (share source's storage and geometry). torch turns
    ``set_(source, offset, size, stride)`` into ``set_(Storage, ...)``; a ShardedTensor's torch storage
    holds no data, so Storage arguments are refused with a way out."""
    t = args[0]
    if func in (aten.set_.source_Storage, aten.set_.source_Storage_storage_offset):
        raise RuntimeError(
            f"{func}: shardtensor tensors keep no data in their torch storage, so set_ with a Storage "
            "(or with source, storage_offset, size, stride) is not supported; use "
            "t.set_(source.as_strided(size, stride, storage_offset)) instead"
        )
    margs = [meta_like(a) if isinstance(a, ShardedTensor) else a for a in args]
    with torch._C._DisableTorchDispatch():
        func(*margs, **kwargs)  # torch's checks (same dtype, ...)
    if func is aten.set_.default:  # an empty storage of its own
        return _retarget(func, t, zeros((0,), t.dtype)._cell, (), (0,), (1,), 0, fresh_storage=True)
    src = args[1]
    if not isinstance(src, ShardedTensor):
        raise device_mismatch(src)
    return _retarget(func, t, src._cell, src._chain, src.shape, src.stride(), src.storage_offset(), storage_of=src)


special(*_INPLACE_VIEWS)(_inplace_view)
special(aten.as_strided.default, aten.as_strided_.default)(_as_strided)
special(aten.resize_.default, aten.resize_as_.default, aten._resize_output_.default)(_resize)
special(*(getattr(aten.set_, o) for o in aten.set_.overloads()))(_set)
