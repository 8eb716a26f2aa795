"""Lazy graphs: the pending cells, turning them into one JAX program, the executable cache, sync.

Ops record ``Node``s; ``sync()`` gathers every live cell whose value is pending, wires the nodes
behind them into one function, and runs it with ``jax.jit`` under a structural key (ops, static
arguments, input shapes, dtypes and shardings), so a loop of identical steps compiles once. Inputs
stored padded are sliced on entry; outputs whose cell asks for a sharding are padded and constrained
on exit. Arrays of cells that the graph overwrites are donated.
"""
from __future__ import annotations

import contextlib
import functools
import time
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lax.lax import _convert_element_type
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as JaxSpec

from shardtensor import compile_debug
from shardtensor import metrics as counters
from shardtensor.storage import Cell, Failed, Leaf, Pending, ScalarLeaf

# Donation is best effort: a donated buffer XLA cannot reuse (another layout) is simply not reused.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

_PENDING: "weakref.WeakValueDictionary[int, Cell]" = weakref.WeakValueDictionary()  # serial -> cell
_EXECUTABLES: dict = {}

_COMPILE_TIME = counters.metric("CompileTime")
_EXECUTE_TIME = counters.metric("ExecuteTime", aliases=("ExecuteReplicatedTime",))
_LAZY_TRACING = counters.metric("LazyTracing")
_trace_start = None  # perf_counter_ns() of the first op recorded since a graph last ran


class _State:
    eager = False
    tracing = False  # inside compile(): record everything, run nothing until the end
    trace_broken = None  # why the current compile() trace cannot be replayed without Python
    epoch = 0  # bumped by every run; view caches are valid within one epoch
    execution_guard = None  # set by compile(full_graph=True): a message to raise on any execution


STATE = _State()


class UnexpectedExecutionError(RuntimeError):
    """A value was needed inside ``compile(..., full_graph=True)``."""


def set_pending(cell: Cell, ref: Pending) -> None:
    """Give ``cell`` a new (lazy) value."""
    global _trace_start
    if _trace_start is None or not _PENDING.data:  # the first op of a new graph (.data: C-speed test)
        _trace_start = time.perf_counter_ns()
    old = cell.value
    if cell.spec is None and hasattr(old, "sharding") and tuple(old.shape) == cell.shape:
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


def pending_cells() -> list:
    """Every live cell with a pending value, oldest first (a stable order keeps graph keys stable)."""
    items = list(_PENDING.items())
    items.sort(key=lambda kv: kv[0])
    return [c for _, c in items]


def check_execution_allowed(what: str) -> None:
    if STATE.execution_guard is not None:
        raise UnexpectedExecutionError(
            f"Unexpected execution happens inside the compiled function ({what}); exiting. "
            f"{STATE.execution_guard}"
        )


def sync(wait: bool = False) -> None:
    """Compile (or fetch from the cache) and run everything pending.

    Example::

        loss = model(x).sum(); loss.backward(); opt.step()
        st.sync()        # one program runs the whole step
    """
    counters.increment("MarkStep")
    check_execution_allowed("sync()")
    run_cells(pending_cells(), wait=wait)


def run_cells(cells, wait: bool = False):
    """Compute the pending values of ``cells`` (and nothing that no cell needs).

    Returns the ``Execution`` that ran (None when nothing was pending).
    """
    cells = [c for c in cells if c.is_pending()]
    if not cells:
        return None
    if STATE.tracing:
        STATE.trace_broken = "a value was computed in the middle of the function"
    try:
        # Donating is safe only when no other pending value still needs an input of this graph.
        chosen = {id(c) for c in cells}
        complete = all(id(c) in chosen for c in _PENDING.values())
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
            k = _scalar_kind(ref.value)
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
                _mesh_of(a) == program.mesh for a in arrays):
            _SINGLE_NODE[key] = execution.executable
        return execution
    counters.increment("CachedCompile")
    vectors = {k: np.asarray(v, dtype=_SCALAR_DTYPES[k]) for k, v in scalars.items()}
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
    cell.value = Failed(error)
    cell._leaf = None
    _PENDING.pop(cell.serial, None)


class Execution:
    """One graph run: its program (structure), executable and concrete inputs."""

    def __init__(self, cells, program, executable, arrays, scalars, leaf_cells):
        self.cells, self.program, self.executable = cells, program, executable
        self.arrays, self.scalars = arrays, scalars
        self.leaf_cells = leaf_cells  # this run's cells behind each input (the cached program's are None)

    @classmethod
    def prepare(cls, cells, donate=True):
        global _trace_start
        if _trace_start is not None:
            if not STATE.eager:  # in eager mode each op is its own graph: nothing to report
                _LAZY_TRACING.add_since(_trace_start)
            _trace_start = None
        program, arrays, scalars = _Program.build(cells, donate)
        leaf_cells, program.leaf_cells = program.leaf_cells, None  # the cache must not keep cells alive
        fn = _EXECUTABLES.get(program.key)
        if fn is None:
            counters.increment("UncachedCompile")
            if compile_debug.enabled():
                compile_debug.explain(program, leaf_cells, _EXECUTABLES)
            fn = program.make_executable()
            # Compile now (not on the first call) so CompileTime and ExecuteTime are apart; jit's
            # call then finds this executable. A program that fails to compile is not cached.
            start = time.perf_counter_ns()
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
        if cell is None:
            continue
        cell.value = out
        cell._leaf = None
        cell.owned = i not in forwarded
        _PENDING.pop(cell.serial, None)
    STATE.epoch += 1


