"""Programs in flight, and what one that fails while it runs leaves.

A program runs asynchronously: its call returns before the devices finish, so a failure the memory
analysis did not foresee (out of memory on some devices, a device fault) shows only in its results,
later. Every run is noted here (``track``) with, for each tensor it overwrites, the buffer that
tensor had before. ``settle`` looks at the runs noted — before the next program runs, and when a read
finds a failed result — and for one that failed:

- a tensor it overwrote whose old buffer is intact (not donated) gets that value back;
- a tensor whose old buffer it had consumed (donated: parameter aliasing on) raises
  ``ConsumedInputError`` when read: which program, the runtime's error, and what to do;
- a tensor it computed raises the program's error when read;
- pending work recorded from its results is dropped the same way (an in-place update goes back to the
  value before it, a new value raises).

The failure itself is raised once, as an ``ExecutionFailedError``, by whichever sync, step or read
notices it first.

With aliasing off (``aliasing``) nothing is donated, so every overwritten tensor can be given back.
The old buffers are kept until the run is known to have finished, and the next program waits for
that before it starts: at most two copies of the overwritten state exist, as the memory analysis of
the program says. With aliasing on, a run is only looked at (never waited for) before the next one.

Every path that runs a program (lazy sync, eager ops, frozen ``st.compile`` replays) settles first,
so a loop that never reads has at most ``max_in_flight()`` runs queued: the oldest are waited for.
"""

from __future__ import annotations

import os
import sys
import types
import weakref

from shardtensor import runtime
from shardtensor.graph import recompile
from shardtensor.graph.ir import Failed, Leaf, Pending
from shardtensor.graph.program import _topological_order
from shardtensor.graph.state import pending_cells, set_computed, set_concrete, set_failed
from shardtensor.graph.waiting import ExecutionFailedError, finished_live, wait_until_ready

ADVICE = (
    "To keep every input through such failures at the cost of memory (the overwritten tensors held "
    "twice while a program runs), set XLA_ENABLE_PARAM_ALIASING=0 or call st.set_param_aliasing(False)."
)
OOM_ADVICE = (
    "If it ran out of memory, set SHARDTENSOR_DEVICE_MEMORY (or st.set_device_memory_limit) to the "
    "memory a device really has, so that a program which cannot fit is refused before it runs."
)
# At most this many unfinished runs: before another, the oldest are waited for (each holds its
# results). XLA:CPU queues at most 32 programs per device; a dispatch past that blocks with the
# program started on some devices only, whose collectives then hold the CPU client's threads while
# they wait for the rest: the process dies ("Termination timeout for all reduce"). So on CPU the
# bound stays well under 32.
MAX_IN_FLIGHT = 256
MAX_IN_FLIGHT_CPU = 16
_bound: int | None = None  # the one for this process's platform, once known


class ConsumedInputError(ExecutionFailedError):
    """A tensor's buffer was donated to a program that then failed while it ran: its value is gone.

    Example::

        try:
            w.cpu()
        except st.ConsumedInputError:
            model.load_state_dict(checkpoint)   # restore it, then retry the step
    """


class Run:
    """One dispatched program: what it is, its results, and for each output cell its value before."""

    __slots__ = ("computed", "entries", "outputs", "probe_at", "site", "waits", "what")

    def __init__(self, what, site, entries, outputs, computed, waits):
        self.what, self.site = what, site
        self.entries = entries  # (weak ref to cell, its new array, its array before or None, owned before)
        self.outputs = outputs  # every result (check rows included)
        # the results the program computed (not inputs passed through): any one is ready when the
        # program has finished on every device, and holds the error if it failed (XLA fails them all)
        self.computed = computed
        self.probe_at = 0  # computed results before this one are known consumed by later runs
        self.waits = waits  # it keeps buffers only to give them back: the next run waits for it

    def describe(self) -> str:
        where = f" (run from {self.site[0]}:{self.site[1]})" if self.site is not None else ""
        return self.what + where


