"""An atomic ``dcp.save``: a temporary directory renamed into place when complete."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
from collections.abc import Mapping
from typing import Any

import torch

from shardtensor import runtime
from shardtensor.checkpoint.lazy_imports import import_dcp
from shardtensor.checkpoint.safe_reading import check_value_savable, record_checksums
from shardtensor.graph.interrupts import deferred_interrupts


def save(state_dict: dict, checkpoint_id: str | os.PathLike, *, process_group: Any = None, **kwargs: Any) -> None:
    """``dcp.save`` made atomic: writes into a temporary directory next to ``checkpoint_id`` and renames
    it into place only when the save (metadata last) finished, so an exception or a killed process
    leaves the previous checkpoint at ``checkpoint_id`` readable and no half-written one there.

    With several processes (a ``torch.distributed`` group: ``process_group``, or the default one),
    call it in every process: each writes its shards into the same temporary directory (on a file
    system they all see), then process 0 renames it, and every process returns once the checkpoint is
    in place. Local paths (and shared mounts) only. ``kwargs`` go to ``dcp.save``.

    Beyond ``dcp.save``: it records a checksum of each stored item (``st.checkpoint.load`` checks
    them); it refuses a non-tensor value that could be read back only by running code (``TypeError``
    naming the key: save plain values); it refuses to replace anything at ``checkpoint_id`` that is
    not a checkpoint (a file, a directory without ``.metadata``); and it removes what saves to the
    same path killed on this machine left (their hidden ``.<name>.tmp-...`` directories).

    Example::

        st.checkpoint.save({"model": model.state_dict()}, "ckpt/step_100")
    """
    import_dcp()
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
    check_values(state_dict, "")
    tmp = path.with_name(f".{path.name}.tmp-{owner_tag()}")
    problem = None
    if coordinator:
        _clean_leftovers(path)
        problem = _not_a_checkpoint(path)
        if problem is None:
            shutil.rmtree(tmp, ignore_errors=True)
    if ranks > 1:  # every process raises, or none does; all write into the coordinator's directory
        shared: list = [problem, tmp.name]
        dist.broadcast_object_list(shared, src=_first_rank(process_group), group=process_group)
        problem, tmp = shared[0], path.with_name(shared[1])
    if problem is not None:
        raise FileExistsError(problem)
    try:
        dcp.save(state_dict, checkpoint_id=tmp, process_group=process_group, **kwargs)
    except BaseException:
        if coordinator:  # (dcp.save raises in every process when one fails)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    error = None
    if coordinator:  # (every process has written: DCP's metadata is the last file)
        try:
            record_checksums(tmp)
            with deferred_interrupts():  # (a Ctrl-C lands once the new checkpoint is in place)
                _replace(tmp, path)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"shardtensor.checkpoint.save could not put {tmp} in place as {path}: {type(e).__name__}: {e}"
    if ranks > 1:  # every process returns once the checkpoint is in place (or raises the same error)
        outcome = [error]
        dist.broadcast_object_list(outcome, src=_first_rank(process_group), group=process_group)
        error = outcome[0]
    if error is not None:
        raise OSError(error)


def _replace(tmp: pathlib.Path, path: pathlib.Path) -> None:
    """``tmp`` becomes ``path``; a previous ``path`` is removed once the new one is there. Whatever
    interrupts it (Ctrl-C too), ``path`` is the old checkpoint or the new one, and nothing is left."""
    old = path.with_name(f".{path.name}.old-{owner_tag()}")
    shutil.rmtree(old, ignore_errors=True)  # (a rename onto a non-empty directory fails)
    try:
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException:
        if old.exists() and not path.exists():
            os.replace(old, path)  # the previous checkpoint back in place
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def owner_tag() -> str:
    """What names this process's temporary directories: the machine and the process id."""
    return f"{socket.gethostname()}-{os.getpid()}"


def leftovers(path: pathlib.Path, kind: str) -> list[pathlib.Path]:
    """The ``.<name>.<kind>-<host>-<pid>`` entries next to ``path`` whose process (on this machine)
    is gone: what saves that were killed left behind."""
    prefix = f".{path.name}.{kind}-{socket.gethostname()}-"
    if not path.parent.is_dir():
        return []
    found = []
    for entry in path.parent.iterdir():
        pid = entry.name[len(prefix) :]
        if entry.name.startswith(prefix) and pid.isdigit() and not alive_here(int(pid)):
            found.append(entry)
    return found


def _clean_leftovers(path: pathlib.Path) -> None:
    """Remove what killed saves to ``path`` on this machine left: their temporary directories, and
    the previous checkpoint moved aside (put back in place if ``path`` is gone)."""
    for entry in leftovers(path, "old"):
        if not path.exists() and (entry / ".metadata").exists():
            os.replace(entry, path)  # (killed between its two renames: the last good checkpoint)
        else:
            shutil.rmtree(entry, ignore_errors=True)
    for entry in leftovers(path, "tmp"):
        shutil.rmtree(entry, ignore_errors=True)


def alive_here(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (this process does not count: what it left behind
    is from a save that ended)."""
    if pid == os.getpid():
        return False  # (this process: a save of its own that was interrupted)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # (another user's process)
    return True


def _not_a_checkpoint(path: pathlib.Path) -> str | None:
    """Why ``path`` must not be replaced (it is not a checkpoint), or None."""
    if path.is_dir() and not (path / ".metadata").exists() and any(path.iterdir()):
        return (
            f"shardtensor.checkpoint.save: {path} is a directory that is not a checkpoint (no .metadata), "
            "and a save replaces what is at its path: remove it or save elsewhere"
        )
    if path.exists() and not path.is_dir():
        return (
            f"shardtensor.checkpoint.save: {path} is a file, not a checkpoint, and a save replaces what is "
            "at its path: remove it or save elsewhere"
        )
    return None


def check_values(value: Any, key: str) -> None:
    """Each non-tensor value of the state dict must load back without running code (DCP pickles it)."""
    from torch.distributed.checkpoint.stateful import Stateful

    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, Stateful) and not isinstance(value, Mapping):
        value = value.state_dict()
    if isinstance(value, Mapping):
        for k, v in value.items():
            check_values(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor | Mapping | list | tuple) for v in value):
        for i, v in enumerate(value):
            check_values(v, f"{key}.{i}")
    else:
        check_value_savable(key, value)


def _first_rank(process_group: Any) -> int:
    """The global rank of the group's rank 0 (the one that renames)."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None  # (the default group exists: the caller checked dist.is_initialized())
    return dist.get_global_rank(group, 0)
