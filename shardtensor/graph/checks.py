"""Reading a run's on-device checks and raising torch's exception for the first that failed.

A program with checks (``program.Program``) returns, beside its results, one row per check its
lowerings declared (``ops.checks``). After a run, ``watch`` keeps those rows on the device, unread;
``verify`` reads them (one tiny transfer) — at the latest before the next program runs, before any
value is read back to the host, at the end of an ``st.compile`` call and, in eager mode, at once —
and raises the first failure with torch's exception type and message and the user's line.

A run may also come with *early* rows (``watch(..., early=rows)``): the same checks computed by a
small program dispatched just before it (``graph.early_rows``: a repeated program's, on an
accelerator). Waiting for those waits only for the runs before, not for this one; the run's own rows
are then read once they are ready, or at the next read or sync (``verify(wait_late=False)`` leaves
them unread until then). Either failing raises; a failure of the early rows drops the run's own.

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

from shardtensor.graph import inflight
from shardtensor.graph.ir import Failed, Leaf, Pending
from shardtensor.graph.program import _topological_order
from shardtensor.graph.state import pending_cells, set_failed

_UNREAD: list = []  # the runs' unread rows (``_Rows``), oldest first
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


class _Rows:
    """One run's unread check rows; ``late``: the run's own rows when early ones were read for it
    (read when ready, or at a read or sync); ``partner``: the early rows' entry of the same run;
    ``run``: the run in flight that reading them shows finished (``watch``), or None."""

    __slots__ = ("rows", "program", "sites", "suspects", "late", "partner", "run")

    def __init__(self, rows, program, sites, suspects, late=False, partner=None, run=None):
        self.rows, self.program, self.sites, self.suspects = rows, program, sites, suspects
        self.late, self.partner, self.run = late, partner, run


def watch(program, rows, sites, cells, results, early=None, refs=None, run=None) -> None:
    """Keep the check ``rows`` of a run of ``program`` until ``verify`` reads them; ``early``: the
    same checks' rows from a program dispatched before this run (module doc), read first; ``refs``:
    weak references to ``cells`` where the caller has them (a frozen replay's store makes them);
    ``run``: the run in flight (``inflight.note``), done once its rows are read if it runs on one
    device (its rows, a computed result, then show the whole run finished: no later look at it)."""
    if run is not None and not program.single_device:
        run = None  # (one device's copy of the rows is read: the others may still be running)
    suspects = []
    for i in _suspect_outputs(program):
        cell = cells[i]
        if cell is not None:
            suspects.append((weakref.ref(cell) if refs is None else refs[i], results[i]))
    if early is None:
        _UNREAD.append(_Rows(rows, program, sites, suspects, run=run))
        return
    own = _Rows(rows, program, sites, suspects, late=True, run=run)
    _UNREAD.append(own)
    _UNREAD.append(_Rows(early, program, sites, suspects, partner=own))


def _suspect_outputs(program) -> tuple[int, ...]:
    """The outputs of ``program`` a failed check poisons: tainted and not restored on the device.
    Read per run of a frozen step (a training step taints and restores every output): computed
    once per program, again if its sets are replaced."""
    memo = getattr(program, "_suspects", None)
    if memo is not None and memo[0] is program.tainted and memo[1] is program.restored:
        return memo[2]
    suspects = tuple(sorted(i for i in program.tainted if i not in program.restored))
    program._suspects = (program.tainted, program.restored, suspects)
    return suspects


def deferring() -> bool:
    """Whether this thread is inside ``deferred`` (its runs' checks are read late anyway)."""
    return getattr(_DEFERRING, "newest", 0) > 0


def follow_copy(array, copy) -> None:
    """A cell that held ``array`` now holds ``copy`` of it (the same value on another mesh): if an
    unread run's check fails, that cell fails as it would have (a frozen replay or a program may
    copy an input onto its mesh before it reads the earlier runs' checks).

    Example::

        follow_copy(before, moved); cell.value = moved
    """
    for entry in _UNREAD:
        suspects = entry.suspects
        suspects.extend([(ref, copy) for ref, result in suspects if result is array])


def verify(wait_late: bool = True) -> None:
    """Read every unread run's checks; raise the first failure (torch's exception, the user's line).
    ``wait_late=False``: a run's own rows whose early rows were read (module doc) are read only if
    they are ready, so that a call returns without waiting for its run.

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
    if not wait_late:
        runs = [r for r in runs if not r.late or _ready(r.rows)]
        if not runs:
            return
    if len(runs) == older:  # (the usual case, a compiled call's own run among them: every one is read)
        del _UNREAD[:older]
    else:
        taken = {id(r) for r in runs}
        _UNREAD[:older] = [r for r in _UNREAD[:older] if id(r) not in taken]
    first = None
    at = 0
    try:
        for at, entry in enumerate(runs):  # noqa: B007  (the handler below reads `at`)
            try:
                values = host_rows(entry.rows)
            except Exception:  # noqa: BLE001  (jax raises a failed result as several types)
                continue  # the run failed on the devices: graph.inflight raises that, with what it left
            if entry.run is not None:  # (its one device finished it: nothing left for settle to look at)
                inflight.done(entry.run)
            error = _error(values, entry.program, entry.sites)
            if error is None:
                continue
            if entry.partner is not None:  # (the run's own rows say the same: not read again)
                with contextlib.suppress(ValueError):
                    _UNREAD.remove(entry.partner)
            _poison(entry.suspects, error)
            first = first or error
    except BaseException:
        _UNREAD[:0] = runs[at:]  # (a Ctrl-C while reading: the rows not looked at are read next time)
        raise
    if first is not None:
        raise first


def _ready(rows) -> bool:
    return rows.is_ready()


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
