"""The tensor-subclass protocol DCP's default planners use, installed on ShardedTensor.

DCP asks a tensor subclass three questions (the protocol DTensor implements):
``__create_write_items__`` (what to write: here one item per distinct shard, replicas once, padding
never), ``__create_chunk_list__`` (what a load needs: here this process's distinct shards, so each
process reads only the byte ranges its devices hold, from a checkpoint of any sharding) and
``__get_tensor_shard__`` (the data of one item). Saving copies each shard from its device buffer to
the host alone, never the full tensor. Loading reads each shard into a host buffer of its own and,
once the tensor's buffers are full, uploads them device by device into the tensor's storage, which
keeps the target's mesh and spec (``shard_load``).

DCP asks ``__get_tensor_shard__`` both when saving and when loading. A load is what
``__create_chunk_list__`` starts (it attaches a fresh ``ShardLoad`` to the tensor, which stays there
once done); a save is what ``__create_write_items__`` starts (it drops any load, finished or left
by a failed one). DCP plans each save and each load (those calls) before it writes or reads, in
every process, so a tensor with a load attached is being loaded: the answer comes from the tensor's
own state, set by the planning of the operation in progress.
"""

from __future__ import annotations

import dataclasses
from types import EllipsisType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shardtensor import metrics as counters
from shardtensor import runtime
from shardtensor import sharding as sh
from shardtensor.checkpoint.shard_load import ShardLoad
from shardtensor.dtypes import numpy_to_torch
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
    shape = tuple(tensor.shape)
    by_id = {p.device_id: p for p in sh.placements(shape, mesh, spec)}
    pieces = []
    for s in sorted(array.addressable_shards, key=lambda s: s.device.id):
        placement = by_id[runtime.device_id(s.device)]
        if placement.replica_id != 0:
            continue  # a replica: replica 0's owner writes it
        if isinstance(placement.indices, EllipsisType):
            offsets, sizes = (0,) * len(shape), shape
        else:
            offsets = tuple(i.start for i in placement.indices)
            sizes = tuple(i.stop - i.start for i in placement.indices)
        if 0 in sizes and 0 not in shape:
            continue  # a shard of padding only
        pieces.append(_Piece(offsets, sizes, s))
    return pieces


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
    """{offsets: a host copy of the real data} of each distinct shard this process holds."""
    return {piece.offsets: _host_copy(piece) for piece in _pieces(tensor)}


def _host_copy(piece: _Piece) -> torch.Tensor:
    """A host copy of the real data of one shard, from its device buffer alone (a contiguous copy)."""
    data = np.asarray(piece.shard.data)[tuple(slice(0, n) for n in piece.sizes)]
    counters.increment("TransferFromDevice")
    return numpy_to_torch(data)


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
    """Saving: a host copy of the shard at ``index.offset`` (its real data only). Loading: the host
    buffer of that shard (``self`` for a view)."""
    offsets = tuple(index.offset) if index.offset is not None else (0,) * self.dim()
    load = self.__dict__.get(LOADING)
    if load is WHOLE:
        return self
    if load is not None:
        return load.buffer(index.fqn, offsets)
    for piece in _pieces(self):
        if piece.offsets == offsets:
            return _host_copy(piece)
    raise ValueError(f"{index.fqn}: this process holds no shard at offsets {offsets} (shape {tuple(self.shape)})")


ShardedTensor.__create_write_items__ = _create_write_items  # type: ignore[attr-defined]
ShardedTensor.__create_chunk_list__ = _create_chunk_list  # type: ignore[attr-defined]
ShardedTensor.__get_tensor_shard__ = _get_tensor_shard  # type: ignore[attr-defined]
