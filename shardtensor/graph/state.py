"""The engine's state: the mode flags and the cells whose values are pending.

Ops record nodes and give cells ``Pending`` values (``set_pending``); a run gives them concrete ones
(``set_concrete``, or the execution's outputs). ``pending_cells()`` is what the next ``sync()``
computes. ``STATE`` holds the mode: eager, tracing (inside ``st.compile``), why a trace cannot be
replayed, and the guard that ``compile(full_graph=True)`` sets against any execution.
"""
from __future__ import annotations

import time
import weakref

from shardtensor.graph.ir import Cell, Pending

_PENDING: "weakref.WeakValueDictionary[int, Cell]" = weakref.WeakValueDictionary()  # serial -> cell


class _State:
    eager = False
    tracing = False  # inside compile(): record everything, run nothing until the end
    trace_broken = None  # why the current compile() trace cannot be replayed without Python
    epoch = 0  # bumped by every run; view caches are valid within one epoch
    execution_guard = None  # set by compile(full_graph=True): a message to raise on any execution
    trace_start = None  # perf_counter_ns() of the first op recorded since a graph last ran


STATE = _State()


class UnexpectedExecutionError(RuntimeError):
    """A value was needed inside ``compile(..., full_graph=True)``."""


def set_pending(cell: Cell, ref: Pending) -> None:
    """Give ``cell`` a new (lazy) value."""
    if STATE.trace_start is None or not _PENDING.data:  # the first op of a new graph (.data: C-speed test)
        STATE.trace_start = time.perf_counter_ns()
    old = cell.value
    if cell.sharding is None and hasattr(old, "sharding") and tuple(old.shape) == cell.shape:
        # an in-place update keeps the layout the data had (so optimizer state does not drift
        # between layouts and recompile the next step)
        cell.layout = old.sharding
    cell.value = ref
    cell.version += 1
    cell._leaf = None
    _PENDING[cell.serial] = cell


def set_concrete(cell: Cell, array, owned: bool) -> None:
    """Give ``cell`` a new concrete value."""
    cell.value = array
    cell.version += 1
    cell._leaf = None
    cell.owned = owned
    _PENDING.pop(cell.serial, None)


def set_failed(cell: Cell, failed) -> None:
    """Give ``cell`` the ``Failed`` value of a graph that could not compute it."""
    cell.value = failed
    cell._leaf = None
    _PENDING.pop(cell.serial, None)


def set_computed(cell: Cell, array, owned: bool) -> None:
    """An execution's output for ``cell`` (the version stays: the value is the one recorded)."""
    cell.value = array
    cell._leaf = None
    cell.owned = owned
    _PENDING.pop(cell.serial, None)


def pending_cells() -> list:
    """Every live cell with a pending value, oldest first (a stable order keeps graph keys stable)."""
    items = list(_PENDING.items())
    items.sort(key=lambda kv: kv[0])
    return [c for _, c in items]


def has_pending() -> bool:
    """Whether any live cell's value is pending."""
    return bool(_PENDING)


def forget_pending() -> None:
    """Drop every pending value (tests reset the engine between cases with it)."""
    _PENDING.clear()


def check_execution_allowed(what: str) -> None:
    """Raise ``UnexpectedExecutionError`` if a run is not allowed now (``compile(full_graph=True)``)."""
    if STATE.execution_guard is not None:
        raise UnexpectedExecutionError(
            f"Unexpected execution happens inside the compiled function ({what}); exiting. "
            f"{STATE.execution_guard}"
        )


def has_only_pending(cells) -> bool:
    """Whether ``cells`` are all the cells whose values are pending (nothing else needs this graph's inputs)."""
    chosen = {id(c) for c in cells}
    return all(id(c) in chosen for c in _PENDING.values())
