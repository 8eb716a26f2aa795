"""The engine's state: the mode flags and the cells whose values are pending.

Ops record nodes and give cells ``Pending`` values (``set_pending``); a run gives them concrete ones
(``set_concrete``, or the execution's outputs). ``pending_cells()`` is what the next ``sync()``
computes. ``STATE`` holds the mode: eager, tracing (inside ``st.compile``), why a trace cannot be
replayed, and the guard that ``compile(full_graph=True)`` sets against any execution.

Threads: the mode and the pending cells are per thread (``STATE`` is a ``threading.local``), as in
PyTorch/XLA, so each thread records and syncs its own graph. What threads share — cells, the
executable cache, the random key — is changed only under ``ENGINE_LOCK``, which the dispatch entry,
runs and replays hold (one op or one run at a time; Python's GIL serializes that work anyway).
Donating a buffer is allowed only when no other thread has pending work that might read it.

64-bit types: every engine entry (``locked``: the dispatch entry, runs, replays, the random key,
annotations) runs with JAX's 64-bit types on in its thread (``runtime.x64_scope``), and only there:
the user's JAX keeps its own setting.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
import weakref

from shardtensor.graph.ir import Cell, Pending
from shardtensor.runtime import with_x64

ENGINE_LOCK = threading.RLock()  # re-entrant: a run may start inside an op (.item(), eager mode)
_THREAD_PENDING: list = []  # weak references to every thread's pending dict
_EPOCH = [0]  # shared by all threads: any run invalidates every view cache


def locked(fn):
    """``fn`` is an engine entry: it runs holding ``ENGINE_LOCK``, with JAX's 64-bit types on in this
    thread (``runtime.with_x64``; torch's int64 / float64 need them) and the user's setting back after.

    Example::

        @locked
        def manual_seed(seed): ...
    """

    return with_x64(fn, lock=ENGINE_LOCK)  # (also checks first that the process was not forked)


class _PendingCells(dict):
    """A thread's pending cells: weak reference to cell -> the cell's serial.

    Keyed by the weak reference so that a dying cell removes itself through a one-line callback; a
    ``WeakValueDictionary`` costs about 1 us of Python per recorded op. Read it only through a
    ``copy()``: a cell may die (and leave) at any allocation.
    """

    __slots__ = ("__weakref__", "drop")

    def __init__(self):
        super().__init__()
        # a reference's callback (a reference another thread's copy still holds may be gone from here)
        self.drop = lambda ref, pop=self.pop: pop(ref, None)

    def cells(self) -> list:
        """The live cells, in no particular order."""
        return [c for c in (r() for r in self.copy()) if c is not None]


# why a trace that reads a device value on the host cannot be replayed without its Python
HOST_READ = "it reads a device value on the host (.item(), .tolist(), .cpu(), bool(), printing, a data-dependent shape)"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def note_host_read() -> None:
    """An st.compile trace read a device value on the host: it cannot be replayed without its
    Python. The reason names the line outside shardtensor that read it."""
    STATE.host_reads += 1
    if STATE.trace_broken is None:
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None and (
            frame.f_code.co_filename.startswith(_PACKAGE_DIR) or frame.f_code.co_filename.endswith("torch/_ops.py")
        ):
            frame = frame.f_back
        where = f" at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None else ""
        STATE.trace_broken = HOST_READ + where


class _State(threading.local):
    """The calling thread's engine state (class attributes are each new thread's defaults)."""

    eager = False
    tracing = False  # inside compile(): record everything, run nothing until the end
    trace_broken: str | None = None  # why the current compile() trace cannot be replayed without Python
    # the current compile() trace's uploads of CPU tensors: (the CPU tensor, how it was uploaded, the
    # new cell), so that a replay can upload an argument's current value the same way
    trace_uploads: list | None = None
    host_reads = 0  # device values read on the host by this thread's traces (note_host_read)
    execution_guard: str | None = None  # set by compile(full_graph=True): a message to raise on any execution
    trace_start: int | None = None  # perf_counter_ns() of the first op recorded since a graph last ran

    def __init__(self):
        self.pending = _PendingCells()
        with ENGINE_LOCK:
            _THREAD_PENDING[:] = [r for r in _THREAD_PENDING if r() is not None]
            _THREAD_PENDING.append(weakref.ref(self.pending))

    @property
    def epoch(self) -> int:
        """Bumped by every run (in any thread); view caches are valid within one epoch."""
        return _EPOCH[0]

    @epoch.setter
    def epoch(self, value: int) -> None:
        _EPOCH[0] = value


STATE = _State()


class UnexpectedExecutionError(RuntimeError):
    """A value was needed inside ``compile(..., full_graph=True)``."""


def set_pending(cell: Cell, ref: Pending) -> None:
    """Give ``cell`` a new (lazy) value."""
    pending = STATE.pending
    if STATE.trace_start is None or not pending:  # the first op of a new graph
        STATE.trace_start = time.perf_counter_ns()
    old = cell.value
    if _keeps_layout(cell, old):
        # an in-place update keeps the layout the data had (so optimizer state does not drift
        # between layouts and recompile the next step)
        cell.layout = old.sharding
    cell.value = ref
    cell.version += 1
    cell._leaf = None
    pending[weakref.ref(cell, pending.drop)] = cell.serial  # (an equal key already there stays)


def _keeps_layout(cell: Cell, old) -> bool:
    """Whether ``cell``, about to get a pending value in place of ``old``, keeps ``old``'s layout."""
    if cell.sharding is not None or type(old) is Pending:
        return False
    return hasattr(old, "sharding") and tuple(old.shape) == cell.shape


