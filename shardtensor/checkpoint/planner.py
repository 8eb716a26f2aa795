"""``StagedLoadPlanner``: DCP's default load planner made all or nothing."""

from __future__ import annotations

from types import EllipsisType
from typing import cast

import numpy as np
import torch

from shardtensor import metrics as counters
from shardtensor import runtime
from shardtensor import sharding as sh
from shardtensor.checkpoint.protocol import HOST_BUFFERS
from shardtensor.dtypes import torch_to_numpy
from shardtensor.tensor.sharded import ShardedTensor
from shardtensor.tensor.upload import wrap_upload


def staged_load_planner_class() -> type:
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
            if not self._reads_left_per_fqn[fqn] and HOST_BUFFERS in staging.__dict__:
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

    StagedLoadPlanner.__module__ = "shardtensor.checkpoint"
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
        staging.__dict__[HOST_BUFFERS] = by_offsets
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

    buffers = staging.__dict__.pop(HOST_BUFFERS)
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
