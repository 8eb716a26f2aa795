"""torch.distributed.checkpoint (DCP) support for ShardedTensor.

DCP's default planners ask a tensor subclass three questions (the protocol DTensor implements):
``__create_write_items__`` (what to write: here one item per distinct shard, replicas once, padding
never), ``__create_chunk_list__`` (what a load needs: here the whole logical tensor, so a checkpoint of
any sharding reads into any other) and ``__get_tensor_shard__`` (the data of one item). Saving copies
each shard from its device buffer to the host alone, never the full tensor; loading reads one stored
chunk at a time and writes it into the target in place, which keeps the target's mesh and spec.

Importing this module installs the protocol on ShardedTensor (``import shardtensor`` does), so plain
``dcp.save`` / ``dcp.load`` and ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict`` work without a process group::

    import torch.distributed.checkpoint as dcp
    dcp.save(model.state_dict(), checkpoint_id="ckpt")
    dcp.load(other_model.state_dict(), checkpoint_id="ckpt")   # any mesh, spec, or plain CPU
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
from types import EllipsisType
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from shardtensor import metrics as counters
from shardtensor import runtime
from shardtensor import sharding as sh
from shardtensor.dtypes import numpy_to_torch, torch_to_numpy
from shardtensor.tensor.sharded import ShardedTensor
from shardtensor.tensor.upload import wrap_upload

if TYPE_CHECKING:  # (DCP itself is imported by the calls, when DCP makes them: it takes ~0.8 s)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import WriteItem

# DCP asks __get_tensor_shard__ for data both when saving (a host copy of one shard) and when loading
# (the tensor to copy a stored chunk into); the planning call that came last says which.
_SAVING = "_dcp_saving"
# StagedLoadPlanner's staging tensors: {offsets: host buffer} of each distinct shard to read into
_HOST_BUFFERS = "_dcp_host_buffers"


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


def _create_write_items(self: ShardedTensor, fqn: str, object: Any) -> list[WriteItem]:
    """One DCP write item per distinct shard this process holds (replicas and padding left out)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    self.__dict__[_SAVING] = True
    size = torch.Size(self.shape)
    items = []
    for piece in _pieces(self):
        offsets = torch.Size(piece.offsets)
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(piece.sizes))
        items.append(
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=_properties(self), size=size),
            )
        )
    return items


def _create_chunk_list(self: ShardedTensor) -> list[ChunkStorageMetadata]:
    """What a load fills: the whole logical tensor (DCP then reads each overlapping stored chunk)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    self.__dict__[_SAVING] = False
    buffers = self.__dict__.get(_HOST_BUFFERS)
    if buffers is not None:  # StagedLoadPlanner: one host buffer per distinct shard
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=b.shape) for o, b in buffers.items()]
    return [ChunkStorageMetadata(offsets=torch.Size([0] * self.dim()), sizes=torch.Size(self.shape))]


def _get_tensor_shard(self: ShardedTensor, index: MetadataIndex) -> torch.Tensor:
    """Saving: a host copy of the shard at ``index.offset`` (its real data only). Loading: ``self``
    (or, for StagedLoadPlanner, the host buffer of that shard)."""
    offsets = tuple(index.offset) if index.offset is not None else (0,) * self.dim()
    if not self.__dict__.get(_SAVING, False):
        buffers = self.__dict__.get(_HOST_BUFFERS)
        return self if buffers is None else buffers[offsets]
    for piece in _pieces(self):
        if piece.offsets == offsets:
            data = np.asarray(piece.shard.data)[tuple(slice(0, n) for n in piece.sizes)]
            counters.increment("TransferFromDevice")
            return numpy_to_torch(data)  # (a contiguous copy)
    raise ValueError(f"{index.fqn}: this process holds no shard at offsets {offsets} (shape {tuple(self.shape)})")


ShardedTensor.__create_write_items__ = _create_write_items  # type: ignore[attr-defined]
ShardedTensor.__create_chunk_list__ = _create_chunk_list  # type: ignore[attr-defined]
ShardedTensor.__get_tensor_shard__ = _get_tensor_shard  # type: ignore[attr-defined]


def _staged_load_planner_class() -> type:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from shardtensor.annotate import mark_sharding

    class StagedLoadPlanner(DefaultLoadPlanner):
        """DCP's default load planner, all or nothing: reads into new tensors with the targets' shardings
        and copies them into the targets only once every read succeeded, so a failed load (a truncated
        or missing file, a read error) leaves the target state dict unchanged. Costs one extra copy of
        the loaded tensors (on their devices) while loading.

        Example::

            dcp.load(model.state_dict(), checkpoint_id="ckpt", planner=StagedLoadPlanner())
        """

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            super().set_up_planner(state_dict, metadata, is_coordinator)
            self.state_dict = dict(self.state_dict)  # (unflattened, it is the caller's dict)
            self._targets: dict[str, torch.Tensor] = {}
            self._loaded_bytes: list = []
            for fqn, target in self.state_dict.items():
                if isinstance(target, torch.Tensor):
                    self._targets[fqn] = target
                    self.state_dict[fqn] = _staging_like(target, mark_sharding)

        def finish_plan(self, new_plan):
            plan = super().finish_plan(new_plan)
            self._reads_left = len(plan.items)
            self._reads_left_per_fqn: dict[str, int] = {}
            for item in plan.items:
                fqn = item.dest_index.fqn
                self._reads_left_per_fqn[fqn] = self._reads_left_per_fqn.get(fqn, 0) + 1
            if not self._reads_left:
                self._commit()
            return plan

        def load_bytes(self, read_item, value) -> None:
            self._loaded_bytes.append((read_item, value))
            self._one_read_done()

        def commit_tensor(self, read_item, tensor) -> None:
            super().commit_tensor(read_item, tensor)
            fqn = read_item.dest_index.fqn
            self._reads_left_per_fqn[fqn] -= 1
            staging = self.state_dict[fqn]
            if not self._reads_left_per_fqn[fqn] and _HOST_BUFFERS in staging.__dict__:
                # all of this tensor's shards are on the host: upload them (each device its own)
                self.state_dict[fqn] = _upload_shards(staging)
            self._one_read_done()

        def _one_read_done(self) -> None:
            self._reads_left -= 1
            if self._reads_left == 0:
                self._commit()

        def _commit(self) -> None:
            with torch.no_grad():
                for fqn, target in self._targets.items():
                    if fqn in self._reads_left_per_fqn:  # (allow_partial_load skips the others)
                        target.detach().copy_(self.state_dict[fqn])
                    self.state_dict[fqn] = target
            for read_item, value in self._loaded_bytes:
                super().load_bytes(read_item, value)
            self._loaded_bytes.clear()

    StagedLoadPlanner.__module__ = __name__
    return StagedLoadPlanner


def _staging_like(target: torch.Tensor, mark_sharding) -> torch.Tensor:
    """A new tensor shaped, typed and sharded like ``target`` to load into: for a ShardedTensor with
    a spec, host buffers of its distinct shards only (uploaded when they are filled); otherwise an
    uninitialised tensor."""
    if isinstance(target, ShardedTensor) and target.mesh is not None and target.partition_spec is not None:
        staging = cast(ShardedTensor, torch.empty_like(target, requires_grad=False))
        mark_sharding(staging, target.mesh, target.partition_spec)
        shape = tuple(target.shape)
        by_offsets: dict[tuple[int, ...], torch.Tensor] = {}
        for p in sh.placements(shape, target.mesh, tuple(staging._cell.spec)):
            offsets, sizes = _extent(p.indices, shape)
            if offsets not in by_offsets and _is_addressable(p.device_id):
                by_offsets[offsets] = torch.empty(sizes, dtype=target.dtype)
        staging.__dict__[_HOST_BUFFERS] = by_offsets
        return staging
    return torch.empty_like(target, requires_grad=False)


def _is_addressable(device_id: int) -> bool:
    return runtime.jax_devices()[device_id].process_index == runtime.process_index()


def _extent(indices, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of a placement's indices in a tensor of ``shape``."""
    if isinstance(indices, EllipsisType):
        return (0,) * len(shape), tuple(shape)
    return tuple(i.start for i in indices), tuple(i.stop - i.start for i in indices)