def _scalar_kind(value) -> str:
    if isinstance(value, bool):
        return "b"
    if isinstance(value, int):
        return "i"
    if isinstance(value, float):
        return "f"
    return "c"


_SCALAR_DTYPES = {"b": np.bool_, "i": np.int64, "f": np.float64, "c": np.complex128}


class _Program:
    """The structure of one graph: everything about it except the concrete input values."""

    def __init__(self):
        self.steps = []  # (caller, codes)
        self.leaf_shapes = []  # (logical shape, padded?)
        self.scalar_slots = []  # (kind, position within that kind's vector)
        self.outputs = []  # (code, pad widths or None, jax sharding or None)
        self.donated = []
        self.kept = []
        self.leaf_cells = []
        self.forwarded = set()  # outputs that are an input leaf unchanged
        self.forwarded_leaves = set()
        self.key = None
        self.mesh = None

    @classmethod
    def build(cls, cells, donate=True):
        prog = cls()
        node_pos: dict[int, int] = {}
        leaf_pos: dict[int, int] = {}
        arrays: list = []
        scalar_vals = {"b": [], "i": [], "f": [], "c": []}
        key_parts = []

        def code_of(ref):
            if isinstance(ref, Pending):
                return (0, node_pos[id(ref.node)], ref.index)
            if isinstance(ref, Leaf):
                k = leaf_pos.get(id(ref.array))
                if k is None:
                    k = leaf_pos[id(ref.array)] = len(arrays)
                    arrays.append(ref.array)
                    padded = tuple(ref.array.shape) != tuple(ref.shape)
                    prog.leaf_shapes.append((tuple(ref.shape), padded))
                    prog.leaf_cells.append(ref.cell_ref() if ref.cell_ref is not None else None)
                return (1, k)
            kind = _scalar_kind(ref.value)
            vals = scalar_vals[kind]
            prog.scalar_slots.append((kind, len(vals)))
            vals.append(ref.value)
            return (2, len(prog.scalar_slots) - 1)

        for node in _topological_order([c.value.node for c in cells]):
            codes = tuple(code_of(r) for r in node.inputs)
            node_pos[id(node)] = len(prog.steps)
            prog.steps.append((node.caller, codes))
            key_parts.append((node.key, codes))

        mesh = _graph_mesh(cells, arrays)
        arrays = [to_mesh(a, mesh) for a in arrays]
        out_keys = []
        for cell in cells:
            code = code_of(cell.value)
            pad, sharding = _output_layout(cell, mesh)
            if sharding is None and not arrays:  # no inputs: jit would use one device, not the mesh
                sharding = NamedSharding(mesh, JaxSpec())
            prog.outputs.append((code, pad, sharding))
            out_keys.append((code, pad, sharding))

        overwritten = {id(c) for c in cells}
        layouts = {id(c): out[2] for c, out in zip(cells, prog.outputs)}
        for i, c in enumerate(prog.leaf_cells):
            # donate only a buffer the output can reuse: same cell, sole owner, same layout
            reusable = (donate and c is not None and id(c) in overwritten and c.owned
                        and layouts[id(c)] in (None, arrays[i].sharding))
            (prog.donated if reusable else prog.kept).append(i)
        leaf_sigs = tuple((a.shape, a.dtype, shape, a.sharding) for a, (shape, _) in zip(arrays, prog.leaf_shapes))
        scalars = {k: np.asarray(v, dtype=_SCALAR_DTYPES[k]) for k, v in scalar_vals.items() if v}
        prog.mesh = mesh
        prog.key = (tuple(key_parts), tuple(out_keys), leaf_sigs, tuple(prog.scalar_slots), tuple(prog.donated),
                    mesh)
        return prog, arrays, scalars

    def make_executable(self):
        steps, leaf_shapes, slots, outputs = self.steps, self.leaf_shapes, self.scalar_slots, self.outputs
        order = self.donated + self.kept
        forwarded, forwarded_leaves = self.forwarded, self.forwarded_leaves

        def replay(donated, kept, vecs):
            arrays = [None] * len(order)
            for i, a in zip(order, list(donated) + list(kept)):
                arrays[i] = a
            leaves = [a[tuple(slice(0, n) for n in shape)] if padded else a
                      for a, (shape, padded) in zip(arrays, leaf_shapes)]
            scalars = [_convert_element_type(vecs[k][j], vecs[k].dtype, weak_type=True) for k, j in slots]
            values = []

            def resolve(code):
                if code[0] == 0:
                    return values[code[1]][code[2]]
                return leaves[code[1]] if code[0] == 1 else scalars[code[1]]

            for caller, codes in steps:
                values.append(caller(*[resolve(c) for c in codes]))
            results = []
            for i, (code, pad, sharding) in enumerate(outputs):
                x = resolve(code)
                if code[0] == 1 and not leaf_shapes[code[1]][1]:
                    forwarded.add(i)
                    forwarded_leaves.add(code[1])
                if pad is not None:
                    x = jnp.pad(x, pad)
                if sharding is not None:
                    x = jax.lax.with_sharding_constraint(x, sharding)
                results.append(x)
            return results

        out_shardings = [sharding for _, _, sharding in outputs]
        fn = jax.jit(replay, donate_argnums=(0,), out_shardings=out_shardings)
        fn.program = self
        return fn


