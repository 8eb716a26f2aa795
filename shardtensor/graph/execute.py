"""Running programs: the executable cache, one graph run (``Execution``), and what a failure leaves.

``run_cells(cells)`` builds the program of the nodes behind ``cells`` (``program.Program``), looks
its executable up under the program's structural key (compiling it the first time), runs it and
gives the cells their values. When a run fails, every cell that can be computed alone still is, and
only the rest keep the error (reading one raises it again).

A run is safe to interrupt and to fail: a program that cannot fit in memory is refused before it
runs (``memory``), Ctrl-C is held back from the call that donates buffers until every output is
stored (``interrupts``), waiting can be interrupted and never hangs on a failed device (``waiting``),
and after a failure every cell the program would have overwritten gets its value from before back
when its buffer is intact (it was not donated, or the program never ran); one whose buffer was
consumed raises ``ConsumedInputError``. A failure that shows only while the program runs is found
later, by ``inflight`` (before the next run, or by the read that meets it); with parameter aliasing
off (``aliasing``) nothing is ever donated, so nothing is ever consumed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as JaxSpec

from shardtensor import metrics as counters
from shardtensor import runtime
from shardtensor.graph import checks, early_rows, inflight, memory, mesh_moves, program_store, recompile
from shardtensor.graph.aliasing import param_aliasing_enabled
from shardtensor.graph.executable_cache import ExecutableCache
from shardtensor.graph.interrupts import deferred_interrupts
from shardtensor.graph.ir import Failed, Leaf, ScalarLeaf
from shardtensor.graph.program import SCALAR_DTYPES, Program, mesh_of, scalar_kind
from shardtensor.graph.state import (
    STATE,
    has_only_pending,
    locked,
    note_host_read,
    set_computed,
    set_failed,
)
from shardtensor.graph.waiting import wait_until_ready
from shardtensor.ops.checks import checks_enabled

_EXECUTABLES = ExecutableCache()  # program key -> jitted function (its ``program`` attribute: the Program)

_COMPILE_TIME = counters.metric("CompileTime")
_EXECUTE_TIME = counters.metric("ExecuteTime", aliases=("ExecuteReplicatedTime",))
_LAZY_TRACING = counters.metric("LazyTracing")


@locked
def run_cells(cells, wait: bool = False, note_read: bool = True):
    """Compute the pending values of ``cells`` (and nothing that no cell needs).

    ``note_read=False``: inside an ``st.compile`` trace, the run is not a read of the trace's values
    (values made from shapes alone, such as an optimizer's fresh state: the trace reads them after).

    Returns the ``Execution`` that ran (None when nothing was pending). A failed on-device check of
    an earlier run, or an earlier run that failed on the devices, raises first: nothing new runs on
    results that must not be used. An engine entry (``locked``): runs one at a time over all threads,
    with JAX's 64-bit types on.
    """
    param_aliasing_enabled()  # a bad XLA_ENABLE_PARAM_ALIASING raises here, with nothing changed
    return _run_cells(cells, wait, note_read)


def _settle_earlier_runs(wait_late: bool = True) -> None:
    """A failed on-device check of an earlier run, or an earlier run that failed on the devices,
    raises here (the checks first: reading them waits for those runs, after which ``settle`` sees
    their failures). ``wait_late=False``: a run whose early rows passed is not waited for
    (``graph.early_rows``): its own rows are read once ready."""
    checks.verify(wait_late)
    inflight.settle()


def _run_cells(cells, wait, note_read=True):
    cells = [c for c in cells if c.is_pending()]
    if not cells:
        _settle_earlier_runs()
        return None
    if STATE.tracing and note_read:
        note_host_read()
    execution = None
    try:
        # Donating is safe only when no other pending value still needs an input of this graph.
        complete = has_only_pending(cells)
        # The program is built and looked up (compiled) before the earlier runs are settled: that
        # waits for them to finish, and this host work then overlaps the devices' work instead of
        # leaving them idle until the call. Building changes no value: if settling raises, the
        # execution is dropped unrun.
        execution = Execution.prepare(cells, donate=complete)
    except Exception as error:
        _settle_earlier_runs()  # an earlier failure is the one to report
        failure = recover(cells, execution, error)
        if failure is not None:
            raise failure from failure.__cause__
        raise
    _settle_earlier_runs(wait_late=wait or STATE.eager)
    try:
        execution.run(wait=wait)
    except Exception as error:
        failure = recover(cells, execution, error)
        if failure is not None:
            raise failure from failure.__cause__
        raise
    if STATE.eager:  # eager mode raises a failed check at the op
        checks.verify()
    return execution


_SINGLE_NODE = ExecutableCache()  # eager mode: (op, input signature) -> jitted function


def clear_executables() -> None:
    """Forget every compiled program (shardtensor's caches and jax's); later graphs compile again.

    Example::

        st.clear_executables()   # e.g. between unrelated workloads in one long-lived process
    """
    _EXECUTABLES.clear()
    _SINGLE_NODE.clear()
    _SCALAR_CACHE.clear()
    jax.clear_caches()


def cached_executable(key):
    """The jitted function cached under a program key, or None."""
    return _EXECUTABLES.get(key)


def run_single_node(node, cells) -> None:
    """Eager mode's fast path: run one node whose inputs are all concrete.

    The executable is looked up under (op signature, input layouts) without building the general
    program again; anything unusual (pending or padded inputs, inputs on another mesh) takes
    ``run_cells``.
    """
    arrays: list = []
    seen: dict[int, int] = {}
    sig: list = []
    scalars: dict[str, list] = {}
    for ref in node.inputs:
        kind = type(ref)
        if kind is Leaf:
            a = ref.array
            if id(a) not in seen:
                if tuple(a.shape) != tuple(ref.shape):
                    return run_cells(cells)
                seen[id(a)] = len(arrays)
                arrays.append(a)
            # which distinct array each input is: the program of f(x, x) takes one array, f(x, y) two
            sig.append((a.shape, a.dtype, a.sharding, seen[id(a)]))
        elif kind is ScalarLeaf:
            k = scalar_kind(ref.value)
            scalars.setdefault(k, []).append(ref.value)
            sig.append(k)
        else:
            return run_cells(cells)
    if not arrays or STATE.tracing:
        return run_cells(cells)
    key = (node.key, tuple(sig), checks_enabled(), param_aliasing_enabled())
    fn = _SINGLE_NODE.get(key)
    if fn is None:
        execution = run_cells(cells)
        program = execution.program
        if (
            not program.donated
            and not program.forwarded_leaves
            and not program.shares_scalars  # (the fast path passes one scalar per use)
            and all(mesh_of(a) == program.mesh for a in arrays)
        ):
            _SINGLE_NODE[key] = execution.executable
        return execution
    counters.increment("CachedCompile")
    vectors: dict[str, np.ndarray] = {k: np.asarray(v, dtype=SCALAR_DTYPES[k]) for k, v in scalars.items()}
    before = _node_values_before(node, cells)
    inflight.settle()  # an earlier run that failed raises first (run_cells does it for the other paths)
    try:
        memory.check(getattr(fn, "memory", None), "this op's program")
        with deferred_interrupts():
            outs = call_executable(fn, arrays, vectors)
            assign_outputs(
                fn.program,
                cells,
                outs,
                {0: node.site} if node.site is not None else None,
                before=before,
                what=f"the program of the op {_op_name(node)}",
            )
    except Exception as error:
        _isolate_failure(cells, error, before)
        raise
    checks.verify()  # eager mode raises a failed check at the op


def _op_name(node) -> str:
    head = node.key[0] if isinstance(node.key, tuple) and node.key else node.key
    return str(head)


def _node_values_before(node, cells) -> dict:
    """id(cell) -> the array each of ``cells`` had before ``node`` overwrote it (an input of it)."""
    targets = {id(c) for c in cells}
    before = {}
    for ref in node.inputs:
        cell = ref.cell_ref() if type(ref) is Leaf and ref.cell_ref is not None else None
        if cell is not None and id(cell) in targets:
            before[id(cell)] = ref.array
    return before


def recover(cells, execution, error):
    """After the graph of ``cells`` failed with ``error`` (``execution``: its run, None if it was
    never built): every cell it would have overwritten gets its value from before back when that
    buffer is intact, else (donated, consumed) raises ``ConsumedInputError``; a program refused for
    memory leaves the other cells failed; a program that failed on the devices fails what it
    computed; any other failure computes alone what can be (one bad tensor neither loses other
    results nor poisons every read). Returns the error to raise instead of ``error``, or None.
    """
    before = execution.values_before() if execution is not None else {}
    what = execution.what if execution is not None else ""
    if isinstance(error, memory.OutOfDeviceMemoryError):
        for cell in cells:
            if cell.is_pending():
                _fail(cell, error, before, what)
    elif execution is not None and execution.record is not None:  # failed on the devices: outputs stored
        return inflight.resolve(execution.record, error)
    elif execution is not None and (execution.dispatched or any(a.is_deleted() for a in before.values())):
        for cell in cells:  # the call took its donated inputs and failed: nothing can be computed again
            _fail(cell, error, before, what)
    else:
        _isolate_failure(cells, error, before)
    return None


def _isolate_failure(cells, error, before):
    if len(cells) == 1:
        _fail(cells[0], error, before)
        return
    for cell in cells:
        if not cell.is_pending():
            continue
        try:
            Execution.prepare([cell], donate=False).run()
        except Exception as e:
            _fail(cell, e, before)


def _fail(cell, error, before, what=""):
    """``cell`` lost its new value: back to its value from before the graph if intact, consumed if
    the failed program took its buffer (``what``: that program), else failed."""
    array = before.get(id(cell))
    if array is None:
        set_failed(cell, Failed(error))
    elif not array.is_deleted():
        set_computed(cell, array, owned=cell.owned)
    else:
        set_failed(cell, Failed(inflight.consumed_error(what or "a program", cell, error)))


class Execution:
    """One graph run: its program (structure), executable and concrete inputs."""

    def __init__(self, cells, program, executable, arrays, scalars, leaf_cells, sites=None, moved=()):
        self.cells, self.program, self.executable = cells, program, executable
        self.arrays, self.scalars = arrays, scalars
        self.leaf_cells = leaf_cells  # this run's cells behind each input (the cached program's are None)
        self.dispatched = False  # the program was called: its outputs are stored, perhaps failed
        self.sites = sites  # this run's user lines of checked ops, by program step
        self.what = f"a program of {len(program.steps)} ops ({len(cells)} outputs)"  # for errors
        self.record: inflight.Run | None = None  # the run in flight, once its outputs are stored
        self.moved = moved  # (input position, its array before) for inputs copied onto the mesh

    @classmethod
    def prepare(cls, cells, donate=True):
        if STATE.trace_start is not None:
            if not STATE.eager:  # in eager mode each op is its own graph: nothing to report
                _LAZY_TRACING.add_since(STATE.trace_start)
            STATE.trace_start = None
        program, arrays, scalars = Program.build(cells, donate)
        leaf_cells, program.leaf_cells = program.leaf_cells, None  # the cache must not keep cells alive
        moved, program.moved = program.moved, []  # (nor the arrays as they were before a copy)
        fn = _EXECUTABLES.get(program.key)
        if fn is None:
            counters.increment("UncachedCompile")
            if recompile.enabled():
                recompile.explain(program, leaf_cells, _EXECUTABLES)
            recompile.note_compile(program, leaf_cells)  # a line that keeps recompiling is logged (WARNING)
            fn = _compile(program, _call_arguments(program, arrays, scalars))
            _EXECUTABLES[program.key] = fn
        else:
            counters.increment("CachedCompile")
        return cls(cells, fn.program, fn, arrays, scalars, leaf_cells, program.sites, moved)

    def run(self, wait=False):
        # inputs copied onto the mesh: their cells keep the copy, so the next call need not copy
        # (done here, not when prepared: a failed check of an earlier run must first have poisoned
        # the cells it should)
        for i, before in self.moved:
            mesh_moves.keep_moved(self.leaf_cells[i], before, self.arrays[i], self.program.mesh)
        what = f"this program ({len(self.program.steps)} ops, {len(self.cells)} outputs)"
        memory.check(getattr(self.executable, "memory", None), what)  # before anything is donated
        before = self.values_before()
        fn, early = self.executable, None
        if not (wait or STATE.eager) and early_rows.enabled():  # (a caller that waits needs none)
            arguments = _call_arguments(fn.program, self.arrays, self.scalars)
            early = early_rows.dispatch(fn, *arguments)  # (a repeated program's rows, before it runs)
        with deferred_interrupts():  # from donating the inputs to storing every output
            outs = call_executable(fn, self.arrays, self.scalars) if early is None else call_prepared(fn, *arguments)
            self.dispatched = True
            self.record = assign_outputs(
                self.program, self.cells, outs, self.sites, before=before, what=self.what, early=early
            )
            for i in self.program.forwarded_leaves:
                leaf_cell = self.leaf_cells[i]
                if leaf_cell is not None:
                    leaf_cell.owned = False
        if wait:
            wait_until_ready(outs)
            inflight.done(self.record)
        return outs

    def values_before(self) -> dict:
        """id(cell) -> the array each cell this run overwrites had before it (its input buffer)."""
        overwritten = {id(c) for c in self.cells}
        return {id(c): a for c, a in zip(self.leaf_cells, self.arrays) if c is not None and id(c) in overwritten}


def _compile(program, arguments):
    """The executable of ``program``: loaded from shardtensor's persistent program cache when it is
    there (nothing traced or lowered), else traced, lowered and compiled (and stored there)."""
    start = time.perf_counter_ns()
    entry = program_store.entry_for(program)
    fn = entry.load(arguments) if entry is not None else None
    if fn is not None:
        _COMPILE_TIME.add_since(start)
        return fn
    fn = program.make_executable()
    # Compile now (not on the first call) so CompileTime and ExecuteTime are apart; jit's call then
    # finds this executable. A program that fails to compile is not cached.
    with warnings.catch_warnings(), entry.compiling() if entry is not None else contextlib.nullcontext():
        # donation is best effort: a buffer XLA cannot reuse (another layout) is simply not reused;
        # the filter is scoped to our own compile, not the user's process
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        compiled = fn.lower(*arguments).compile()
    _COMPILE_TIME.add_since(start)
    _log_slow_compile(program, time.perf_counter_ns() - start)
    fn.memory = memory.analyse(compiled, program.mesh)
    if entry is not None:
        entry.save(compiled)
    return fn


_LOG = logging.getLogger("shardtensor")
SLOW_COMPILE_SECONDS = 2.0  # a compile this long is said (INFO), so a long first step is explained


def _log_slow_compile(program, elapsed_ns: int) -> None:
    seconds = elapsed_ns / 1e9
    if seconds >= SLOW_COMPILE_SECONDS:
        _LOG.info(
            "compiled a program of %d ops (%d inputs, %d outputs) on a mesh of %d devices in %.1f s; "
            "later calls with the same shapes reuse it",
            len(program.steps),
            len(program.key[2]),
            len(program.outputs),
            program.mesh.size if program.mesh is not None else 1,
            seconds,
        )


_SCALAR_CACHE: dict = {}


def _device_scalars(vec: np.ndarray, mesh):
    """The scalar vector on the devices; recent vectors are kept so a constant lr costs no transfer."""
    key = (mesh, vec.dtype, vec.tobytes())
    arr = _SCALAR_CACHE.get(key)
    if arr is None:
        if len(_SCALAR_CACHE) > 512:
            _SCALAR_CACHE.clear()
        # not jax.device_put: in a job of several processes it checks (by a collective) that every
        # process passes the same value, and processes may differ (per-process values, collectives)
        sharding = NamedSharding(mesh, JaxSpec())
        arr = _SCALAR_CACHE[key] = jax.make_array_from_callback(vec.shape, sharding, lambda index: vec[index])
    return arr


def _call_arguments(program, arrays, scalars):
    donated = [arrays[i] for i in program.donated]
    kept = [arrays[i] for i in program.kept]
    return donated, kept, device_scalars(program, scalars)


def device_scalars(program, scalars) -> dict:
    """A program's scalar vectors (kind -> numpy vector) as the arrays on its mesh it is called with.

    Example::

        call_prepared(fn, donated, kept, device_scalars(fn.program, {"f64": np.array([0.1])}))
    """
    return {k: _device_scalars(v, program.mesh) for k, v in scalars.items()}


class Results(list):
    """A run's results; ``check_rows``: its on-device check rows (None without checks)."""

    check_rows = None


def call_executable(fn, arrays, scalars):
    """Call a cached executable (a program's) on ``arrays`` and the scalar vectors: its ``Results``.
    Donated inputs are consumed, so callers hold Ctrl-C back around this and the storing of its
    outputs (``deferred_interrupts``)."""
    start = time.perf_counter_ns()
    return _called(fn, fn(*_call_arguments(fn.program, arrays, scalars)), start)


def call_prepared(fn, donated: list, kept: list, scalar_arrays: dict):
    """``call_executable`` with its arguments already in the program's order (a frozen replay's):
    the donated arrays, the kept ones and the scalar vectors on the devices (``device_scalars``).

    Example::

        outs = call_prepared(fn, [cache], [weights, ids], device_scalars(fn.program, {}))
    """
    start = time.perf_counter_ns()
    return _called(fn, fn(donated, kept, scalar_arrays), start)


def _called(fn, outs, start):
    if fn.program.checks:
        outs, rows = outs
        outs = Results(outs)
        outs.check_rows = rows
        # the rows are read soon (``checks.verify``): on an accelerator their copy to the host starts
        # now, queued after the program, so the read finds them there instead of waiting for a
        # transfer (on CPU the devices' memory is the host's: starting a copy costs more than it saves)
        if rows is not None and _copy_rows_early():
            rows.copy_to_host_async()
    counters.increment("ExecuteReplicated")
    _EXECUTE_TIME.add_since(start)
    return outs


@functools.cache
def _copy_rows_early() -> bool:
    """Whether check rows are copied to the host at dispatch (off CPU): the platform is fixed."""
    return runtime.platform() != "cpu"


def assign_outputs(program, cells, outs, sites=None, before=None, what="a program", early=None):
    """Give ``cells`` a run's results; ``sites``: the user's lines of its checked ops, by step;
    ``before``: id(cell) -> the array each overwritten cell had (kept to give back if the run fails,
    see ``inflight``); ``what``: the program, for errors; ``early``: its check rows from their own
    program (``graph.early_rows``). Returns the run in flight."""
    record = inflight.track(what, cells, outs, before, program.aliasing, program.forwarded)
    forwarded = program.forwarded
    for i, (cell, out) in enumerate(zip(cells, outs)):
        if cell is not None:
            set_computed(cell, out, owned=i not in forwarded)
    STATE.epoch += 1
    rows = getattr(outs, "check_rows", None)
    if rows is not None:
        checks.watch(program, rows, sites, cells, outs, early, run=record)
    return record
