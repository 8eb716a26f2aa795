"""``MpDeviceLoader``: background threads read a data loader and upload its batches, sharded, ahead
of the training loop, which syncs every ``batches_per_execution`` batches.

Threads and their queues (every wait has a timeout and checks a stop flag, so nothing hangs)::

    reader thread --(CPU batches, loader_prefetch_size)--> transfer threads
        --(uploaded batches, device_prefetch_size)--> main thread: wraps them as ShardedTensors

Uploading is jax alone (``jax.make_array_from_callback`` is thread-safe); creating ShardedTensors
touches shardtensor's lazy-graph state (cell serial numbers, the pending table, counters), which is
not thread-safe, so the main thread does that part in ``__next__``.
"""

from __future__ import annotations

import atexit
import copy
import itertools
import queue
import threading
import traceback
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Any, cast

import torch

from shardtensor.data.batches import Layouts, wrap_batch
from shardtensor.graph import sync
from shardtensor.tensor.device import device as st_device

if TYPE_CHECKING:
    from shardtensor.sharding import ShardingSpec

_POLL = 0.05  # seconds between checks of the stop flag while a thread waits on a queue
_JOIN_TIMEOUT = 2.0  # how long a restart or close() waits for the previous threads


class _Signal:
    """A marker no batch can be (a batch may be None, a string, any object: it passes through)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"<{self.name}>"


_END = _Signal("end of the loader")
_STOPPED = _Signal("stopped")  # get()'s answer once the pipeline stopped
_serial = itertools.count()
_LIVE: weakref.WeakSet = weakref.WeakSet()  # pipelines whose threads may still run


@atexit.register
def _stop_all() -> None:
    """At exit, stop and join every pipeline before jax tears its runtime down (registered after jax
    is imported, so it runs first): a thread still uploading then would abort the process."""
    for pipeline in list(_LIVE):
        pipeline.stop(join_timeout=_JOIN_TIMEOUT)


def _start_iterating(loader):
    """``iter(loader)``, on the calling thread, where a torch DataLoader starts its workers.

    Forked workers are safe here: they run the loader's CPU code, torch skips seeding the device in
    them (``torch.shardtensor._is_in_bad_fork()``), and shardtensor raises at once if a worker uses
    it. JAX still warns at every fork of a process running it that the copy may deadlock, so that
    one warning is held back around this call (a ``catch_warnings`` block: hence the calling thread).
    """
    if not (isinstance(loader, torch.utils.data.DataLoader) and loader.num_workers):
        return iter(loader)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        return iter(loader)


def _release_after_failure(error: BaseException) -> None:
    """Drop the references an error's traceback holds to the loader's iterator.

    The frames below the reader (the iterator's own methods) keep it alive, and once re-raised the
    error usually sits in a reference cycle, so the iterator would go only at the next garbage
    collection. A torch DataLoader iterator dropped that way cannot tell its workers to stop (the
    collector closes its queues first): it then waits 5 s for each worker before killing it, and
    the workers linger until then. Clearing those frames' locals lets the iterator go at once (the
    traceback keeps its file and line information).
    """
    if error.__traceback__ is not None:
        traceback.clear_frames(error.__traceback__.tb_next)


class _Failure:
    """An exception raised on a worker thread, to re-raise on the main thread."""

    def __init__(self, error: BaseException, where: str):
        self.error, self.where = error, where

    def reraise(self):
        error = self.error
        note = f"(raised in an MpDeviceLoader background thread while {self.where})"
        try:
            twin = copy.copy(error)
            same = type(twin) is type(error) and str(twin) == str(error)
        except Exception:  # noqa: BLE001 — an exception type that cannot be rebuilt from its args
            same = False
        if not same:  # cannot be rebuilt: raise the original (its traceback shows the worker's frames)
            error.add_note(note)
            raise error
        twin.__notes__ = [*getattr(error, "__notes__", ()), note]
        raise twin from error  # same type and message; the worker's traceback is chained


class _Pipeline:
    """The threads and queues of one iteration over the loader."""

    def __init__(self, batches, layouts: Layouts, loader_prefetch_size, device_prefetch_size, transfer_threads):
        self.stopped = threading.Event()
        self.cpu_queue: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=loader_prefetch_size)
        self.device_queue: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=device_prefetch_size)
        # batch index -> uploaded batch, _END or _Failure (transfer threads may reorder)
        self.ready: dict[int, Any] = {}
        name = f"MpDeviceLoader-{next(_serial)}"
        self.threads = [
            threading.Thread(target=self._read, args=([batches], transfer_threads), name=f"{name}-reader", daemon=True)
        ]
        self.threads += [
            threading.Thread(target=self._transfer, args=(layouts,), name=f"{name}-transfer-{i}", daemon=True)
            for i in range(transfer_threads)
        ]
        _LIVE.add(self)
        for t in self.threads:
            t.start()

    # --- worker threads ---
    def _put(self, q, item) -> bool:
        """Put ``item`` on ``q`` unless the pipeline stops first."""
        while not self.stopped.is_set():
            try:
                q.put(item, timeout=_POLL)
                return True
            except queue.Full:
                pass
        return False

    def _read(self, source: list, transfer_threads):
        # The loader's iterator comes in a box this thread empties, so that this frame holds the only
        # reference (see _release_after_failure).
        batches = source.pop()
        index = 0
        final: _Signal | _Failure
        try:
            while not self.stopped.is_set():
                try:
                    batch = next(batches)
                except StopIteration:
                    final = _END
                    break
                if not self._put(self.cpu_queue, (index, batch)):
                    return
                del batch
                index += 1
            else:
                return
        except BaseException as error:  # noqa: BLE001 — handed to the main thread
            _release_after_failure(error)
            del batches  # the last reference: a torch DataLoader iterator shuts its workers down here
            final = _Failure(error, f"reading batch {index} from the loader")
        for _ in range(transfer_threads):  # one each: every transfer thread stops at it
            if not self._put(self.cpu_queue, (index, final)):
                return

    def _transfer(self, layouts):
        while not self.stopped.is_set():
            try:
                index, item = self.cpu_queue.get(timeout=_POLL)
            except queue.Empty:
                continue
            if item is _END or isinstance(item, _Failure):
                self._put(self.device_queue, (index, item))
                return
            try:
                out = layouts.upload_batch(item)
            except BaseException as error:  # noqa: BLE001 — handed to the main thread
                out = _Failure(error, f"moving batch {index} to the devices")
            del item
            if not self._put(self.device_queue, (index, out)):
                return

    # --- main thread ---
    def get(self, index):
        """The uploaded batch ``index`` (or _END / a _Failure), waiting for it; _STOPPED once stopped."""
        while index not in self.ready:
            if self.stopped.is_set():
                return _STOPPED
            try:
                i, item = self.device_queue.get(timeout=_POLL)
            except queue.Empty:
                if not any(t.is_alive() for t in self.threads) and self.device_queue.empty():
                    return _Failure(
                        RuntimeError(f"MpDeviceLoader's threads ended without handing over batch {index}"), "finishing"
                    )
                continue
            self.ready.setdefault(i, item)
        return self.ready.pop(index)

    def stop(self, join_timeout: float = 0.0) -> None:
        """Stop the threads (they notice within ~_POLL s) and drop the batches they prepared."""
        self.stopped.set()
        for q in (self.cpu_queue, self.device_queue):
            try:
                while True:
                    q.get_nowait()
            except queue.Empty:
                pass
        self.ready.clear()
        if join_timeout > 0:
            for t in self.threads:
                if t is not threading.current_thread():
                    t.join(join_timeout)


class _DeviceIterator:
    """One pass over an MpDeviceLoader: batches in the loader's order, on the devices."""

    def __init__(self, owner, pipeline: _Pipeline, batches_per_execution: int):
        self._owner = owner  # the MpDeviceLoader lives as long as its iterator (`for b in MpDeviceLoader(...)`)
        self._pipeline = pipeline
        self._every = batches_per_execution
        self._index = 0
        self._done = False

    def __iter__(self) -> _DeviceIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        synced = self._index % self._every == 0
        if synced:
            sync()  # the steps recorded since the last sync run as one execution
        item = self._pipeline.get(self._index)
        if item is _STOPPED:  # a newer iter() or close() replaced this iteration
            self._finish()
            raise StopIteration
        if item is _END:
            self._finish()
            if not synced:
                sync()  # the last steps
            raise StopIteration
        if isinstance(item, _Failure):
            self._finish()
            item.reraise()
        self._index += 1
        return wrap_batch(item)

    def _finish(self):
        self._done = True
        self._pipeline.stop()

    def __del__(self):
        pipeline = getattr(self, "_pipeline", None)
        if pipeline is not None:
            pipeline.stop()