class Entries:
    """A run's entries as columns by output (a frozen replay's store makes them in one pass, without
    a tuple per output): iterating gives each ``(weak reference to the cell, its new array, its array
    before or None, owned before)``, skipping the outputs whose cell had died (None in ``refs``).

    Example::

        entries = Entries([weakref.ref(cell)], [out], [None], [True])
        note("a program", entries, [out], [out], False)
    """

    __slots__ = ("befores", "outs", "owned", "refs")

    def __init__(self, refs, outs, befores, owned):
        self.refs, self.outs, self.befores, self.owned = refs, outs, befores, owned

    def __iter__(self):
        return (e for e in zip(self.refs, self.outs, self.befores, self.owned) if e[0] is not None)

    def keeps(self) -> bool:
        """Whether any entry keeps its array before (to give it back if the run fails)."""
        return self.befores.count(None) != len(self.befores)


_RUNS: list[Run] = []


def track(what, cells, outs, before, aliasing: bool, forwarded=()) -> Run:
    """Note a run that gives ``outs`` to ``cells``, before they are stored; ``before``: id(cell) ->
    the array an overwritten cell had (donated or not); ``aliasing``: the program could donate;
    ``forwarded``: the positions of outputs that are inputs passed through."""
    entries = []
    keeps = False
    for cell, out in zip(cells, outs):
        if cell is not None:
            old = before.get(id(cell)) if before else None
            keeps = keeps or old is not None
            entries.append((weakref.ref(cell), out, old, cell.owned))
    outputs = list(outs)
    computed = [o for i, o in enumerate(outputs) if i not in forwarded and hasattr(o, "is_ready")]
    rows = getattr(outs, "check_rows", None)
    if rows is not None:
        outputs.append(rows)
        computed.insert(0, rows)  # never donated to a later run
    return note(what, entries, outputs, computed, keeps and not aliasing)


def note(what, entries, outputs, computed, waits) -> Run:
    """Note a run in flight from its parts (``track`` makes them; a frozen replay, which knows
    them in advance, makes them itself): ``entries``, (weak reference to an output cell, its new
    array, its array before or None, whether it owned that) each, a list or ``Entries``; ``outputs`` (check rows last),
    ``computed`` (those a finished run has computed, check rows first), ``waits`` (it keeps
    buffers to give back: the next run waits for it).

    Example::

        note("a program", [(weakref.ref(cell), out, None, True)], [out], [out], False)
    """
    run = Run(what, user_site(), entries, outputs, computed, waits)
    _RUNS.append(run)
    return run


