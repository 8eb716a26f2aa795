"""The tensor-subclass protocol DCP's default planners use, installed on ShardedTensor.

DCP asks a tensor subclass three questions (the protocol DTensor implements):
``__create_write_items__`` (what to write: here one item per distinct shard, replicas once, padding
never), ``__create_chunk_list__`` (what a load needs: here this process's distinct shards, so each
process reads only the byte ranges its devices hold, from a checkpoint of any sharding) and
``__get_tensor_shard__`` (the data of one item). Saving hands over each shard alone, never the full
tensor (on CPU devices a view of its buffer, elsewhere a host copy). Loading reads each shard into a
host buffer of its own and, once the tensor's buffers are full, uploads them device by device into
the tensor's storage, which keeps the target's mesh and spec (``shard_load``).

DCP asks ``__get_tensor_shard__`` both when saving and when loading. A load is what
``__create_chunk_list__`` starts (it attaches a fresh ``ShardLoad`` to the tensor, which stays there
once done); a save is what ``__create_write_items__`` starts (it drops any load, finished or left
by a failed one). DCP plans each save and each load (those calls) before it writes or reads, in
every process, so a tensor with a load attached is being loaded: the answer comes from the tensor's
own state, set by the planning of the operation in progress.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from types import EllipsisType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shardtensor import metrics as counters
from shardtensor import runtime
from shardtensor import sharding as sh
from shardtensor.checkpoint.shard_load import ShardLoad
from shardtensor.dtypes import numpy_to_torch, to_torch
from shardtensor.mesh import Mesh
from shardtensor.tensor.sharded import ShardedTensor

if TYPE_CHECKING:  # (DCP itself is imported by the calls, when DCP makes them: it takes ~0.8 s)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import WriteItem

# the load in progress of a tensor (a ShardLoad, or WHOLE for a view: DCP copies into ``self``)
LOADING = "_dcp_loading"
WHOLE = "whole tensor"


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One distinct shard of a tensor held by this process: its place in the logical tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shard: Any  # the jax addressable shard (its .data is the padded device buffer)


def _pieces(tensor: ShardedTensor) -> list[_Piece]:
    """This process's distinct non-empty shards (replica 0 of each), in device order."""
    array = tensor._concrete_array()
    mesh, spec = tensor._layout()
    extents = _written_extents(tuple(tensor.shape), mesh, tuple(spec))
    pieces = []
    for s in sorted(array.addressable_shards, key=lambda s: s.device.id):
        extent = extents.get(runtime.device_id(s.device))
        if extent is not None:
            pieces.append(_Piece(extent[0], extent[1], s))
    return pieces


_Extent = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a shard in the logical tensor


# (DCP asks for every shard of every tensor by itself: the layout's arithmetic is done once)
@functools.lru_cache(maxsize=1024)
def _written_extents(shape: tuple[int, ...], mesh: Mesh, spec: tuple) -> Mapping[int, _Extent]:
    """{device id: (offsets, sizes)} of the devices whose shard is written: replica 0 of each
    distinct shard, leaving out shards of padding only. (Shared by the cache: read only.)"""
    extents: dict[int, _Extent] = {}
    for placement in sh.placements(shape, mesh, spec):
        if placement.replica_id != 0:
            continue  # a replica: replica 0's owner writes it
        if isinstance(placement.indices, EllipsisType):
            offsets, sizes = (0,) * len(shape), shape
        else:
            offsets = tuple(i.start for i in placement.indices)
            sizes = tuple(i.stop - i.start for i in placement.indices)
        if 0 in sizes and 0 not in shape:
            continue  # a shard of padding only
        extents[placement.device_id] = (offsets, sizes)
    return extents


def _properties(tensor: torch.Tensor) -> TensorProperties:
    from torch.distributed.checkpoint.metadata import TensorProperties

    return TensorProperties(
        dtype=tensor.dtype,
        layout=torch.strided,
        requires_grad=tensor.requires_grad,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )


def write_items(
    fqn: str, tensor: torch.Tensor, extents: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> list[WriteItem]:
    """DCP write items of ``tensor``'s pieces at (offsets, sizes) ``extents``."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    size = torch.Size(tensor.shape)
    items = []
    for offsets, sizes in extents:
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        items.append(
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=_properties(tensor), size=size),
            )
        )
    return items


def host_copies(tensor: ShardedTensor) -> dict[tuple[int, ...], torch.Tensor]:
    """{offsets: the real data on the host} of each distinct shard this process holds, which later
    steps leave as they are (on CPU devices views of the device buffers, see ``_shard_on_host``)."""
    pieces = _pieces(tensor)
    counters.increment("TransferFromDevice", len(pieces))
    return {piece.offsets: _shard_on_host(piece, tensor.dtype) for piece in pieces}


def _create_write_items(self: ShardedTensor, fqn: str, object: Any) -> list[WriteItem]:
    """One DCP write item per distinct shard this process holds (replicas and padding left out)."""
    self.__dict__.pop(LOADING, None)  # a save starts: a load left unfinished (it failed) is over
    return write_items(fqn, self, [(piece.offsets, piece.sizes) for piece in _pieces(self)])


def _create_chunk_list(self: ShardedTensor) -> list[ChunkStorageMetadata]:
    """What a load fills: this process's distinct shards (a view, or an empty tensor: all of it)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    if self._chain or self.numel() == 0:
        # a view writes back through its chain: DCP copies each stored chunk into ``self``, every
        # process all of them in the same order (the copies are operations on the global tensor)
        self.__dict__[LOADING] = WHOLE
        return [ChunkStorageMetadata(offsets=torch.Size([0] * self.dim()), sizes=torch.Size(self.shape))]
    load = self.__dict__[LOADING] = ShardLoad(self)
    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in load.regions.items()]


def _get_tensor_shard(self: ShardedTensor, index: MetadataIndex) -> torch.Tensor:
    """Saving: the shard at ``index.offset`` on the host (its real data only; on CPU devices a view
    of the device buffer). Loading: the host buffer of that shard (``self`` for a view)."""
    offsets = tuple(index.offset) if index.offset is not None else (0,) * self.dim()
    load = self.__dict__.get(LOADING)
    if load is WHOLE:
        return self
    if load is not None:
        return load.buffer(index.fqn, offsets)
    mesh, spec = self._layout()
    extents = _written_extents(tuple(self.shape), mesh, tuple(spec))
    for s in self._concrete_array().addressable_shards:  # (the one shard asked for, not all of them)
        extent = extents.get(runtime.device_id(s.device))
        if extent is not None and extent[0] == offsets:
            counters.increment("TransferFromDevice")
            return _shard_on_host(_Piece(extent[0], extent[1], s), self.dtype)
    raise ValueError(f"{index.fqn}: this process holds no shard at offsets {offsets} (shape {tuple(self.shape)})")


def _shard_on_host(piece: _Piece, dtype: torch.dtype) -> torch.Tensor:
    """The real data (padding cut off) of one shard, as a contiguous CPU tensor.

    A CPU device's buffer already is host memory: the shard is then a view of it, not a copy. DCP's
    writer keeps each tensor it wrote until the file is complete (one per name), so copies would add
    about a device's share of the whole state dict to the host's peak. The view stays what was saved:
    jax arrays are immutable and jax does not donate a buffer while a DLPack view of it exists.
    """
    device_buffer = piece.shard.data
    real = tuple(slice(0, n) for n in piece.sizes)
    if piece.shard.device.platform == "cpu" and to_torch(device_buffer.dtype) == dtype:
        view = torch.from_dlpack(device_buffer)
        return view if tuple(view.shape) == piece.sizes else view[real].clone()  # (padding: copy the real part)
    return numpy_to_torch(np.asarray(device_buffer)[real])  # (a contiguous copy)


ShardedTensor.__create_write_items__ = _create_write_items  # type: ignore[attr-defined]
ShardedTensor.__create_chunk_list__ = _create_chunk_list  # type: ignore[attr-defined]
ShardedTensor.__get_tensor_shard__ = _get_tensor_shard  # type: ignore[attr-defined]