class MpDeviceLoader:
    """Wrap a data loader so its batches arrive on ``st.device()``, sharded, prefetched by threads.

    Each tensor of a batch is uploaded as ``input_sharding`` says: a ``ShardingSpec`` applies to
    every tensor of its rank (tensors of other ranks go replicated); a dict of ``ShardingSpec``s
    applies to a dict batch key by key (a non-dict batch is a ValueError, a batch key that holds
    tensors but has no spec a KeyError); ``None`` uploads everything replicated. Torch CPU tensors
    move; other leaves pass through; tuples, lists, named tuples and mappings are walked. Uneven
    batches keep their shape (stored padded). ``ShardingSpec(..., minibatch=True)`` treats each
    process's batch as its slice of the global batch (its size must divide over the shards of
    dimension 0 on this process's devices).

    Iterating syncs (``st.sync()``) before handing out batches 0, k, 2k, ... (k =
    ``batches_per_execution``) and at the end (once), so whatever was recorded before the loop runs
    on its own and then every k training steps run as one execution. (PyTorch/XLA syncs before
    batches k-1, 2k-1, ..., which groups the first k-1 steps apart for k > 1, and twice at the end.)

    ``len()`` is the loader's. Each ``iter()`` starts afresh and stops the previous iteration's
    threads (its iterator then ends), as do leaving the loop early, deleting the loader and
    ``close()``. An exception raised by the loader, or while uploading, is raised by ``next()`` in
    the loop (same type and message, the worker's traceback chained), after the batches before it;
    one raised by ``iter(loader)`` itself, by ``iter()``.

    A torch DataLoader may fork its worker processes (the default start method on Linux): they run
    the dataset's CPU code while this process runs JAX. A worker that uses a shardtensor tensor
    raises a RuntimeError naming the fix, instead of waiting for JAX threads the fork left behind.

    ``loader_prefetch_size`` CPU batches and ``device_prefetch_size`` uploaded batches are kept
    ready; ``host_to_device_transfer_threads`` threads upload.

    Example::

        mesh = st.Mesh(range(8), (8,), ("data",))
        loader = st.MpDeviceLoader(torch_loader, st.device(),
                                   input_sharding=st.ShardingSpec(mesh, ("data", None)))
        for x, y in loader:
            loss = F.cross_entropy(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        loader: Iterable[Any],
        device: torch.device | str,
        *,
        input_sharding: ShardingSpec | Mapping[Any, ShardingSpec] | None = None,
        loader_prefetch_size: int = 16,
        device_prefetch_size: int = 8,
        host_to_device_transfer_threads: int = 1,
        batches_per_execution: int = 1,
    ):
        target = st_device()
        if not isinstance(device, (torch.device, str)) or torch.device(device).type != target.type:
            raise ValueError(f"MpDeviceLoader moves batches to st.device() ({target}); got device={device!r}.")
        sizes = {
            "loader_prefetch_size": loader_prefetch_size,
            "device_prefetch_size": device_prefetch_size,
            "host_to_device_transfer_threads": host_to_device_transfer_threads,
            "batches_per_execution": batches_per_execution,
        }
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MpDeviceLoader: {name} must be a positive integer, got {value!r}.")
        Layouts(input_sharding)  # check input_sharding now rather than at the first batch
        self._loader = loader
        self._device = target
        self._input_sharding = input_sharding
        self._sizes = sizes
        self._pipeline: _Pipeline | None = None

    @property
    def loader(self) -> Iterable[Any]:
        """The wrapped data loader (e.g. to call ``loader.sampler.set_epoch(epoch)``)."""
        return self._loader

    def __len__(self) -> int:
        return len(cast(Sized, self._loader))  # (a TypeError for a loader without len(), as torch's)

    def __iter__(self) -> Iterator[Any]:
        self.close()
        s = self._sizes
        self._pipeline = _Pipeline(
            _start_iterating(self._loader),  # (no local here: the reader thread must hold the only reference)
            Layouts(self._input_sharding),
            s["loader_prefetch_size"],
            s["device_prefetch_size"],
            s["host_to_device_transfer_threads"],
        )
        return _DeviceIterator(self, self._pipeline, s["batches_per_execution"])

    def close(self) -> None:
        """Stop the background threads of the current iteration (waiting briefly for them).

        Example::

            loader.close()   # e.g. before a long evaluation, to free the prefetched batches
        """
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            pipeline.stop(join_timeout=_JOIN_TIMEOUT)

    def __del__(self):
        pipeline = getattr(self, "_pipeline", None)
        if pipeline is not None:
            pipeline.stop()
