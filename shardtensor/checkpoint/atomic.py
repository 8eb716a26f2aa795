"""An atomic ``dcp.save``: a temporary directory renamed into place when complete."""

from __future__ import annotations

import os
import pathlib
import shutil
from typing import Any

from shardtensor import runtime


def save(state_dict: dict, checkpoint_id: str | os.PathLike, *, process_group: Any = None, **kwargs: Any) -> None:
    """``dcp.save`` made atomic: writes into a temporary directory next to ``checkpoint_id`` and renames
    it into place only when the save (metadata last) finished, so an exception or a killed process
    leaves the previous checkpoint at ``checkpoint_id`` readable and no half-written one there.

    With several processes (a ``torch.distributed`` group: ``process_group``, or the default one),
    call it in every process: each writes its shards into the same temporary directory (on a file
    system they all see), then process 0 renames it, and every process returns once the checkpoint is
    in place. Local paths (and shared mounts) only. ``kwargs`` go to ``dcp.save``.

    Example::

        st.checkpoint.save({"model": model.state_dict()}, "ckpt/step_100")
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if "://" in str(checkpoint_id):
        raise ValueError(
            f"shardtensor.checkpoint.save renames a local directory; {checkpoint_id!r} is a URL: call "
            "torch.distributed.checkpoint.save directly (not atomic)"
        )
    grouped = dist.is_available() and dist.is_initialized()
    ranks = dist.get_world_size(process_group) if grouped else 1
    if runtime.process_count() > 1 and ranks == 1:
        raise RuntimeError(
            f"shardtensor.checkpoint.save: this job has {runtime.process_count()} processes but no "
            "torch.distributed process group of them; call torch.distributed.init_process_group('gloo', "
            "...) in every process first, so the processes can agree on the checkpoint"
        )
    coordinator = not grouped or dist.get_rank(process_group) == 0
    path = pathlib.Path(checkpoint_id)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if coordinator:
        shutil.rmtree(tmp, ignore_errors=True)
    if ranks > 1:  # everyone writes into the coordinator's temporary directory
        names = [tmp.name]
        dist.broadcast_object_list(names, src=_first_rank(process_group), group=process_group)
        tmp = path.with_name(names[0])
    try:
        dcp.save(state_dict, checkpoint_id=tmp, process_group=process_group, **kwargs)
    except BaseException:
        if coordinator:  # (dcp.save raises in every process when one fails)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    error = None
    if coordinator:
        try:
            _replace(tmp, path)
        except OSError as e:
            error = f"shardtensor.checkpoint.save could not rename {tmp} to {path}: {e}"
    if ranks > 1:  # every process returns once the checkpoint is in place (or raises the same error)
        outcome = [error]
        dist.broadcast_object_list(outcome, src=_first_rank(process_group), group=process_group)
        error = outcome[0]
    if error is not None:
        raise OSError(error)


def _replace(tmp: pathlib.Path, path: pathlib.Path) -> None:
    """``tmp`` becomes ``path``; a previous ``path`` is removed once the new one is there."""
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.exists():
        os.replace(path, old)  # (a directory cannot be renamed over a non-empty one)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _first_rank(process_group: Any) -> int:
    """The global rank of the group's rank 0 (the one that renames)."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None  # (the default group exists: the caller checked dist.is_initialized())
    return dist.get_global_rank(group, 0)
