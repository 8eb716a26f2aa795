"""``StagedLoadPlanner``: DCP's default load planner made all or nothing, checked before it reads."""

from __future__ import annotations

import functools
from typing import Any

import torch

from shardtensor.checkpoint.errors import CheckpointMismatchError
from shardtensor.checkpoint.safe_reading import decode_value
from shardtensor.checkpoint.shard_load import ShardLoad
from shardtensor.graph.interrupts import deferred_interrupts
from shardtensor.tensor.sharded import ShardedTensor

_LISTED = 8  # keys named per kind of problem in an error (then "and N more")


@functools.cache  # (one class: st.checkpoint.StagedLoadPlanner and the one load uses)
def staged_load_planner_class() -> type:
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class StagedLoadPlanner(DefaultLoadPlanner):
        """DCP's default load planner, checked first and all or nothing.

        Before anything is read, it compares the checkpoint with the target state dict and raises
        one ``CheckpointMismatchError`` naming every key that is missing from the checkpoint
        (``allow_partial_load=True`` keeps those targets as they are), with
        ``allow_unexpected_keys=False`` every key of the checkpoint the target lacks (by default
        they are skipped, as DCP does: load the model alone from a model-and-optimizer
        checkpoint), and every shape or dtype that differs (``cast_dtypes=True`` converts instead,
        as DCP silently does). Then it reads each distinct shard of a ShardedTensor into a
        host buffer of its own (each process only its devices' shards), uploads a tensor's shards
        device by device once they are all read, and puts the loaded values into the targets only
        after the last read succeeded, so a failed load (a truncated or missing file, a read error)
        leaves the target state dict unchanged. Non-tensor values are read with
        ``torch.load(weights_only=True)`` (DCP's own planner runs any code they hold). Costs one
        device copy of the loaded tensors while loading. ``defer_commit=True`` waits for
        ``commit()`` (``st.checkpoint.load`` calls it once every process has read everything).

        Example::

            dcp.load(model.state_dict(), checkpoint_id="ckpt", planner=StagedLoadPlanner())
        """

        def __init__(
            self,
            flatten_state_dict: bool = True,
            flatten_sharded_tensors: bool = True,
            allow_partial_load: bool = False,
            *,
            allow_unexpected_keys: bool = True,
            cast_dtypes: bool = False,
            defer_commit: bool = False,
        ) -> None:
            super().__init__(flatten_state_dict, flatten_sharded_tensors, allow_partial_load)
            self.allow_unexpected_keys = allow_unexpected_keys
            self.cast_dtypes = cast_dtypes
            self.defer_commit = defer_commit

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            super().set_up_planner(state_dict, metadata, is_coordinator)
            self._loads: dict[str, ShardLoad] = {}  # sharded targets: host buffers, then an upload
            self._staging: dict[str, torch.Tensor] = {}  # other tensors: a CPU tensor to read into
            self._loaded_bytes: list = []
            self._fqns: list[str] = []
            self._committed = False

        def create_local_plan(self):
            if self.metadata is None:
                raise AssertionError("StagedLoadPlanner: set_up_planner was given no metadata")
            stored = self.metadata.state_dict_metadata
            missing = [] if self.allow_partial_load else [k for k in self.state_dict if k not in stored]
            unexpected = [] if self.allow_unexpected_keys else [k for k in stored if k not in self.state_dict]
            # (before DCP's own checks, which name only the first problem)
            _check_fits(self.state_dict, stored, missing, unexpected, self.cast_dtypes, only_keys=False)
            plan = super().create_local_plan()
            if unexpected:  # DCP renames the keys of a checkpoint from torch < 2.4: look again
                unexpected = [k for k in stored if k not in self.state_dict]
                _check_fits(self.state_dict, stored, [], unexpected, self.cast_dtypes, only_keys=True)
            for fqn in dict.fromkeys(item.dest_index.fqn for item in plan.items):
                # now, in the same order in every process: a pending target is computed (a program
                # every process runs), which the reads, in each process's own order, must not do
                if _reads_by_shard(self.state_dict[fqn]):
                    self._loads[fqn] = ShardLoad(self.state_dict[fqn], install=False)
            return plan

        def finish_plan(self, new_plan):
            plan = super().finish_plan(new_plan)
            self._reads_left = len(plan.items)
            self._fqns = list(dict.fromkeys(item.dest_index.fqn for item in plan.items))
            if not self._reads_left and not self.defer_commit:
                self.commit()
            return plan

        def lookup_tensor(self, index):
            fqn = index.fqn
            target = self.state_dict[fqn]
            whole = index.offset is None or not any(index.offset)
            if fqn in self._loads:
                return self._loads[fqn].buffer(fqn, tuple(index.offset or ()))
            if isinstance(target, torch.Tensor) and whole:
                if fqn not in self._staging:
                    self._staging[fqn] = torch.empty(tuple(target.shape), dtype=target.dtype)
                return self._staging[fqn]
            return super().lookup_tensor(index)  # (another library's sharded tensor: written directly)

        def load_bytes(self, read_item, value) -> None:
            # (DCP's own planner reads these with torch.load(weights_only=False): any code could run)
            self._loaded_bytes.append((read_item, decode_value(read_item.dest_index.fqn, value)))
            self._one_read_done()

        def commit_tensor(self, read_item, tensor) -> None:
            super().commit_tensor(read_item, tensor)
            self._one_read_done()

        def _one_read_done(self) -> None:
            self._reads_left -= 1
            if self._reads_left == 0 and not self.defer_commit:
                self.commit()

        def commit(self) -> None:
            """Put everything read into the target state dict (called after the last read, or by
            the caller with ``defer_commit=True``)."""
            if self._committed:
                return
            unread = [fqn for fqn, load in self._loads.items() if load.array is None]
            if unread:
                raise CheckpointMismatchError(
                    f"the checkpoint's chunks do not cover all of {_listed(unread)}; nothing was loaded "
                    "(the checkpoint's metadata is inconsistent: write it again)"
                )
            # (all or nothing: a Ctrl-C lands once every target has its value)
            with deferred_interrupts(), torch.no_grad():
                self._committed = True
                for fqn in self._fqns:
                    if fqn in self._loads:
                        self._loads[fqn].install()
                    elif fqn in self._staging:
                        self.state_dict[fqn].detach().copy_(self._staging[fqn])
                for read_item, value in self._loaded_bytes:
                    fqn = read_item.dest_index.fqn
                    if self.flatten_state_dict:
                        set_element(self.original_state_dict, self.mappings[fqn], value)
                    else:
                        self.state_dict[fqn] = value
            self._loads.clear()
            self._staging.clear()
            self._loaded_bytes.clear()

    StagedLoadPlanner.__module__ = "shardtensor.checkpoint"
    return StagedLoadPlanner


