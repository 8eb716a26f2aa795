"""Running programs: the executable cache, one graph run (``Execution``), and what a failure leaves.

``run_cells(cells)`` builds the program of the nodes behind ``cells`` (``program.Program``), looks
its executable up under the program's structural key (compiling it the first time), runs it and
gives the cells their values. When a run fails, every cell that can be computed alone still is, and
only the rest keep the error (reading one raises it again).
"""
from __future__ import annotations

import time
import warnings

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as JaxSpec

from shardtensor import metrics as counters
from shardtensor.graph import recompile
from shardtensor.graph.ir import Failed, Leaf, ScalarLeaf
from shardtensor.graph.program import SCALAR_DTYPES, Program, mesh_of, scalar_kind
from shardtensor.graph.state import (
    ENGINE_LOCK,
    STATE,
    has_only_pending,
    set_computed,
    set_failed,
)

_EXECUTABLES: dict = {}  # program key -> jitted function (its ``program`` attribute: the Program)

_COMPILE_TIME = counters.metric("CompileTime")
_EXECUTE_TIME = counters.metric("ExecuteTime", aliases=("ExecuteReplicatedTime",))
_LAZY_TRACING = counters.metric("LazyTracing")


def run_cells(cells, wait: bool = False):
    """Compute the pending values of ``cells`` (and nothing that no cell needs).

    Returns the ``Execution`` that ran (None when nothing was pending). Runs one at a time over all
    threads (``ENGINE_LOCK``).
    """
    with ENGINE_LOCK:
        return _run_cells(cells, wait)


def _run_cells(cells, wait):
    cells = [c for c in cells if c.is_pending()]
    if not cells:
        return None
    if STATE.tracing:
        STATE.trace_broken = "a value was computed in the middle of the function"
    try:
        # Donating is safe only when no other pending value still needs an input of this graph.
        complete = has_only_pending(cells)
        execution = Execution.prepare(cells, donate=complete)
        execution.run(wait=wait)
    except Exception as error:
        _isolate_failure(cells, error)
        raise
    return execution


_SINGLE_NODE: dict = {}


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
    arrays, seen, sig = [], {}, []
    scalars = {}
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
    key = (node.key, tuple(sig))
    fn = _SINGLE_NODE.get(key)
    if fn is None:
        execution = run_cells(cells)
        program = execution.program
        if not program.donated and not program.forwarded_leaves and all(
                mesh_of(a) == program.mesh for a in arrays):
            _SINGLE_NODE[key] = execution.executable
        return execution
    counters.increment("CachedCompile")
    vectors = {k: np.asarray(v, dtype=SCALAR_DTYPES[k]) for k, v in scalars.items()}
    try:
        outs = call_executable(fn, arrays, vectors)
    except Exception as error:
        _isolate_failure(cells, error)
        raise
    assign_outputs(fn.program, cells, outs)


def _isolate_failure(cells, error):
    """After a graph failed, compute what can be computed alone and mark only the rest as failed,
    so one bad tensor neither loses other results nor poisons every later read."""
    if len(cells) == 1:
        _fail(cells[0], error)
        return
    for cell in cells:
        if not cell.is_pending():
            continue
        try:
            Execution.prepare([cell], donate=False).run()
        except Exception as e:
            _fail(cell, e)


def _fail(cell, error):
    set_failed(cell, Failed(error))


class Execution:
    """One graph run: its program (structure), executable and concrete inputs."""

    def __init__(self, cells, program, executable, arrays, scalars, leaf_cells):
        self.cells, self.program, self.executable = cells, program, executable
        self.arrays, self.scalars = arrays, scalars
        self.leaf_cells = leaf_cells  # this run's cells behind each input (the cached program's are None)

    @classmethod
    def prepare(cls, cells, donate=True):
        if STATE.trace_start is not None:
            if not STATE.eager:  # in eager mode each op is its own graph: nothing to report
                _LAZY_TRACING.add_since(STATE.trace_start)
            STATE.trace_start = None
        program, arrays, scalars = Program.build(cells, donate)
        leaf_cells, program.leaf_cells = program.leaf_cells, None  # the cache must not keep cells alive
        fn = _EXECUTABLES.get(program.key)
        if fn is None:
            counters.increment("UncachedCompile")
            if recompile.enabled():
                recompile.explain(program, leaf_cells, _EXECUTABLES)
            fn = program.make_executable()
            # Compile now (not on the first call) so CompileTime and ExecuteTime are apart; jit's
            # call then finds this executable. A program that fails to compile is not cached.
            start = time.perf_counter_ns()
            with warnings.catch_warnings():
                # donation is best effort: a buffer XLA cannot reuse (another layout) is simply not
                # reused; the filter is scoped to our own compile, not the user's process
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                fn.lower(*_call_arguments(program, arrays, scalars)).compile()
            _COMPILE_TIME.add_since(start)
            _EXECUTABLES[program.key] = fn
        else:
            counters.increment("CachedCompile")
        return cls(cells, fn.program, fn, arrays, scalars, leaf_cells)

    def run(self, wait=False):
        outs = call_executable(self.executable, self.arrays, self.scalars, wait)
        assign_outputs(self.program, self.cells, outs)
        for i in self.program.forwarded_leaves:
            leaf_cell = self.leaf_cells[i]
            if leaf_cell is not None:
                leaf_cell.owned = False
        return outs


_SCALAR_CACHE: dict = {}


def _device_scalars(vec: np.ndarray, mesh):
    """The scalar vector on the devices; recent vectors are kept so a constant lr costs no transfer."""
    key = (mesh, vec.dtype, vec.tobytes())
    arr = _SCALAR_CACHE.get(key)
    if arr is None:
        if len(_SCALAR_CACHE) > 512:
            _SCALAR_CACHE.clear()
        arr = _SCALAR_CACHE[key] = jax.device_put(vec, NamedSharding(mesh, JaxSpec()))
    return arr


def _call_arguments(program, arrays, scalars):
    donated = [arrays[i] for i in program.donated]
    kept = [arrays[i] for i in program.kept]
    return donated, kept, {k: _device_scalars(v, program.mesh) for k, v in scalars.items()}


def call_executable(fn, arrays, scalars, wait=False):
    start = time.perf_counter_ns()
    outs = fn(*_call_arguments(fn.program, arrays, scalars))
    counters.increment("ExecuteReplicated")
    if wait:
        jax.block_until_ready(outs)
    _EXECUTE_TIME.add_since(start)
    return outs


def assign_outputs(program, cells, outs):
    forwarded = program.forwarded
    for i, (cell, out) in enumerate(zip(cells, outs)):
        if cell is not None:
            set_computed(cell, out, owned=i not in forwarded)
    STATE.epoch += 1