def _topological_order(roots):
    """Nodes reachable from ``roots``, inputs before users (iterative: graphs can be deep)."""
    order, seen = [], set()
    stack = [(n, False) for n in reversed(roots)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for ref in reversed(node.inputs):
            if isinstance(ref, Pending) and id(ref.node) not in seen:
                stack.append((ref.node, False))
    return order


def _output_layout(cell: Cell, mesh):
    """(pad widths or None, sharding or None) for an output cell: the user's sharding, else the
    layout its data had before this graph overwrote it, else XLA's choice."""
    if cell.spec is None:
        layout = cell.layout
        if isinstance(layout, NamedSharding) and layout.mesh == mesh:
            return None, layout
        return None, None
    return _spec_layout(cell.shape, cell.mesh, cell.spec)


@functools.lru_cache(maxsize=4096)
def _spec_layout(shape, mesh, spec):
    """(pad widths or None, NamedSharding) of a tensor of ``shape`` stored as (mesh, spec)."""
    from shardtensor import sharding as sh

    padded = tuple(sh.padded_shape(shape, mesh, spec))
    pad = tuple((0, p - n) for n, p in zip(shape, padded)) if padded != tuple(shape) else None
    return pad, NamedSharding(mesh.get_jax_mesh(), sh.to_jax_spec(mesh, spec, len(shape)))


def _mesh_of(array):
    s = getattr(array, "sharding", None)
    return s.mesh if isinstance(s, NamedSharding) else None


def _is_replicated(array) -> bool:
    return array.sharding.is_fully_replicated


def _graph_mesh(cells, arrays):
    """The one jax mesh of this graph; two meshes holding sharded data are an error."""
    meshes = {}
    for c in cells:
        if c.mesh is not None:
            m = c.mesh.get_jax_mesh()
            meshes[m] = c.mesh
    for a in arrays:
        m = _mesh_of(a)
        if m is not None and not _is_replicated(a):
            meshes.setdefault(m, m)
    if len(meshes) > 1:
        raise ValueError(
            "These tensors are sharded over different meshes "
            f"({', '.join(str(m) for m in meshes.values())}); one computation can use only one mesh. "
            "Reshard them onto one mesh first (st.mark_sharding / st.shard with the same Mesh)."
        )
    if meshes:
        return next(iter(meshes))
    for a in arrays:  # all replicated: stay on the inputs' mesh rather than moving them
        m = _mesh_of(a)
        if m is not None:
            return m
    from shardtensor import torch_device as device

    return device.default_mesh().get_jax_mesh()


def to_mesh(array, mesh):
    """Put a replicated array (or one on a single device) onto ``mesh`` so jit sees one mesh."""
    m = _mesh_of(array)
    if m is mesh or m == mesh:
        return array
    if m is not None and not _is_replicated(array):
        return array  # sharded on another mesh: _graph_mesh already refused a real conflict
    counters.increment("ReplicateToGraphMesh")
    return jax.device_put(array, NamedSharding(mesh, JaxSpec()))


class eager_mode:
    """Run each op at once (``eager_mode(True)``) or record lazily (``eager_mode(False)``, default).

    Works as a call and as a context manager that restores the previous mode::

        st.eager_mode(True)
        with st.eager_mode(False):
            ...
    """

    def __init__(self, enable: bool = True):
        self.previous = STATE.eager
        self.enable = bool(enable)
        _set_eager(self.enable)

    def __call__(self, func):
        """As a decorator: the mode applies while ``func`` runs, not from the moment it is decorated."""
        _set_eager(self.previous)
        enable = self.enable

        @functools.wraps(func)
        def run_in_mode(*args, **kwargs):
            with eager_mode(enable):
                return func(*args, **kwargs)

        return run_in_mode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _set_eager(self.previous)
        return False


def _set_eager(enable: bool) -> None:
    if enable and not STATE.eager and _PENDING:
        run_cells(pending_cells())
    STATE.eager = enable


def is_eager_mode() -> bool:
    """True when ops run at once."""
    return STATE.eager


@contextlib.contextmanager
def step():
    """A training step: everything recorded inside runs as one program when the block ends normally.

    Example::

        with st.step():
            loss = model(x).mean(); loss.backward(); opt.step(); opt.zero_grad()
    """
    yield
    sync()