def _reads_by_shard(target: Any) -> bool:
    """Whether DCP reads ``target`` shard by shard (a ShardedTensor that is not a view, nor empty)."""
    return isinstance(target, ShardedTensor) and not target._chain and target.numel() > 0


def _check_fits(targets: dict[str, Any], stored: dict, missing, unexpected, cast_dtypes: bool, only_keys: bool) -> None:
    """One error naming every key that is missing, unexpected, or of another shape or dtype (the
    unexpected keys alone do not raise unless ``only_keys``: they are looked at again)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    shapes, dtypes = [], []
    for fqn, target in targets.items():
        md = stored.get(fqn)
        if not isinstance(md, TensorStorageMetadata) or not isinstance(target, torch.Tensor):
            continue
        if tuple(md.size) != tuple(target.shape):
            shapes.append(f"{fqn} (checkpoint {tuple(md.size)}, target {tuple(target.shape)})")
        elif md.properties.dtype != target.dtype and not cast_dtypes:
            dtypes.append(f"{fqn} (checkpoint {md.properties.dtype}, target {target.dtype})")
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {_listed(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the target: {_listed(unexpected)}")
    if shapes:
        problems.append(f"shapes differ: {_listed(shapes)}")
    if dtypes:
        problems.append(f"dtypes differ: {_listed(dtypes)}")
    if not problems or not (only_keys or missing or shapes or dtypes):
        return  # (unexpected keys alone are looked at again once DCP renamed old-style keys)
    raise CheckpointMismatchError(
        "the checkpoint does not fit the target state dict, nothing was loaded: "
        + "; ".join(problems)
        + ". Load the matching checkpoint, or pass allow_partial_load=True (missing keys keep "
        "their values), allow_unexpected_keys=True (unused keys are skipped), cast_dtypes=True "
        "(values are converted); st.checkpoint.load(..., strict=False) allows the first two."
    )


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:_LISTED])
    return shown if len(keys) <= _LISTED else f"{shown} and {len(keys) - _LISTED} more"
