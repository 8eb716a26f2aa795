"""torch.distributed.checkpoint (DCP) support for ShardedTensor, and checkpoints of training jobs.

Importing this package installs DCP's tensor-subclass protocol on ShardedTensor (``import
shardtensor`` does), so plain ``dcp.save`` / ``dcp.load`` and
``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict`` work without a
process group: each process writes only its distinct shards, and a load reads into the target's
mesh and spec (any mesh, any spec, or plain CPU tensors)::

    import torch.distributed.checkpoint as dcp
    dcp.save(model.state_dict(), checkpoint_id="ckpt")
    dcp.load(other_model.state_dict(), checkpoint_id="ckpt")

``save`` is the same save made atomic; ``load`` its counterpart, which checks the checkpoint
against the target first and changes nothing unless all of it loads (``StagedLoadPlanner`` is that
load as a DCP planner). ``load`` never runs code a checkpoint holds (``UnsafeCheckpointError``)
and checks the checksums ``save`` records::

    st.checkpoint.save({"model": model.state_dict()}, "ckpt/step_100")
    st.checkpoint.load({"model": model.state_dict()}, "ckpt/step_100")

``CheckpointManager`` keeps a training job's checkpoints (one directory per step, saved in the
background if asked, the newest few kept) and resumes from them. ``HostStager`` is the stager
``dcp.async_save`` needs for ShardedTensors. See docs/dcp.md.
"""

from __future__ import annotations

from typing import Any

from shardtensor.checkpoint import protocol as _protocol  # noqa: F401  (installs the protocol)
from shardtensor.checkpoint.atomic import save
from shardtensor.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from shardtensor.checkpoint.loading import load
from shardtensor.checkpoint.manager import CheckpointManager  # (light: DCP is imported by its calls)
from shardtensor.checkpoint.safe_reading import UnsafeCheckpointError
from shardtensor.checkpoint.staging import HostStager

__all__ = [
    "save",
    "load",
    "StagedLoadPlanner",
    "HostStager",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "UnsafeCheckpointError",
]


def __getattr__(name: str) -> Any:
    # the planner subclasses DCP's, which is imported only when asked for (it takes ~0.8 s)
    if name == "StagedLoadPlanner":
        from shardtensor.checkpoint import planner

        cls = globals()["StagedLoadPlanner"] = planner.staged_load_planner_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