def _upload_shards(staging: ShardedTensor) -> ShardedTensor:
    """A ShardedTensor laid out as ``staging`` whose devices each receive their filled host buffer."""
    import jax

    buffers = staging.__dict__.pop(_HOST_BUFFERS)
    cell = staging._cell
    mesh, spec, shape = cell.mesh, tuple(cell.spec), tuple(staging.shape)
    sharding = sh.named_sharding(mesh, spec, len(shape))
    device_arrays = []
    for p in sh.placements(shape, mesh, spec):
        if not _is_addressable(p.device_id):
            continue
        host = torch_to_numpy(buffers[_extent(p.indices, shape)[0]])
        padded = tuple(p.padded_shape)
        if host.shape != padded:
            host = np.pad(host, [(0, n - m) for m, n in zip(host.shape, padded)])
        device_arrays.append(jax.device_put(host, runtime.jax_devices()[p.device_id]))
    array = jax.make_array_from_single_device_arrays(sh.padded_shape(shape, mesh, spec), sharding, device_arrays)
    counters.increment("TransferToDevice")
    return wrap_upload(array, shape, staging.dtype, mesh, spec)


def save(state_dict: dict, checkpoint_id: str | os.PathLike, **kwargs: Any) -> None:
    """``dcp.save`` made atomic: writes into a temporary directory next to ``checkpoint_id`` and renames
    it into place only when the save (metadata last) finished, so an exception or a killed process
    leaves the previous checkpoint at ``checkpoint_id`` readable and no half-written one there.
    One process, local paths (several processes: call ``dcp.save`` itself). ``kwargs`` go to ``dcp.save``.

    Example::

        st.checkpoint.save({"model": model.state_dict()}, "ckpt/step_100")
    """
    import torch.distributed.checkpoint as dcp

    if runtime.process_count() > 1:
        raise NotImplementedError(
            "shardtensor.checkpoint.save renames the directory from one process; with "
            f"{runtime.process_count()} processes call torch.distributed.checkpoint.save directly"
        )
    path = pathlib.Path(checkpoint_id)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dcp.save(state_dict, checkpoint_id=tmp, **kwargs)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        os.replace(path, old)  # (a directory cannot be renamed over a non-empty one)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def __getattr__(name: str) -> Any:
    # the planner subclasses DCP's, which is imported only when asked for (it takes ~0.8 s)
    if name == "StagedLoadPlanner":
        cls = globals()["StagedLoadPlanner"] = _staged_load_planner_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
