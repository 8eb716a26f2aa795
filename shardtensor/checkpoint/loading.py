"""``load``: a ``dcp.load`` that checks the checkpoint first and changes nothing unless all of it loads."""

from __future__ import annotations

import os
from typing import Any

from shardtensor.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from shardtensor.checkpoint.lazy_imports import import_dcp
from shardtensor.checkpoint.safe_reading import UnsafeCheckpointError, read_metadata, safe_reader
from shardtensor.graph.interrupts import deferred_interrupts

_OWN_ERRORS = (CheckpointMismatchError, CheckpointCorruptError, CheckpointNotFoundError)


def load(
    state_dict: dict,
    checkpoint_id: str | os.PathLike,
    *,
    strict: bool = True,
    cast_dtypes: bool = False,
    process_group: Any = None,
    **kwargs: Any,
) -> None:
    """Load a DCP checkpoint into ``state_dict`` in place (each ShardedTensor keeps its mesh and spec),
    all or nothing: the counterpart of ``st.checkpoint.save``.

    Before reading, it raises ``CheckpointNotFoundError`` for a path without a complete checkpoint
    (no directory, no ``.metadata``), ``CheckpointCorruptError`` for a data file shorter than the
    metadata says, and ``CheckpointMismatchError`` naming every key missing on either side
    (``strict=False`` loads the keys both have; ``allow_partial_load=True`` alone keeps the targets
    the checkpoint lacks, ``allow_unexpected_keys=True`` alone skips its extra keys, as in DCP's
    planner) and every shape or dtype that differs (``cast_dtypes=True`` converts). Then ``dcp.load``
    with ``StagedLoadPlanner``: the values go into ``state_dict`` only once every process has read all
    of its part, so a failure anywhere leaves ``state_dict`` unchanged in every process. ``kwargs`` go
    to ``dcp.load`` (e.g. ``storage_reader`` for an fsspec URL).

    It never runs code the checkpoint holds: the metadata is read by an unpickler that builds only
    DCP's metadata classes, and non-tensor values (a step count, a learning rate) with
    ``torch.load(weights_only=True)``; anything else raises ``UnsafeCheckpointError`` naming the
    file or key. Each stored item is checked against the checksum ``st.checkpoint.save`` recorded
    (``CheckpointCorruptError`` naming the key). A ``storage_reader`` of your own skips both
    (DCP's reader unpickles the metadata as it is).

    Example::

        state = {"model": model.state_dict()}
        st.checkpoint.load(state, "ckpt/step_100")
        model.load_state_dict(state["model"])
    """
    import_dcp()
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from shardtensor.checkpoint.planner import staged_load_planner_class

    problem = None
    if kwargs.get("storage_reader") is None and "://" not in str(checkpoint_id):
        problem = _local_problem(os.fspath(checkpoint_id))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        # every process raises, or none does (one alone would leave the others waiting in dcp.load)
        problems: list = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(problems, problem, group=process_group)
        problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise problem
    # (the planner's own keywords, which its CheckpointMismatchError names, override strict)
    allow_partial_load = kwargs.pop("allow_partial_load", not strict)
    allow_unexpected_keys = kwargs.pop("allow_unexpected_keys", not strict)
    planner = staged_load_planner_class()(
        allow_partial_load=allow_partial_load,
        allow_unexpected_keys=allow_unexpected_keys,
        cast_dtypes=cast_dtypes,
        defer_commit=True,
    )
    if kwargs.get("storage_reader") is None:
        kwargs["storage_reader"] = safe_reader(checkpoint_id)
    try:
        dcp.load(state_dict, checkpoint_id=checkpoint_id, planner=planner, process_group=process_group, **kwargs)
    except CheckpointException as failure:
        own = [exc for exc, _ in failure.failures.values() if isinstance(exc, _OWN_ERRORS)]
        if own:
            raise own[0] from failure
        raise
    from torch.distributed.checkpoint.stateful import Stateful

    with deferred_interrupts():  # (all or nothing: a Ctrl-C lands once every target has its value)
        planner.commit()  # (every process has read its part: dcp.load raises everywhere if one failed)
        # dcp.load loaded into a copy of the top level and copied it back before the commit: again
        for key, value in planner.original_state_dict.items():
            if isinstance(state_dict.get(key), Stateful):
                state_dict[key].load_state_dict(value)
            elif key in state_dict:
                state_dict[key] = value


def _local_problem(path: str) -> Exception | None:
    """What makes the local directory ``path`` not a loadable checkpoint (None if nothing)."""
    if not os.path.isdir(path):
        return CheckpointNotFoundError(f"no checkpoint at {path!r}: it does not exist or is not a directory")
    metadata_path = os.path.join(path, ".metadata")
    if not os.path.exists(metadata_path):
        return CheckpointNotFoundError(
            f"{path!r} has no .metadata, so it is not a complete checkpoint (DCP writes the metadata "
            "last: the save that wrote it was interrupted, or it is not a DCP checkpoint)"
        )
    try:
        with open(metadata_path, "rb") as f:
            metadata = read_metadata(f, metadata_path)
        storage = metadata.storage_data
    except UnsafeCheckpointError as error:
        return error
    except Exception as error:
        return CheckpointCorruptError(f"{metadata_path!r} cannot be read ({type(error).__name__}: {error})")
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return CheckpointCorruptError(f"{file!r} is missing: the checkpoint's metadata lists it")
        actual = os.path.getsize(file)
        if actual < size:
            return CheckpointCorruptError(
                f"{file!r} is truncated: {actual} bytes, the checkpoint's metadata needs {size} (write the "
                "checkpoint again, or load an older one)"
            )
    return None
