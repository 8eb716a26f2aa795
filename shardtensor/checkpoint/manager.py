"""``CheckpointManager``: the checkpoints of a training job, one directory per step, saved in DCP's
format (synchronously or in a background thread), pruned to the newest few and loaded back all or
nothing — PyTorch/XLA's ``torch_xla.experimental.distributed_checkpoint.CheckpointManager``.

Layout: ``<path>/<step>/`` is a ``torch.distributed.checkpoint`` directory plus a small
``.manager_metadata`` (JSON: the step and its place in the save order) written last: a directory
without it is an interrupted save, skipped with a warning. ``path`` is a local directory or any
fsspec URL DCP can write to (``memory://``, ``file://``, ``gs://``...).
"""

from __future__ import annotations

import concurrent.futures
import json
import numbers
import os
import posixpath
import threading
import time
import warnings
from typing import Any

from shardtensor import runtime
from shardtensor.checkpoint.lazy_imports import import_dcp
from shardtensor.checkpoint.staging import host_state_dict
from shardtensor.graph import sync
from shardtensor.graph.interrupts import deferred_interrupts

METADATA_NAME = ".manager_metadata"


class CheckpointManager:
    """Saves a training job's state every ``save_interval`` steps into ``path/<step>`` and keeps the
    newest ``max_to_keep`` checkpoints (by save order; 0 keeps all).

    ``save`` writes now; ``save_async`` copies this process's distinct shards to the host (no full
    tensor is gathered) and writes them in a background thread while training goes on: at most
    ``async_queue_size`` saves are pending (another ``save_async`` waits for a slot), and an error in
    the background surfaces as an exception on the next call and at ``join()``. A checkpoint is
    listed by ``all_steps()`` only once it is complete. ``load`` reads a step into a state dict in
    place, into the target's own shardings, all or nothing. ``process_group``: a ``torch.distributed``
    group for DCP's collectives (default: the default group when initialized); with several
    processes one is required, and only rank 0 writes the manager's metadata and deletes old
    checkpoints.

    Example::

        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        manager = st.checkpoint.CheckpointManager("ckpts", save_interval=100, max_to_keep=3)
        if manager.all_steps():                               # resume
            start = max(manager.all_steps())
            model_sd, optim_sd = get_state_dict(model, opt)
            manager.load(start, {"model": model_sd, "optim": optim_sd})
            set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        for step in range(start + 1, n_steps + 1):
            train_step(...)
            if manager.should_save(step):
                model_sd, optim_sd = get_state_dict(model, opt)
                manager.save_async(step, {"model": model_sd, "optim": optim_sd})
        manager.join()
    """

    def __init__(
        self,
        path: str | os.PathLike,
        save_interval: int,
        max_to_keep: int = 0,
        async_queue_size: int = 1,
        process_group: Any = None,
    ) -> None:
        import_dcp()  # (what its calls import, whole: a Ctrl-C cannot leave it half imported)
        import fsspec  # type: ignore[import-untyped]  # (a dependency of torch)

        _check_int("save_interval", save_interval, minimum=1)
        _check_int("max_to_keep", max_to_keep, minimum=0, note="0 keeps every checkpoint")
        _check_int("async_queue_size", async_queue_size, minimum=1)
        self.path = os.fspath(path)
        self.save_interval = save_interval
        self.max_to_keep = max_to_keep
        self.async_queue_size = async_queue_size
        self.process_group = process_group
        self._is_url = "://" in self.path
        self._fs, self._root = fsspec.core.url_to_fs(self.path)
        self._rank = _rank(process_group)
        self._lock = threading.Lock()  # guards the tracked list and the errors (the writer thread updates them)
        self._slots = threading.Semaphore(async_queue_size)
        self._pending: list[concurrent.futures.Future] = []
        self._errors: list[tuple[int, BaseException]] = []
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        # [(save_index, step)] of the complete checkpoints, oldest save first
        self._tracked: list[tuple[int, int]] = self._scan()

    # --- public -----------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a save step (a multiple of ``save_interval``).

        Example::

            CheckpointManager("ckpts", save_interval=10).should_save(20)   # True
        """
        return step % self.save_interval == 0

    def save(self, step: int, state_dict: dict, force: bool = False) -> bool:
        """Write ``state_dict`` to ``path/<step>`` now, if ``should_save(step)`` or ``force``;
        returns whether it saved. Waits for pending ``save_async`` writes first, runs pending device
        work (``st.sync()``), replaces a checkpoint already at that step, then prunes to
        ``max_to_keep``.

        Example::

            manager.save(step, {"model": model.state_dict()})
        """
        step = _check_step(step)
        self._raise_background_error()
        if not (force or self.should_save(step)):
            return False
        self._wait_pending()
        self._raise_background_error()
        sync()
        self._write(step, state_dict)
        return True

    def save_async(self, step: int, state_dict: dict, force: bool = False) -> bool:
        """Like ``save``, but only the device-to-host copy happens now (each process copies its
        distinct shards, once each); the write runs in a background thread. Waits while
        ``async_queue_size`` saves are pending. The checkpoint is listed by ``all_steps()`` once
        written; an error while writing is raised by the next call of this manager and by ``join()``.

        Example::

            manager.save_async(step, {"model": model.state_dict()})
            ...
            manager.join()
        """
        step = _check_step(step)
        self._raise_background_error()
        if not (force or self.should_save(step)):
            return False
        from shardtensor.checkpoint.atomic import check_values

        check_values(state_dict, "")  # (here, not in the background: the error reaches the caller)
        # A slot taken is given back unless a write took it over, whatever interrupts this (a Ctrl-C
        # between taking it and noting it would leave one slot fewer: later saves would wait for ever)
        taken = handed = False
        try:
            while not taken:  # (a slot frees when a pending write ends; a Ctrl-C lands within 50 ms)
                with deferred_interrupts():
                    taken = self._slots.acquire(timeout=0.05)
            self._raise_background_error()
            sync()
            host_copy = host_state_dict(state_dict)  # (this process's distinct shards, on the host)
            if self._writer is None:
                self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shardtensor-checkpoint")
            with deferred_interrupts():  # (a write submitted is a write join() waits for)
                future = self._writer.submit(self._write_in_background, step, host_copy)
                handed = True
                with self._lock:
                    self._pending = [f for f in self._pending if not f.done()] + [future]
        except BaseException:
            if taken and not handed:
                self._slots.release()
            raise
        return True

    def load(self, step: int, state_dict: dict, *, strict: bool = True, **kwargs: Any) -> None:
        """Read checkpoint ``step`` into ``state_dict`` in place with ``st.checkpoint.load``: each
        tensor keeps its own mesh and spec (any sharding, or CPU tensors); checked first (missing or
        unexpected keys — ``strict=False`` loads the keys both have —, shapes, dtypes, files) and all
        or nothing: after a failed load the targets are unchanged. Waits for pending saves.
        ``kwargs`` go to ``st.checkpoint.load``.

        Example::

            model_sd, optim_sd = get_state_dict(model, opt)
            manager.load(max(manager.all_steps()), {"model": model_sd, "optim": optim_sd})
            set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        """
        from shardtensor.checkpoint.loading import load

        self._wait_pending()
        self._raise_background_error()
        steps = self.all_steps()
        if step not in steps:
            raise ValueError(
                f"no checkpoint of step {step} in {self.path}: the steps available are {steps}"
                + ("" if steps else " (none yet)")
            )
        load(state_dict, self._url(str(step)), strict=strict, process_group=self.process_group, **kwargs)

    restore = load  # (PyTorch/XLA's name)

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints, sorted.

        Example::

            manager.all_steps()   # [200, 300, 400]
        """
        self._raise_background_error()
        with self._lock:
            return sorted(step for _, step in self._tracked)

    def join(self) -> None:
        """Wait for every pending ``save_async`` write; raises the first error one of them hit.

        Example::

            manager.join()
        """
        self._wait_pending()
        self._raise_background_error()

    # --- writing ----------------------------------------------------------------------------------
    def _write_in_background(self, step: int, host_copy: dict) -> None:
        try:
            self._write(step, host_copy)
        except BaseException as error:
            with self._lock:
                self._errors.append((step, error))
        finally:
            self._slots.release()

    def _write(self, step: int, state_dict: dict) -> None:
        """Write ``path/<step>`` (DCP's files, then the manager's metadata), track it, prune."""
        name = str(step)
        if not self._is_url:
            from shardtensor.checkpoint.atomic import save as atomic_save

            self._fs.makedirs(self._root, exist_ok=True)
            atomic_save(state_dict, os.path.join(self.path, name), process_group=self.process_group)
        else:
            self._write_through_fsspec(name, state_dict)
        with self._lock:
            save_index = max((i for i, _ in self._tracked), default=0) + 1
        if self._rank == 0:  # the last file: the checkpoint is complete
            metadata = {"step": step, "save_index": save_index, "time": time.time()}
            self._fs.pipe_file(self._fs_path(name, METADATA_NAME), json.dumps(metadata).encode())
        with self._lock:
            self._tracked = [(i, s) for i, s in self._tracked if s != step] + [(save_index, step)]
            doomed = self._tracked[: -self.max_to_keep] if self.max_to_keep else []
            self._tracked = self._tracked[len(doomed) :]
        if self._rank == 0:
            for _, old in doomed:
                self._delete(str(old))
        self._barrier()

    def _write_through_fsspec(self, name: str, state_dict: dict) -> None:
        """DCP into ``.<step>.partial``, then renamed to ``<step>`` by rank 0 (the previous checkpoint
        of that step, if any, stays until then)."""
        import torch.distributed.checkpoint as dcp

        from shardtensor.checkpoint.atomic import check_values
        from shardtensor.checkpoint.safe_reading import record_checksums

        partial, old = f".{name}.partial", f".{name}.old"
        if self._rank == 0:
            for leftover in (partial, old):
                if self._fs.exists(self._fs_path(leftover)):
                    self._fs.rm(self._fs_path(leftover), recursive=True)
        self._barrier()
        check_values(state_dict, "")
        dcp.save(state_dict, checkpoint_id=self._url(partial), process_group=self.process_group)
        if self._rank == 0:
            record_checksums(self._url(partial))
            final = self._fs_path(name)
            if self._fs.exists(final):
                self._fs.mv(final, self._fs_path(old), recursive=True)
            self._fs.mv(self._fs_path(partial), final, recursive=True)
            if self._fs.exists(self._fs_path(old)):
                self._delete(old)
        self._barrier()

    def _delete(self, name: str) -> None:
        # the manager's metadata first: a deletion cut short leaves a directory the scan skips
        metadata = self._fs_path(name, METADATA_NAME)
        if self._fs.exists(metadata):
            self._fs.rm(metadata)
        self._fs.rm(self._fs_path(name), recursive=True)

    # --- reading the directory --------------------------------------------------------------------
    def _scan(self) -> list[tuple[int, int]]:
        """[(save_index, step)] of the valid checkpoints under ``path``, in save order; the invalid
        ones (no or bad manager metadata, no DCP metadata) are skipped with a warning."""
        if not self._fs.exists(self._root):
            return []
        found = []
        for entry in self._fs.ls(self._root, detail=True):
            name = posixpath.basename(entry["name"].rstrip("/"))
            if entry["type"] != "directory" or name.startswith("."):
                continue  # (hidden: a save in progress or cut short)
            problem, save_index = self._check_checkpoint(name)
            if problem:
                warnings.warn(f"CheckpointManager: skipping {self._url(name)}: {problem}", stacklevel=3)
            else:
                found.append((save_index, int(name)))
        return sorted(found)

    def _check_checkpoint(self, name: str) -> tuple[str | None, int]:
        if not name.lstrip("-").isdigit():
            return "its name is not a step number", 0
        if not self._fs.exists(self._fs_path(name, METADATA_NAME)):
            return f"no {METADATA_NAME} (a save that did not finish)", 0
        if not self._fs.exists(self._fs_path(name, ".metadata")):
            return "no DCP .metadata (not a complete torch.distributed.checkpoint)", 0
        try:
            metadata = json.loads(self._fs.cat_file(self._fs_path(name, METADATA_NAME)))
            step, save_index = metadata["step"], metadata["save_index"]
        except (ValueError, KeyError, TypeError) as error:
            return f"unreadable {METADATA_NAME} ({error!r})", 0
        if step != int(name):
            return f"its {METADATA_NAME} says step {step}", 0
        return None, int(save_index)

    # --- helpers ----------------------------------------------------------------------------------
    def _url(self, name: str) -> str:
        """What DCP is given: a local path, or a URL of the same scheme as ``path``."""
        if self._is_url:
            return self.path.rstrip("/") + "/" + name
        return os.path.join(self.path, name)

    def _fs_path(self, *names: str) -> str:
        return posixpath.join(self._root, *names)

    def _wait_pending(self) -> None:
        # (the writes stay pending until they are done: an interrupted wait leaves them to the next)
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]

    def _raise_background_error(self) -> None:
        with self._lock:
            if not self._errors:
                return
            (step, error), *rest = self._errors
            self._errors.clear()
        more = f" ({len(rest)} later background saves failed too)" if rest else ""
        raise RuntimeError(
            f"CheckpointManager: the background save of step {step} to {self._url(str(step))} failed: "
            f"{type(error).__name__}: {error}{more}. Step {step} is not saved."
        ) from error

    def _barrier(self) -> None:
        if _world_size(self.process_group) > 1:
            import torch.distributed as dist

            dist.barrier(group=self.process_group)