def set_pending_all(cells, refs) -> None:
    """``set_pending(cell, ref)`` for each pair (a foreach op's targets: an optimizer's parameters).

    Example: ``set_pending_all([a._cell, b._cell], [Pending(node, 0), Pending(node, 1)])``.
    """
    pending = STATE.pending
    if STATE.trace_start is None or not pending:
        STATE.trace_start = time.perf_counter_ns()
    try:
        _set_pending_each(cells, refs, pending)
    except KeyboardInterrupt:
        # one op (a foreach op) is all or nothing, as torch's kernel is: a Ctrl-C between two of its
        # targets lands once every target has its value (a target written twice counts two versions)
        _set_pending_each(cells, refs, pending, unless_done=True)
        raise


def _set_pending_each(cells, refs, pending, unless_done=False) -> None:
    drop = pending.drop
    for cell, ref in zip(cells, refs):
        old = cell.value
        if unless_done and old is ref:
            continue
        if _keeps_layout(cell, old):
            cell.layout = old.sharding  # (as set_pending)
        cell._leaf = None
        pending[weakref.ref(cell, drop)] = cell.serial
        cell.version += 1
        cell.value = ref  # (last: what ``unless_done`` looks at)


def new_pending_cell(ref: Pending, shape, dtype) -> Cell:
    """A new cell whose value is ``ref`` (a recorded op's result): ``set_pending`` on a cell nothing
    has seen yet, without its work for an earlier value.

    Example: ``cell = new_pending_cell(Pending(node, 0), (2, 3), torch.float32)``.
    """
    cell = Cell(ref, shape, dtype)
    cell.version = 1  # (as set_pending leaves a new cell)
    pending = STATE.pending
    if not pending or STATE.trace_start is None:  # the first op of a new graph
        STATE.trace_start = time.perf_counter_ns()
    pending[weakref.ref(cell, pending.drop)] = cell.serial
    return cell


def set_concrete(cell: Cell, array, owned: bool) -> None:
    """Give ``cell`` a new concrete value."""
    cell.value = array
    cell.version += 1
    cell._leaf = None
    cell.owned = owned
    STATE.pending.pop(weakref.ref(cell), None)


def set_failed(cell: Cell, failed) -> None:
    """Give ``cell`` the ``Failed`` value of a graph that could not compute it."""
    cell.value = failed
    cell._leaf = None
    STATE.pending.pop(weakref.ref(cell), None)


def set_computed(cell: Cell, array, owned: bool) -> None:
    """An execution's output for ``cell`` (the version stays: the value is the one recorded)."""
    cell.value = array
    cell._leaf = None
    cell.owned = owned
    pending = STATE.pending
    if pending:  # (a frozen replay's outputs: nothing of this thread pending, no reference to make)
        pending.pop(weakref.ref(cell), None)


def pending_cells() -> list:
    """Every live cell this thread left pending, oldest first (a stable order keeps graph keys stable).

    (A cell another thread has computed since is left out.)
    """
    cells = [c for c in STATE.pending.cells() if c.is_pending()]
    cells.sort(key=lambda c: c.serial)
    return cells


def has_pending() -> bool:
    """Whether any live cell this thread recorded is still pending."""
    return any(c.is_pending() for c in STATE.pending.cells())


def forget_pending() -> None:
    """Drop this thread's pending values (tests reset the engine between cases with it)."""
    STATE.pending.clear()


def check_execution_allowed(what: str) -> None:
    """Raise ``UnexpectedExecutionError`` if a run is not allowed now (``compile(full_graph=True)``)."""
    if STATE.execution_guard is not None:
        raise UnexpectedExecutionError(
            f"Unexpected execution happens inside the compiled function ({what}); exiting. {STATE.execution_guard}"
        )


def has_only_pending(cells) -> bool:
    """Whether ``cells`` are all the cells whose values are pending, in every thread (nothing else
    needs this graph's inputs, so they may be donated)."""
    chosen = {id(c) for c in cells}
    mine = STATE.pending
    if not all(id(c) in chosen or not c.is_pending() for c in mine.cells()):
        return False
    return not others_pending(mine)


def others_pending(mine=None) -> bool:
    """Whether a thread other than this one has pending values (which may read any buffer)."""
    mine = STATE.pending if mine is None else mine
    for ref in _THREAD_PENDING:
        other = ref()
        if other is not None and other is not mine and any(c.is_pending() for c in other.cells()):
            return True
    return False
