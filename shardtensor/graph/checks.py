"""Reading a run's on-device checks and raising torch's exception for the first that failed.

A program with checks (``program.Program``) returns, beside its results, one row per check its
lowerings declared (``ops.checks``). After a run, ``watch`` keeps those rows on the device, unread;
``verify`` reads them (one tiny transfer) — at the latest before the next program runs, before any
value is read back to the host, at the end of an ``st.compile`` call and, in eager mode, at once —
and raises the first failure with torch's exception type and message and the user's line.

What a failed run leaves: the cells it overwrote hold their values from before the run (the program
restored them on the device; scratch cells, ``program.mark_scratch``, keep what it computed); its new
results that depend on the failed check become ``Failed`` (reading one raises the same error), and
so do pending values recorded from them. New results that do not depend on it are kept.
"""

from __future__ import annotations

import contextlib
import linecache
import threading
import weakref
from collections.abc import Iterator

import numpy as np

from shardtensor.graph.ir import Failed, Leaf, Pending
from shardtensor.graph.program import _topological_order
from shardtensor.graph.state import pending_cells, set_failed

_UNREAD: list = []  # (rows, program, sites, [(cell ref, result)] the failure would poison)
# per thread, the innermost ``deferred``: how many of the newest runs verify() leaves unread
_DEFERRING = threading.local()


@contextlib.contextmanager
def deferred(newest: int) -> Iterator[None]:
    """Inside, ``verify`` reads every run's checks but the newest ``newest`` runs'.

    Reading a run's checks waits for the run; a loop that queues run after run (the device decode
    loop) reads them a few runs late instead, when they are long computed, and calls ``verify()``
    after the block for the rest. A failure still raises, at most ``newest`` runs late, before
    any value of a later run is read back. It applies to the calling thread's ``verify`` calls only.

    Example::

        with checks.deferred(4):
            for _ in range(n):
                step()          # a compiled call: its checks are read four calls later
        checks.verify()
    """
    outer = getattr(_DEFERRING, "newest", 0)
    _DEFERRING.newest = max(int(newest), 0)
    try:
        yield
    finally:
        _DEFERRING.newest = outer


def watch(program, rows, sites, cells, results) -> None:
    """Keep the check ``rows`` of a run of ``program`` until ``verify`` reads them."""
    suspects = []
    for i in program.tainted:
        cell = cells[i]
        if cell is not None and i not in program.restored:
            suspects.append((weakref.ref(cell), results[i]))
    _UNREAD.append((rows, program, sites, suspects))


def follow_copy(array, copy) -> None:
    """A cell that held ``array`` now holds ``copy`` of it (the same value on another mesh): if an
    unread run's check fails, that cell fails as it would have (a frozen replay or a program may
    copy an input onto its mesh before it reads the earlier runs' checks).

    Example::

        follow_copy(before, moved); cell.value = moved
    """
    for entry in _UNREAD:
        suspects = entry[3]
        suspects.extend([(ref, copy) for ref, result in suspects if result is array])


def verify() -> None:
    """Read every unread run's checks; raise the first failure (torch's exception, the user's line).

    Example::

        loss = F.cross_entropy(logits, bad_targets); st.sync()
        checks.verify()   # IndexError: Target 7 is out of bounds. ... (at train.py:12)
    """
    if not _UNREAD:  # (the usual case, on every read and sync: nothing else to look at)
        return
    older = len(_UNREAD) - getattr(_DEFERRING, "newest", 0)
    if older <= 0:
        return
    runs = _UNREAD[:older]
    del _UNREAD[:older]
    first = None
    for rows, program, sites, suspects in runs:
        try:
            values = host_rows(rows)
        except Exception:  # noqa: BLE001  (jax raises a failed result as several types)
            continue  # the run failed on the devices: graph.inflight raises that, with what it left
        error = _error(values, program, sites)
        if error is not None:
            _poison(suspects, error)
            first = first or error
    if first is not None:
        raise first


def host_rows(rows) -> np.ndarray:
    """A run's check rows on the host. They are replicated (``program``): one device's copy is read,
    by jax's own C++ read of a single shard where it has one (half of ``np.asarray``'s time, which
    goes through Python to reach it).

    Example::

        host_rows(rows)[:, 0].any()   # whether a check failed
    """
    read = getattr(rows, "_single_device_array_to_np_array_did_copy", None)
    if read is None:
        return np.asarray(rows)
    return read()[0]


def _error(rows, program, sites):
    if not np.count_nonzero(rows[:, 0]):  # (the usual answer, read after every run: 3x faster than any())
        return None
    failed = np.flatnonzero(rows[:, 0])
    if failed.size == 0:
        return None
    i = int(failed[0])
    check = program.check_table[i]
    message = check.message.format(value=int(rows[i, 2]), position=int(rows[i, 1]))
    site = (sites or {}).get(check.step)
    if site is not None:
        code = linecache.getline(site[0], site[1]).strip()
        message += f"\n  (checked on the device; raised by {site[0]}:{site[1]}" + (f": {code})" if code else ")")
    return check.error(message)


def _poison(suspects, error):
    """The results of a failed run that depend on the failed check, and pending values computed
    from them, raise ``error`` when read."""
    bad = {id(result) for _, result in suspects}
    for ref, result in suspects:
        cell = ref()
        if cell is not None and cell.value is result:
            set_failed(cell, Failed(error))
    if not bad:
        return
    cells = pending_cells()
    poisoned = set()
    for node in _topological_order([c.value.node for c in cells]):
        if any(
            (isinstance(r, Leaf) and id(r.array) in bad) or (isinstance(r, Pending) and id(r.node) in poisoned)
            for r in node.inputs
        ):
            poisoned.add(id(node))
    for cell in cells:
        if id(cell.value.node) in poisoned:
            set_failed(cell, Failed(error))