def _check_step(step: Any) -> int:
    """A step is a non-negative integer (a numpy integer too, returned as an int)."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(
            f"CheckpointManager: a step is a non-negative int (it names the checkpoint's directory), got "
            f"{type(step).__name__} {step!r}"
        )
    if step < 0:
        raise ValueError(f"CheckpointManager: a step is a non-negative int, got {step!r}")
    return int(step)


def _check_int(name: str, value: Any, minimum: int, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        note = f" ({note})" if note else ""
        raise ValueError(f"CheckpointManager: {name} must be an int >= {minimum}{note}, got {value!r}")


def _dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _world_size(process_group: Any) -> int:
    if process_group is None and not _dist_initialized():
        return 1
    import torch.distributed as dist

    return dist.get_world_size(process_group)


def _rank(process_group: Any) -> int:
    """This process's rank among the savers; checks that several processes have a process group."""
    if process_group is not None or _dist_initialized():
        import torch.distributed as dist

        return dist.get_rank(process_group)
    if runtime.process_count() > 1:
        raise RuntimeError(
            f"CheckpointManager: this job runs {runtime.process_count()} processes but torch.distributed "
            "is not initialized: DCP needs a process group to agree on the plan. Call "
            "torch.distributed.init_process_group('gloo', ...) next to st.initialize_distributed, or "
            "pass process_group="
        )
    return 0