def user_site():
    """(file name, line) of the innermost frame outside shardtensor, torch, jax and the standard
    library: the user's line whose sync, step, read or call ran the program; None if none."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        short = _USER_FILE.get(name, _UNSEEN)
        if short is _UNSEEN:  # once per file: every run walks the stack
            library = name.startswith(recompile.library_dirs()) or name.startswith(("<frozen", "<eval_with_key>"))
            short = _USER_FILE[name] = None if library else os.path.basename(name)
        if short is not None:
            return short, frame.f_lineno
        frame = frame.f_back
    return None


_USER_FILE: dict[str, str | None] = {}  # file name -> its base name, None for a library's file
_UNSEEN = object()


def follow_copy(array, copy) -> None:
    """A cell that held ``array`` now holds ``copy`` of it (the same value on another mesh): if a run
    in flight computed ``array``, it answers for ``copy`` too, so a failure found later fails or
    restores that cell as it would have."""
    for run in _RUNS:
        if any(o is array for o in run.outputs):
            run.outputs.append(copy)
            run.entries = [(ref, copy if out is array else out, old, owned) for ref, out, old, owned in run.entries]


def max_in_flight() -> int:
    """How many runs may be in flight at once on this platform (see ``MAX_IN_FLIGHT``).

    Example::

        assert in_flight() <= max_in_flight()
    """
    global _bound
    if _bound is None:
        _bound = MAX_IN_FLIGHT_CPU if runtime.platform() == "cpu" else MAX_IN_FLIGHT
    return _bound


def in_flight() -> int:
    """How many runs are noted as in flight (not yet seen to finish).

    Example::

        in_flight()   # 0 after a read of every result
    """
    return len(_RUNS)


def forget() -> None:
    """Stop watching every run in flight (tests reset the engine between cases with it)."""
    _RUNS.clear()


def done(run: Run) -> None:
    """``run`` is known to have finished without error (its caller waited for it, or read one of its
    computed results: ``checks.verify`` reads a one-device run's check rows)."""
    if run in _RUNS:
        _RUNS.remove(run)


def settle(wait_for=None) -> None:
    """Look at every run in flight; raise ``ExecutionFailedError`` for the first that failed, after
    giving back what the failed ones overwrote (see the module's docstring).

    A run that keeps old buffers (aliasing off), and the run that computed the array ``wait_for``, are
    waited for (interruptibly, and never for ever on a failed device); the others are only looked at.

    Example::

        settle()   # before a new program runs: a failed earlier step raises here
    """
    if not _RUNS:
        return
    if len(_RUNS) == 1 and wait_for is None and not _RUNS[0].waits and max_in_flight() > 1:
        # (the one run before a replay's: looked at, as the loop below would, without its lists)
        _look_at(_RUNS[0])
        return
    first = None
    crowded = len(_RUNS) + 1 - max_in_flight()  # this many of the oldest are waited for (the next run counts)
    polling = True  # runs finish in order: past the first unfinished one, only waits are worth it
    # Runs whose every result a later run consumed (a step that returns nothing donates all it computed
    # to the next one) cannot be looked at: they stay in flight, and count, until a later run that can
    # be is seen finished (it waited for them); one that must be waited for waits for that later run.
    answered: list[Run] = []
    owed = False
    for run in list(_RUNS):
        crowded -= 1
        wait = run.waits or crowded >= 0 or (wait_for is not None and any(o is wait_for for o in run.outputs))
        if not (wait or polling or owed):
            continue
        probe = _probe(run)
        if probe is None:
            answered.append(run)
            owed = owed or wait
            continue
        try:
            if wait or owed:
                wait_until_ready(run.outputs)
            elif not finished_live(probe):
                polling = False
                answered.clear()  # (they stay in flight: this run answers for them once it finished)
                continue
        except ExecutionFailedError as error:
            _RUNS.remove(run)
            failure = resolve(run, error, remove=False)
            first = first or failure
        else:
            _RUNS.remove(run)
        for earlier in answered:  # (it ran after them: they are done, their failure is its own)
            _RUNS.remove(earlier)
        answered.clear()
        owed = False
    for run in answered:  # (the newest runs, and no later one to answer for them: nothing to look at)
        _RUNS.remove(run)
    if first is not None:
        raise first


def _probe(run: Run):
    """A result of ``run`` that no later run has consumed (donated), or None: later runs answer for it.
    (Consumed results stay consumed: the search starts where the last one ended.)"""
    computed = run.computed
    at = run.probe_at
    while at < len(computed):
        if not computed[at].is_deleted():
            run.probe_at = at
            return computed[at]
        at += 1
    run.probe_at = at
    return None


def _finished(run: Run) -> bool:
    """Whether ``run`` finished, by one result that a later run has not consumed (none: the later
    runs answer for it); raises ``ExecutionFailedError`` if it failed. Never waits."""
    probe = _probe(run)
    return probe is None or finished_live(probe)


def _look_at(run: Run) -> None:
    """``settle`` for the one run in flight, which it need not wait for (the loop's polling case)."""
    try:
        if not _finished(run):
            return
    except ExecutionFailedError as error:
        _RUNS.remove(run)
        failure = resolve(run, error, remove=False)
    else:
        _RUNS.remove(run)
        return
    raise failure  # (as the loop raises: outside the handler, the failure's own cause kept)


def resolve(run: Run, error: BaseException, remove: bool = True) -> ExecutionFailedError:
    """``run`` failed with ``error``: give back what it overwrote, fail what it computed and what was
    recorded from that; return the error to raise."""
    if remove and run in _RUNS:
        _RUNS.remove(run)
    cause = error.__cause__ if isinstance(error, ExecutionFailedError) and error.__cause__ else error
    runtime = _summary(str(cause))
    bad = {id(o) for o in run.outputs if not _healthy(o)}
    restored = consumed = 0
    failure = ExecutionFailedError("")  # its text is set below, once the counts are known
    dropped = _recorded_from(bad)
    for ref, out, old, owned in run.entries:
        cell = ref()
        if cell is None:
            continue
        value = cell.value
        if value is out:
            if id(out) not in bad:
                continue
        elif not (isinstance(value, Pending) and id(cell) in dropped):
            continue  # it has a newer value that does not come from this run
        dropped.pop(id(cell), None)
        if old is None:
            set_failed(cell, Failed(failure))
        elif old.is_deleted():
            consumed += 1
            set_failed(cell, Failed(_consumed(run, cell, runtime, cause)))
        else:
            restored += 1
            if value is out:
                set_computed(cell, old, owned=owned)
            else:
                set_concrete(cell, old, owned=owned)
    for cell, old in dropped.values():  # pending work of cells this run did not write
        if old is not None and id(old) not in bad and not old.is_deleted():
            set_concrete(cell, old, owned=False)
        else:
            set_failed(cell, Failed(failure))
    failure.args = (_failure_text(run, runtime, restored, consumed),)
    failure.__cause__ = cause
    return failure


def _failure_text(run, runtime, restored, consumed) -> str:
    text = f"{run.describe()} failed while it ran on the devices: {runtime}."
    if restored:
        text += (
            f" The {restored} tensor(s) it was updating in place (parameters, optimizer state) keep their "
            "values from before it: the step can be retried."
        )
    if consumed:
        text += (
            f" It had consumed the buffers of {consumed} tensor(s) it was updating in place (donated "
            "inputs: parameters, optimizer state); reading one raises st.ConsumedInputError. Restore them "
            f"(e.g. from a checkpoint). {ADVICE}"
        )
    text += (
        " The tensors it was computing, and pending work recorded from them, raise this error when read. " + OOM_ADVICE
    )
    return text


def consumed_error(what: str, cell, cause: BaseException) -> ConsumedInputError:
    """The error of ``cell``, whose buffer ``what`` consumed before it failed with ``cause`` (a call
    that failed at once, after taking its donated inputs)."""
    return _consumed(Run(what, user_site(), (), (), None, False), cell, _summary(str(cause)), cause)


def _consumed(run, cell, runtime, cause) -> ConsumedInputError:
    error = ConsumedInputError(
        f"this tensor's value (a {tuple(cell.shape)} {cell.dtype} tensor) was consumed by {run.describe()}, which "
        f"failed while it ran on the devices: {runtime}. Its buffer had been donated to that program "
        "(input/output aliasing, on by default as in PyTorch/XLA), so neither its old nor its new value exists. "
        "Restore it, e.g. from a checkpoint (load_state_dict, torch.distributed.checkpoint), before using it "
        f"again. {ADVICE}"
    )
    error.__cause__ = cause
    return error


def _healthy(array) -> bool:
    """Whether ``array`` holds a value (computed, not failed); a donated one counts as healthy: the
    run that consumed it answers for it."""
    if not hasattr(array, "is_ready") or array.is_deleted():
        return True
    if not array.is_ready():
        return False  # still running beside a failed device: it will never be a value
    try:
        array.block_until_ready()
    except Exception:  # noqa: BLE001  (jax raises a failed result as several types)
        return False
    return True


def _recorded_from(bad: set) -> dict:
    """id(cell) -> (cell, the array it had before its pending updates or None) for every pending
    cell of this thread whose value is computed from a failed result (ids in ``bad``)."""
    if not bad:
        return {}
    cells = pending_cells()
    poisoned: set[int] = set()
    own_leaf: dict[int, object] = {}
    for node in _topological_order([c.value.node for c in cells]):
        for ref in node.inputs:
            if isinstance(ref, Leaf):
                if id(ref.array) in bad:
                    poisoned.add(id(node))
                cell = ref.cell_ref() if ref.cell_ref is not None else None
                if cell is not None:
                    own_leaf.setdefault(id(cell), ref.array)
            elif isinstance(ref, Pending) and id(ref.node) in poisoned:
                poisoned.add(id(node))
    return {id(c): (c, own_leaf.get(id(c))) for c in cells if id(c.value.node) in poisoned}


def _summary(text: str) -> str:
    """The runtime's error in one line: its first line, and its last when a traceback follows."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "an unknown error"
    summary = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return summary.rstrip(".")
