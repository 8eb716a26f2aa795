"""A process's own data of a tensor: ``ShardedTensor.to_local()`` and ``ShardedTensor.from_local``.

DTensor has one device per process, so its "local tensor" is one device's shard. Here one process
drives several devices, so the local data is the *process's block*: the part of the global tensor its
devices hold together (the whole tensor in a job of one process), as
``jax.make_array_from_process_local_data`` understands a process's data. The devices of a process must
hold one contiguous block (they do on meshes whose leading axes split the processes); otherwise
``x.local_shards`` gives the pieces device by device.

For a ``Partial`` tensor the local data is the process's summand: ``from_local(l, mesh,
[Partial()])`` in every process makes the tensor whose value is the sum of the processes' ``l``
(``Partial("avg")``: their mean), and ``to_local()`` gives ``l`` back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import jax
import numpy as np
import torch

from shardtensor import runtime as rt
from shardtensor import sharding as sh
from shardtensor.annotate import shard
from shardtensor.dtypes import numpy_to_torch, torch_to_numpy
from shardtensor.mesh import Mesh
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.geometry import contiguous_strides
from shardtensor.tensor.upload import wrap_upload
from shardtensor.tensor_parallel.partial import (
    PartialState,
    check_partial,
    make_partial,
    summand_spec,
    without_partial,
)
from shardtensor.tensor_parallel.placements import (
    Partial,
    Placement,
    Replicate,
    _checked_placements,
    placements_to_spec,
)

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension, clipped to the logical shape


def to_local(x: ShardedTensor) -> torch.Tensor:
    """This process's block of ``x`` as a CPU torch tensor (autograd flows through); in a job of one
    process, the whole value. For a ``Partial`` tensor: this process's summand.

    Example::

        x = st.distribute_tensor(torch.arange(8.0), mesh, [st.Shard(0)])
        x.to_local()   # tensor([0., 1., ..., 7.]) in one process; its half in each of two
    """
    return cast(torch.Tensor, _ToLocal.apply(x))


def from_local(
    local_tensor: torch.Tensor,
    device_mesh: Mesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    run_check: bool = False,
    shape: Sequence[int] | None = None,
    stride: Sequence[int] | None = None,
) -> ShardedTensor:
    """A global ShardedTensor from each process's block ``local_tensor`` laid out as ``placements``
    over ``device_mesh`` (DTensor's ``from_local``; autograd flows back to ``local_tensor``).

    ``shape`` is the global shape; without it each dimension is the block's size times the number of
    process blocks along it (even splits). Processes that hold the same part must pass the same data
    (``run_check`` is accepted for DTensor's signature and checks nothing). With ``Partial()`` on a
    mesh axis, each process's block is one summand of the value.

    Example::

        x = st.from_local(torch.ones(4, 3), mesh8, [st.Shard(0)])     # (4, 3) in one process, (8, 3) in two
        p = st.from_local(torch.ones(4), mesh8, [st.Partial()])       # the sum over the processes
    """
    from shardtensor.tensor_parallel.distribute import as_mesh  # (distribute imports this module)

    mesh = as_mesh(device_mesh)
    if placements is None:
        placements = [Replicate() for _ in mesh.mesh_shape]
    placements = _checked_placements(placements, mesh)
    if not isinstance(local_tensor, torch.Tensor) or isinstance(local_tensor, ShardedTensor):
        raise TypeError(
            "from_local takes this process's data as a CPU torch.Tensor, got "
            f"{type(local_tensor).__name__}; for a ShardedTensor pass x.to_local() (or use x.redistribute)"
        )
    if local_tensor.device.type != "cpu":
        raise ValueError(f"from_local takes a CPU tensor, got one on {local_tensor.device}")
    check_partial(placements, local_tensor.dtype)
    global_shape = _global_shape(local_tensor, mesh, placements, shape)
    if stride is not None and tuple(stride) != contiguous_strides(global_shape):
        raise ValueError(
            f"from_local(stride={tuple(stride)}): shardtensor stores tensors contiguously, the stride of the "
            f"shape {global_shape} is {contiguous_strides(global_shape)}; leave stride out"
        )
    return cast(ShardedTensor, _FromLocal.apply(local_tensor, mesh, placements, global_shape))


# --------------------------------------------------------------------------- the process's block


def _my_device_ids() -> set[int]:
    return {rt.device_id(d) for d in rt.devices_by_process()[rt.process_index()]}


def _box(indices, shape) -> Box:
    if indices is Ellipsis:
        return tuple((0, n) for n in shape)
    return tuple((min(s.start, n), min(s.stop, n)) for s, n in zip(indices, shape))


def process_block(shape: Sequence[int], mesh: Mesh, spec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(origin, shape) of the block of a tensor of ``shape`` laid out as ``(mesh, spec)`` that this
    process's devices hold; a clear error when they hold no device of the mesh or not one block.

    Example: ``process_block((8, 4), mesh8, ("x", None))`` is ``((0, 0), (8, 4))`` in one process.
    """
    shape = tuple(shape)
    mine = _my_device_ids()
    boxes = {_box(p.indices, shape) for p in sh.placements(shape, mesh, spec) if p.device_id in mine}
    if not boxes:
        raise ValueError(
            f"process {rt.process_index()} holds no device of the mesh {dict(mesh.shape())}: it has no local data"
        )
    lo = tuple(min(b[d][0] for b in boxes) for d in range(len(shape)))
    hi = tuple(max(b[d][1] for b in boxes) for d in range(len(shape)))
    block = tuple(b - a for a, b in zip(lo, hi))
    covered = sum(math.prod(b - a for a, b in box) for box in boxes)
    if covered != math.prod(block):
        raise ValueError(
            f"the devices of process {rt.process_index()} hold {len(boxes)} pieces of a tensor of shape {shape} "
            f"laid out as {tuple(spec)} over the mesh {dict(mesh.shape())} that do not form one block, so it "
            "has no single local tensor: use a mesh whose leading axes split the processes, or read the "
            "pieces device by device with x.local_shards"
        )
    return lo, block


def _global_shape(local: torch.Tensor, mesh: Mesh, placements, shape) -> tuple[int, ...]:
    spec = placements_to_spec(without_partial(placements), mesh, local.dim())
    if shape is None:
        # even splits: each dimension is the block times the number of process blocks along it
        counts = sh.shard_counts(mesh, spec, local.dim())
        mine = _my_device_ids()
        tiles = {_box(p.indices, counts) for p in sh.placements(counts, mesh, spec) if p.device_id in mine}
        per_dim = [len({t[d] for t in tiles}) for d in range(local.dim())]
        shape = tuple(n * c // max(m, 1) for n, c, m in zip(local.shape, counts, per_dim))
    shape = tuple(int(n) for n in shape)
    if len(shape) != local.dim():
        raise ValueError(f"from_local: shape {shape} has {len(shape)} dimension(s), the local tensor {local.dim()}")
    _, block = process_block(shape, mesh, spec)
    if tuple(local.shape) != block:
        raise ValueError(
            f"from_local: this process's local tensor has shape {tuple(local.shape)}, but laid out as "
            f"{list(placements)} over the mesh {dict(mesh.shape())} its devices hold a block of shape {block} "
            f"of the global shape {shape}. Pass that block, or give the global shape= that fits."
        )
    return shape


# --------------------------------------------------------------------------- reading and building


def _local_value(x: ShardedTensor) -> torch.Tensor:
    """This process's block of ``x`` (for a partial tensor: the reduction of this process's summands)."""
    state: PartialState | None = x._partial_state()
    src = x if state is None else state.summands
    h = 0 if state is None else len(state.partial_axes)
    op = "sum" if state is None else state.reduce_op
    mesh, spec = src._layout()
    array = src._concrete_array()
    shape = tuple(src.shape)
    origin, block = process_block(shape[h:], mesh, spec[h:])
    by_id = {p.device_id: p for p in sh.placements(shape, mesh, spec)}
    pieces: dict[Box, np.ndarray] = {}
    for s in array.addressable_shards:
        box = _box(by_id[rt.device_id(s.device)].indices, shape)
        if box not in pieces:  # (replicas hold the same piece)
            pieces[box] = np.asarray(s.data)[tuple(slice(0, b - a) for a, b in box)]
    total = np.zeros(block, array.dtype)
    count = np.zeros(block, np.int64)
    for box, data in pieces.items():
        region = tuple(slice(a - o, b - o) for (a, b), o in zip(box[h:], origin))
        if h:  # a summand piece at some hidden positions: add it up
            total[region] += data.sum(axis=tuple(range(h)), dtype=array.dtype)
            count[region] += math.prod(b - a for a, b in box[:h])
        else:
            total[region] = data
    if op == "avg":
        total = (total / np.maximum(count, 1)).astype(array.dtype)
    return numpy_to_torch(np.array(total, order="C"))  # (ascontiguousarray would make a 0-d array 1-d)


@rt.with_x64  # int64 / float64 blocks stay 64-bit
def _build(local: torch.Tensor, mesh: Mesh, placements: tuple, shape: tuple, data_spec=None) -> ShardedTensor:
    """The global tensor of ``shape`` whose process block here is ``local`` (no autograd); laid out
    as ``placements``, or as ``data_spec`` when given (then without Partial)."""
    host = torch_to_numpy(local.detach().contiguous())
    ndim = len(shape)
    spec = summand_spec(mesh, placements, ndim) if data_spec is None else tuple(data_spec)
    partial_axes = [a for a, p in enumerate(placements) if isinstance(p, Partial)]
    h = len(partial_axes)
    op = check_partial(placements, local.dtype)
    full_shape = tuple(mesh.mesh_shape[a] for a in partial_axes) + tuple(shape)
    origin, _ = process_block(shape, mesh, spec[h:])
    # Partial("sum"): a process's summand sits at the first hidden position where it holds a piece,
    # zeros at its others (exact); Partial("avg"): at every position (the mean over positions is then
    # the mean over processes)
    first: dict[Box, tuple[int, ...]] = {}
    if op == "sum":
        mine = _my_device_ids()
        for p in sh.placements(full_shape, mesh, spec):
            if p.device_id in mine:
                box = _box(p.indices, full_shape)
                key, position = box[h:], tuple(a for a, _ in box[:h])
                first[key] = min(first.get(key, position), position)
    padded = tuple(sh.padded_shape(full_shape, mesh, spec))

    def piece(index):
        bounds = [s.indices(n)[:2] for s, n in zip(index, padded)]
        out = np.zeros(tuple(b - a for a, b in bounds), host.dtype)
        data = tuple((min(a, n), min(b, n)) for (a, b), n in zip(bounds[h:], shape))
        if op == "sum" and first.get(data) != tuple(a for a, _ in bounds[:h]):
            return out
        if all(b > a for a, b in data):
            src = tuple(slice(a - o, b - o) for (a, b), o in zip(data, origin))
            out[(slice(None),) * h + tuple(slice(0, b - a) for a, b in data)] = host[src]
        return out

    array = jax.make_array_from_callback(padded, sh.named_sharding(mesh, spec, len(full_shape)), piece)
    built = wrap_upload(array, full_shape, local.dtype, mesh, spec)
    return make_partial(built, mesh, placements) if h else built


class _ToLocal(torch.autograd.Function):
    """to_local: forward reads this process's block; backward builds the global gradient from the
    blocks of every process (a Partial's gradient as Replicate, DTensor's rule)."""

    @staticmethod
    def forward(ctx, x):
        state = x._partial_state()
        if state is None:
            mesh, spec = x._layout()
            placements = tuple(Replicate() for _ in mesh.mesh_shape)  # (the layout is spec's)
            ctx.layout = (mesh, placements, tuple(x.shape), tuple(spec))
        else:
            ctx.layout = (state.mesh, without_partial(state.placements), tuple(x.shape), None)
        return _local_value(x)

    @staticmethod
    def backward(ctx, grad):
        mesh, placements, shape, spec = ctx.layout
        return _build(grad, mesh, placements, shape, spec)


class _FromLocal(torch.autograd.Function):
    """from_local: forward builds the global tensor; backward gives each process its block of the
    gradient (laid out as the forward's placements first, Partial read as Replicate)."""

    @staticmethod
    def forward(ctx, local, mesh, placements, shape):
        ctx.layout = (mesh, without_partial(placements))
        return _build(local, mesh, placements, shape)

    @staticmethod
    def backward(ctx, grad):
        mesh, placements = ctx.layout
        if rt.process_count() > 1:  # every process then reads its block of the forward's layout
            grad = shard(grad, mesh, placements_to_spec(placements, mesh, grad.dim()))
        return _local_value(grad), None, None, None
