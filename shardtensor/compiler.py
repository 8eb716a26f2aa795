"""``st.compile(fn)``: trace a function into one JAX program and replay it without its Python.

The first calls run ``fn`` in lazy mode and record everything it does: which tensors it reads
(arguments, parameters, optimizer state, the RNG key), which it writes, and what it returns. When two
consecutive calls with the same input signature record the same program from the same tensors, with
the same Python scalars, and touch no host state (no ``.item()`` on CPU tensors, no in-place update of
CPU tensors; torch's default optimizers count their steps on the devices inside a trace:
``optim_steps``), the program is frozen: later calls feed the
current values in, run the executable and write the results back, running no Python of ``fn``.
Anything else keeps re-running ``fn`` each call — still one cached executable, never a recompile.

Tensors made on the host inside ``fn`` (``torch.tensor(data, device=st.device())``, a CPU tensor
moved to the device) are inputs of the program, as Python numbers are, and like Python numbers they
count by value: two traces whose host-made tensors hold the same bytes (up to 1 MiB each) are equal
and freeze, the replay feeding that value again. One whose value changes from call to call keeps
the Python running, so each call computes it afresh. As for numbers, a value that stays the same
for two calls and changes later (``torch.tensor(step > 100)``) is not seen once frozen: pass it as
an argument. With ``SHARDTENSOR_DEBUG=1``, a trace that differs from the previous one says where:
the user's file and line of the first op that differs, and what (``trace_diff``).

A frozen replay is exact: it runs only while the Python state the trace depended on is unchanged
(``replay_guard``: gradients present on entry, ``requires_grad``, hooks, parameters, optimizer
groups and hyperparameters, training mode, grad mode); otherwise the call runs ``fn`` again. A
function that changes that state itself (it leaves ``.grad`` set, say) is never frozen.

Threads: a compiled function may be called from several threads; each call traces in its own
thread's state (graph/state.py), and a replay runs under the engine lock. The engine's work (runs,
replays) has JAX's 64-bit types on; ``fn``'s own Python runs with the caller's JAX setting.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import operator
import weakref
from collections.abc import Callable
from typing import Any, overload

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from shardtensor import metrics as counters
from shardtensor import optim_steps, trace_diff
from shardtensor.dispatch.record import signature as record_signature
from shardtensor.graph import checks, execute, inflight, memory, mesh_moves, recompile, rng
from shardtensor.graph.aliasing import param_aliasing_enabled
from shardtensor.graph.capture import capture
from shardtensor.graph.execute import Execution, recover, run_cells
from shardtensor.graph.interrupts import deferred_interrupts
from shardtensor.graph.ir import Cell, Failed, noting_sites
from shardtensor.graph.program import to_mesh
from shardtensor.graph.state import (
    STATE,
    check_execution_allowed,
    locked,
    others_pending,
    pending_cells,
    set_failed,
)
from shardtensor.ops import precision as matmul_precision
from shardtensor.ops.checks import checks_enabled
from shardtensor.replay_guard import Guard, Watched, picker, watch
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.geometry import contiguous_strides

aten = torch.ops.aten


@overload
def compile(
    fn: Callable[..., Any], *, full_graph: bool = False, name: str | None = None, raise_on_call: bool = True
) -> CompiledFunction: ...
@overload
def compile(
    fn: None = None, *, full_graph: bool = False, name: str | None = None, raise_on_call: bool = True
) -> Callable[[Callable[..., Any]], CompiledFunction]: ...
def compile(
    fn: Callable[..., Any] | None = None,
    *,
    full_graph: bool = False,
    name: str | None = None,
    raise_on_call: bool = True,
) -> CompiledFunction | Callable[[Callable[..., Any]], CompiledFunction]:
    """Compile ``fn`` (also usable as ``@st.compile`` or ``@st.compile(full_graph=True)``).

    With ``full_graph=True`` anything inside that needs a concrete value (``.item()``,
    ``if t.sum() > 0``, a data-dependent shape) raises instead of running part of the program.

    A failed on-device check (an index out of range, say) raises torch's error on the call that ran
    it, so each call waits for its program to finish. With ``raise_on_call=False`` a call returns as
    soon as its program is dispatched, and the error is raised as in lazy mode: by the next call (before
    its program runs), the next sync, or the first read of a value; the failed call's results raise it
    too, and what it overwrote keeps its value from before. A decode loop that feeds each call's
    outputs to the next then never waits for the device between tokens.

    Example::

        @st.compile
        def train_step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()
            return loss

        for x, y in batches:
            loss = train_step(x, y)
    """
    if fn is None:
        return functools.partial(compile, full_graph=full_graph, name=name, raise_on_call=raise_on_call)
    return CompiledFunction(fn, full_graph=full_graph, name=name, raise_on_call=raise_on_call)


class CompiledFunction:
    """A function traced once per input signature into one JAX program.

    ``guarded_state`` and ``guarded_layout`` are for a caller that checks the arguments itself before
    each call (``dynamo_backend``: Dynamo's guards): with ``guarded_state`` a frozen replay does not
    check the arguments' requires_grad, gradients and hooks (nor those of watched tensors passed as
    arguments), with ``guarded_layout`` it does not key sharded-tensor arguments by their shape,
    dtype, strides, spec and requires_grad (each input's array is still checked against the program
    when it changed). ``raise_on_call``: see ``compile``.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        full_graph: bool = False,
        name: str | None = None,
        *,
        guarded_state: bool = False,
        guarded_layout: bool = False,
        raise_on_call: bool = True,
    ) -> None:
        self.fn, self.full_graph, self.raise_on_call = fn, full_graph, raise_on_call
        self.guarded_state, self.guarded_layout = guarded_state, guarded_layout
        self.name: str = name or str(getattr(fn, "__name__", "compiled"))
        self._frozen: dict = {}
        self._last_trace: dict = {}
        self._watched: dict = {}  # signature -> the Guard taken after its last trace
        self._last_summary: dict = {}  # signature -> trace_diff summary of its last trace (debug mode)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if STATE.execution_guard is not None:
            check_execution_allowed(f"compiled function {self.name} called inside another")
        synced = bool(STATE.pending)
        if synced:
            run_cells(pending_cells())  # PyTorch/XLA syncs pending work on entry too
        tensors = None
        if self.guarded_layout and not kwargs and set(map(type, args)) == _ONLY_SHARDED:
            flat = tensors = list(args)
            signature = (("guarded", len(args)), matmul_precision.recorded())
        else:
            flat, signature = _key(args, kwargs)
        frozen = self._frozen.get(signature)
        if frozen is not None:
            result = frozen.replay(flat, self.name, tensors)  # (it reads the earlier runs' checks first)
            if result is not _STALE:
                if self.raise_on_call:
                    checks.verify()  # a failed on-device check raises on the call that ran it
                return result
            self._frozen.pop(signature, None)
        elif not synced:
            run_cells(())  # nothing pending: an earlier run's failed check or failure raises first
        out = self._trace(signature, flat, args, kwargs, frozen)
        if self.raise_on_call:
            checks.verify()
        return out

    def _trace(self, signature, flat, args, kwargs, stale=None):
        """Run ``fn`` and record it; ``stale``: the frozen trace this call could not replay."""
        counters.increment("CompileTrace")
        last_guard = self._watched.get(signature)
        previous = last_guard.objects() if last_guard is not None else None  # None: dropped since
        tensor_args = [x for x in flat if isinstance(x, ShardedTensor)]
        entry = Guard(previous, tensor_args) if previous is not None else None  # the state before fn runs
        monitor = _HostStateMonitor()
        guard = None
        if self.full_graph:
            guard = (
                f"st.compile({self.name}, full_graph=True) needs the whole function as one program: "
                "move .item()/.cpu()/printing and data-dependent control flow out of it, or use "
                "full_graph=False."
            )
        debug = recompile.enabled()
        sites = noting_sites(inflight.user_site) if debug else contextlib.nullcontext()
        optim_steps.install()  # torch's default optimizers count their steps on the devices: they freeze
        with capture(tracing=True, guard=guard) as seen, watch() as watched, monitor, sites:
            monitor.watched = watched
            try:
                out = self.fn(*args, **kwargs)
            finally:
                optim_steps.restore_groups()
        broken = seen.broken or monitor.reason
        cells = seen.pending()  # nothing else of this thread is pending: the call started with a sync
        arguments = [(i, x._cell) for i, x in enumerate(flat) if isinstance(x, ShardedTensor)]
        trace = _run_trace(cells, arguments, self.name, flat, out, seen.first_serial, broken)
        objects = watched.objects()
        if (
            trace.broken is None
            and entry is not None
            and not (  # (entry: set when previous is)
                _same_objects(previous, objects) and entry.holds(tensor_args)
            )
        ):
            trace.broken = (
                "it changes Python state a replay would not (.grad left set or removed, "
                "hooks, parameters, requires_grad, optimizer groups)"
            )
        last = self._last_trace.get(signature)
        self._last_trace[signature] = trace.fingerprint
        exit_guard = Guard(objects, tensor_args)
        self._watched[signature] = exit_guard
        # a trace equal to the last one freezes; so does one that differs from the frozen trace that
        # just went stale only in its Python scalars (a new learning rate): one Python run, not two
        again = stale is not None and _without_scalars(stale.fingerprint) == _without_scalars(trace.fingerprint)
        # (and only with the state on entry known: a dropped object leaves it unknown for one call)
        if trace.broken is None and entry is not None and (last == trace.fingerprint or again):
            replay_guard = Guard(objects, tensor_args, args_guarded=True) if self.guarded_state else exit_guard
            self._frozen[signature] = trace.freeze(replay_guard, self.name)
            counters.increment("CompileFrozen")
        elif trace.broken is not None and debug:
            recompile.emit(f"{self.name}: re-running Python each call: {trace.broken}")
        self._report_difference(signature, trace, last, debug)
        return out

    def _report_difference(self, signature, trace, last, debug) -> None:
        """In debug mode: a trace that differs from the previous one (so nothing freezes) says where."""
        previous = self._last_summary.pop(signature, None)
        if not debug:
            return
        summary = self._last_summary[signature] = trace_diff.summarize(trace)
        froze = signature in self._frozen  # (a trace differing only in scalars from a stale one freezes)
        if previous is not None and trace.broken is None and last != trace.fingerprint and not froze:
            where = trace_diff.first_difference(previous, summary)
            recompile.emit(
                f"st.compile({self.name}): not frozen: this call's trace differs from the previous one {where}"
            )


_STALE = object()


@locked
def _run_trace(cells, arguments, name, flat, out, first_serial, broken):
    """Compile and run what a traced call left pending; the ``_Trace`` of the call."""
    with recompile.naming(arguments, name):
        # another thread's pending graph may read a buffer this one would donate
        execution = Execution.prepare(cells, donate=not others_pending()) if cells else None
    trace = _Trace(execution, flat, out, first_serial, broken)
    if execution is not None:
        execution.what = f"compiled function {name} ({len(execution.program.steps)} ops)"
        try:
            execution.run()
        except Exception as error:
            failure = recover(cells, execution, error)
            if failure is not None:
                raise failure from failure.__cause__
            raise
    return trace


def _without_scalars(fingerprint):
    return fingerprint[:1] + fingerprint[2:]  # (key, scalars, sources, ...): see _Trace


def _same_objects(a, b) -> bool:
    return all(len(x) == len(y) and all(p is q for p, q in zip(x, y)) for x, y in zip(a, b))


def _key(args, kwargs):
    """``(flat, signature)``: the leaves of ``(args, kwargs)`` and what a frozen trace is keyed by
    (``_signature``). Sharded tensors alone (a decode step's call, every token) take C-level passes:
    each is a leaf, and its geometry (``ShardedTensor._sig``: shape, dtype, strides, offset), spec
    and requires_grad are read by one getter."""
    if (
        not kwargs
        and args
        and set(map(type, args)) == _ONLY_SHARDED
        and not any(map(_CHAIN, args))  # (a view is keyed apart: it never replays a trace of its base)
        and ShardedTensor not in pytree.SUPPORTED_NODES
    ):
        with torch._C.DisableTorchFunctionSubclass():  # a subclass's attribute getters, at C speed
            parts = tuple(map(_SHARDED_PART, args))
            if None in map(_FIRST, parts):  # a geometry changed in place: read it again
                parts = tuple((a._sig or record_signature(a), *p[1:]) for a, p in zip(args, parts))
        return list(args), (("sharded", len(args)), parts, matmul_precision.recorded())
    flat, structure = _flatten(args, kwargs)
    return flat, _signature(flat, structure)


_ONLY_SHARDED = {ShardedTensor}
_SHARDED_PART = operator.attrgetter("_sig", "_cell.spec", "requires_grad")
_FIRST = operator.itemgetter(0)
_CHAIN = operator.attrgetter("_chain")


def _flatten(args, kwargs):
    """``(flat, structure)``: the leaves of ``(args, kwargs)`` and a hashable key of their nesting
    (for the signature). Tensors alone skip pytree: each is a leaf, and ``("tensors", n)`` hashes
    at once where a TreeSpec hashes node by node in Python."""
    nodes = pytree.SUPPORTED_NODES  # (a tensor subclass registered as a node is walked as usual)
    if not kwargs and all(isinstance(a, torch.Tensor) and type(a) not in nodes for a in args):
        return list(args), ("tensors", len(args))
    return pytree.tree_flatten((args, kwargs))


def _signature(flat, structure):
    """What a frozen trace is keyed by: the arguments' nesting, each leaf's shape, dtype and
    sharding (a tensor) or value (a plain scalar), and torch's float32 matmul precision (its products
    were recorded at it)."""
    with torch._C.DisableTorchFunctionSubclass():  # a subclass's attribute getters, at C speed
        parts = _signature_parts(flat)
    return (structure, tuple(parts), matmul_precision.recorded())


def _signature_parts(flat):
    parts: list[tuple] = []
    for x in flat:
        if isinstance(x, ShardedTensor):
            # (a view reads its base's cell: a trace of a plain tensor must not replay on it)
            parts.append(("T", tuple(x.shape), x.dtype, x._cell.spec, x.requires_grad, bool(x._chain)))
        elif isinstance(x, torch.Tensor):
            parts.append(("C", tuple(x.shape), x.dtype))
        else:
            parts.append(("V", type(x), x if isinstance(x, (int, float, bool, str, type(None))) else id(x)))
    return parts


class _Trace:
    """What one traced call read, wrote and returned, and whether that can be replayed."""

    def __init__(self, execution, flat_args, out, first_serial, broken):
        self.execution, self.broken = execution, broken
        arg_cells = {id(x._cell): i for i, x in enumerate(flat_args) if isinstance(x, ShardedTensor)}
        if any(isinstance(x, ShardedTensor) and x._chain for x in flat_args):
            self.broken = self.broken or "an argument is a view"
        self.out_flat, self.out_spec = pytree.tree_flatten(out)
        returned = {}
        for i, x in enumerate(self.out_flat):
            if isinstance(x, torch.Tensor):
                if not isinstance(x, ShardedTensor) or x._chain:
                    self.broken = self.broken or "it returns a CPU tensor or a view"
                elif x.requires_grad:
                    self.broken = self.broken or "it returns a tensor that requires grad"
                else:
                    returned[id(x._cell)] = i
        program = execution.program if execution else None
        sources, targets = [], []
        if program is not None:
            donated = set(program.donated)
            for leaf_i, cell in enumerate(execution.leaf_cells):
                array = execution.arrays[leaf_i]
                sources.append(_source(cell, array, arg_cells, first_serial, leaf_i in donated))
            new_count = 0
            for cell in execution.cells:
                if id(cell) in arg_cells:
                    targets.append(("arg", arg_cells[id(cell)]))
                elif id(cell) in returned:
                    targets.append(("ret", returned[id(cell)]))
                elif cell.serial < first_serial:
                    targets.append(("old", id(cell)))
                else:
                    targets.append(("new", new_count))
                    new_count += 1
        for x in self.out_flat:
            if (
                isinstance(x, ShardedTensor)
                and id(x._cell) in returned
                and not (execution and any(c is x._cell for c in execution.cells))
            ):
                self.broken = self.broken or "it returns a tensor it did not compute"
        scalars = tuple((k, tuple(v.tolist())) for k, v in sorted(execution.scalars.items())) if execution else ()
        key = program.key if program else None
        plain_outputs = tuple(x if not isinstance(x, torch.Tensor) else None for x in self.out_flat)
        self.sources, self.targets = sources, targets
        self.fingerprint = (
            key,
            scalars,
            tuple(s[:2] for s in sources),
            tuple(targets),
            self.out_spec,
            _hashable(plain_outputs),
        )

    def freeze(self, guard, name="compiled"):
        return _Frozen(self, guard, name)


def _hashable(values):
    try:
        hash(values)
        return values
    except TypeError:
        return repr(values)


_CONSTANT_BYTES_COMPARED = 1 << 20  # host-made inputs up to this size are compared by value
_UNCOMPARED = itertools.count()


def _source(cell, array, arg_cells, first_serial, donated):
    """Where input ``array`` comes from: ("arg", position, None), ("old", id, weak cell) or
    ("const", identity, array) for a value made during the call (``torch.tensor(data, device=...)``,
    a CPU tensor moved to the device).

    A constant's identity is its value (shape, dtype, layout and a digest of its bytes) when it is
    small and the program does not donate it: the same host data each call then gives equal traces,
    which freeze and replay that value — exactly what the Python would make again, as for a Python
    number. A value that changes from call to call makes every trace differ, so the Python keeps
    running and recomputes it (never a stale replay). Larger constants keep their object's identity:
    never frozen, nothing hashed.
    """
    if cell is not None and id(cell) in arg_cells:
        return ("arg", arg_cells[id(cell)], None)
    if cell is not None and cell.serial < first_serial:
        return ("old", id(cell), weakref.ref(cell))
    if donated or array.size * array.dtype.itemsize > _CONSTANT_BYTES_COMPARED:
        # a number no other trace has (an id could be reused once this array is freed)
        return ("const", next(_UNCOMPARED), array)
    digest = hashlib.blake2b(np.ascontiguousarray(np.asarray(array)).tobytes(), digest_size=16).digest()
    return ("const", (tuple(array.shape), str(array.dtype), array.sharding, digest), array)


class _Frozen:
    """A replayable trace: where each input comes from and where each output goes.

    What a replay does per call is prepared here once: the positions of the arguments it reads, in
    the program's order, and what it last checked. A replay reads each input's array and compares
    it, by identity, with the array that input held when last checked (or that the last replay
    wrote into it: a decode step's KV cache); only an array that differs is checked in full (its
    cell computed, its shape, dtype and layout the program's).
    """

    def __init__(self, trace: _Trace, guard: Guard, name: str = "compiled"):
        self.guard = guard  # the Python state the replay assumes (replay_guard)
        self.fingerprint = trace.fingerprint
        ex = trace.execution
        self.executable = ex.executable if ex else None
        self.scalars = ex.scalars if ex else {}
        self.sources = trace.sources
        self.out_flat, self.out_spec = trace.out_flat, trace.out_spec
        # (kind, index, weak reference to the cell of an "old" or "new" target, None for the others)
        self.targets: list[tuple[str, int, Any]] = []
        for target, cell in zip(trace.targets, ex.cells if ex else ()):
            kind = target[0]
            self.targets.append((kind, target[1], None if kind in ("arg", "ret") else weakref.ref(cell)))
        self.leaf_sigs = ex.program.key[2] if ex else ()
        self.sites = ex.sites if ex else None  # the traced call's user lines of checked ops
        self.donated = set(ex.program.donated) if ex else set()
        # (target, source) positions of the cells it overwrites (their values before a replay are kept)
        leaf_of = {id(c): i for i, c in enumerate(ex.leaf_cells) if c is not None} if ex else {}
        self.overwrites = [(j, leaf_of[id(c)]) for j, c in enumerate(ex.cells if ex else ()) if id(c) in leaf_of]
        self.what = f"compiled function {name} ({len(ex.program.steps)} ops)" if ex else name
        self._prepare()

    def _prepare(self) -> None:
        """The per-call plumbing, in "read order": the arguments' cells, then the other old cells,
        then the constants (``_order`` maps it to the program's input order)."""
        sources = self.sources
        args = [i for i, s in enumerate(sources) if s[0] == "arg"]
        olds = [i for i, s in enumerate(sources) if s[0] == "old"]
        consts = [i for i, s in enumerate(sources) if s[0] not in ("arg", "old")]
        order = args + olds + consts  # read position -> source position
        self._read_sources = order
        self._pick_args = picker([sources[i][1] for i in args])
        self._old_refs = [sources[i][2] for i in olds]
        self._consts = [sources[i][2] for i in consts]
        self._cells_read = len(args) + len(olds)
        read_of = {i: r for r, i in enumerate(order)}
        program = self.executable.program if self.executable is not None else None
        self._donated_reads = picker([read_of[i] for i in sorted(self.donated)])
        # the program's donated and kept inputs, picked from the read order
        donated, kept = (program.donated, program.kept) if program is not None else ((), ())
        self._call_order = (picker([read_of[i] for i in donated]), picker([read_of[i] for i in kept]))
        # per read position: a weak reference to the array that passed every check as it was (jax
        # arrays are immutable: the same one passes again); a constant is always itself
        self._passed = [_NOTHING] * self._cells_read + [functools.partial(_same, c) for c in self._consts]
        self._written = [(j, read_of[i]) for j, i in self.overwrites]
        self._written_fit: list | None = None  # the (target, read position) whose output passes as that input
        self._scalar_arrays: dict | None = None  # the scalar vectors on the devices, made by the first replay
        spec = self.out_spec  # a tuple or list of tensors (a Dynamo graph's) is built without pytree
        self._plain_out = spec.type in (tuple, list) and all(c.is_leaf() for c in spec.children())
        # how a replay stores each output (``_store``): per target, whether its cell owns the array
        # afterwards (an input passed through is shared) and whether its value before is kept (an
        # overwritten input: given back if the run fails); the returned tensors' templates
        forwarded = program.forwarded if program is not None else set()
        kept_before = {j for j, _ in self.overwrites}
        self._stores: list[tuple[str, int, Any, Any, bool, bool]] = []
        for j, (kind, ident, ref) in enumerate(self.targets):
            made: Any = None
            if kind == "ret":
                old = self.out_flat[ident]
                shape = tuple(old.shape)
                made = (shape, old.dtype, old._cell, ("T", shape, old.dtype, contiguous_strides(shape), 0))
            self._stores.append((kind, ident, ref, made, j not in forwarded, j in kept_before))
        self._computed = picker([j for j in range(len(self.targets)) if j not in forwarded])

    @locked
    def replay(self, flat, name, tensors=None):
        """Run the frozen program on the current values (``_STALE``: the call must run ``fn``);
        ``tensors``: the sharded tensors among ``flat`` when the caller knows them."""
        checks.verify()  # a failed check of an earlier run raises first
        if tensors is None:
            tensors = [x for x in flat if isinstance(x, ShardedTensor)]
        if not self.guard.holds(tensors):
            return _STALE  # the Python would now do something else: run it
        if self.executable is None:
            return pytree.tree_unflatten(list(self.out_flat), self.out_spec)
        program = self.executable.program
        if program.checks != checks_enabled():  # st.set_checks changed: trace again
            return _STALE
        if program.aliasing != param_aliasing_enabled():  # st.set_param_aliasing changed
            return _STALE
        rng.settle()  # a seed given since the last draw: the key's cell is read below
        inflight.settle()  # a failed earlier run raises first; at most max_in_flight() runs stay queued
        cells = list(map(_CELL, self._pick_args(flat)))
        if self._old_refs:  # (the closed-over tensors' cells: a model's parameters, a cache)
            olds = list(map(operator.call, self._old_refs))
            if None in olds:  # (cells compare by identity)
                return _STALE
            cells += olds
        values = list(map(_VALUE, cells))
        values += self._consts
        passed = self._passed
        if not all(map(operator.is_, values, map(operator.call, passed))) and not self._check(cells, values, program):
            return _STALE
        if not all(map(_OWNED, self._donated_reads(cells))):
            return _STALE  # a donated input's buffer is shared with another tensor now
        if self.donated and others_pending():
            return _STALE  # another thread's pending graph may read a buffer the program donates
        counters.increment("CompileReplay")
        memory.check(getattr(self.executable, "memory", None), self.what)
        scalars = self._scalar_arrays
        if scalars is None:
            scalars = self._scalar_arrays = execute.device_scalars(program, self.scalars)
        donated_at, kept_at = self._call_order
        with deferred_interrupts():  # from donating the inputs to storing every output
            try:
                # (lists, as the program was lowered with: a tuple would be another signature for jit)
                outs = execute.call_prepared(self.executable, list(donated_at(values)), list(kept_at(values)), scalars)
            except Exception as error:
                out_cells, _ = self._targets(flat)
                _consumed_by_failed_call(out_cells, self._before(out_cells), self.what, error)
                raise
            # (the cells it writes, made or read while the program runs: they still hold their values)
            results = self._store(flat, outs, program)
        fitting = self._written_fit
        if fitting is None:  # (the program's outputs have fixed layouts: found once)
            fitting = self._written_fit = [
                (j, r) for j, r in self._written if self._fits(outs[j], self._read_sources[r], program)
            ]
        for j, r in fitting:  # what it wrote into its inputs passes as those inputs next time
            passed[r] = weakref.ref(outs[j])
        if self._plain_out:
            return self.out_spec.type(results)
        return pytree.tree_unflatten(results, self.out_spec)

    def _store(self, flat, outs, program) -> list:
        """Give each output to its cell, as ``assign_outputs`` does (the run noted in flight with
        what it overwrites, its check rows kept to read), in one pass; returns the call's results
        (new tensors for the new values it returns)."""
        results = list(self.out_flat)
        cells: list = []
        entries = []
        for (kind, ident, ref, made, owned, keep), out in zip(self._stores, outs):
            if kind == "arg":
                cell = flat[ident]._cell
                ref = weakref.ref(cell)
            elif kind == "ret":
                cell = Cell(None, made[0], made[1], made[2].sharding)  # (the traced result's sharding now)
                results[ident] = ShardedTensor._result(cell, made[3])
                ref = weakref.ref(cell)
            else:  # (a closed-over cell: its weak reference is kept)
                cell = ref()
                if cell is None:
                    cells.append(None)
                    continue
            cells.append(cell)
            entries.append((ref, out, cell.value if keep else None, cell.owned))
            cell.value = out
            cell._leaf = None
            cell.owned = owned
            cell.version += 1
        if STATE.pending:  # (values of this thread recorded since the call began: none are these cells)
            for cell in cells:
                if cell is not None:
                    STATE.pending.pop(weakref.ref(cell), None)
        rows = getattr(outs, "check_rows", None)
        outputs = list(outs)
        computed = list(self._computed(outs))
        if rows is not None:
            outputs.append(rows)
            computed.insert(0, rows)
        waits = not program.aliasing and any(e[2] is not None for e in entries)
        inflight.note(self.what, entries, outputs, computed, waits)
        STATE.epoch += 1
        if rows is not None:
            checks.watch(program, rows, self.sites, cells, outs)
        return results

    def _targets(self, flat) -> tuple[list, list]:
        """(the cell each output goes to, the call's results: new tensors for the new values it returns)."""
        out_cells, results = [], list(self.out_flat)
        for kind, ident, ref in self.targets:
            if kind == "arg":
                cell = flat[ident]._cell
            elif kind == "ret":
                old = self.out_flat[ident]
                cell = Cell(None, old.shape, old.dtype, old._cell.sharding)
                results[ident] = ShardedTensor(cell)
            else:
                cell = ref()
            out_cells.append(cell)
        return out_cells, results

    def _before(self, out_cells) -> dict:
        """id(cell) -> the value each cell the program overwrites holds before it stores its outputs."""
        return {id(out_cells[j]): out_cells[j].value for j, _ in self._written if out_cells[j] is not None}

    def _check(self, cells, values, program) -> bool:
        """Check in full the inputs whose array changed since they last passed (``values`` takes
        the copy of one moved onto the program's mesh); False if the replay cannot run."""
        passed = self._passed
        newly = []
        for r in range(self._cells_read):
            value = values[r]
            if passed[r]() is value:
                continue
            cell = cells[r]
            i = self._read_sources[r]
            if cell.is_pending() or isinstance(value, Failed) or (i in self.donated and not cell.owned):
                return False  # (a failed value raises when the Python reads it)
            on_mesh = to_mesh(value, program.mesh)
            if on_mesh is not value:  # copied onto the program's mesh: keep it there if we can
                mesh_moves.keep_moved(cell, value, on_mesh, program.mesh)
            if not self._fits(on_mesh, i, program):
                # the same layout under another name (jax compiles one program per name) is renamed;
                # a donated input is not (its buffers would be consumed under two names)
                if i in self.donated or (on_mesh.shape, on_mesh.dtype) != self.leaf_sigs[i][:2]:
                    return False
                on_mesh = mesh_moves.renamed(cell, on_mesh, self.leaf_sigs[i][3])
                if on_mesh is None:
                    return False
            if cell.value is on_mesh:
                newly.append((r, on_mesh))
            values[r] = on_mesh
        for r, value in newly:
            passed[r] = weakref.ref(value)
        return True

    def _fits(self, array, source: int, program) -> bool:
        """Whether ``array`` has the shape, dtype and layout the program takes at input ``source``."""
        sig = self.leaf_sigs[source]
        return (array.shape, array.dtype) == sig[:2] and array.sharding == sig[3]


def _same(value):
    return value


def _nothing():
    return None


_NOTHING = _nothing  # what no input has passed yet (never an array)
_CELL = operator.attrgetter("_cell")
_VALUE = operator.attrgetter("value")
_OWNED = operator.attrgetter("owned")


def _consumed_by_failed_call(cells, before, what, error) -> None:
    """A replay's call failed at once: cells whose donated buffer it took raise ``ConsumedInputError``
    (the others still hold their values from before it)."""
    for cell in cells:
        old = before.get(id(cell)) if cell is not None else None
        if old is not None and old.is_deleted():
            set_failed(cell, Failed(inflight.consumed_error(what, cell, error)))


class _HostStateMonitor(TorchDispatchMode):
    """Notices what a replay could not repeat: reading CPU scalars, updating CPU tensors in place."""

    def __init__(self):
        super().__init__()
        self.reason: str | None = None
        self.watched: Watched | None = None  # notes the parameters the ops read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # (backward sees saved parameters as new objects)
        if self.watched is not None and torch._C._current_autograd_node() is None:
            for a in args:
                if isinstance(a, ShardedTensor):
                    self.watched.note_tensor(a)
        if self.reason is None:
            if func is aten._local_scalar_dense.default and not isinstance(args[0], ShardedTensor):
                self.reason = "it reads a CPU tensor's value (.item())"
            elif func._schema.is_mutable and any(type(a) is torch.Tensor and a.device.type == "cpu" for a in args):
                self.reason = f"it updates a CPU tensor in place ({func})"
        return func(*args, **kwargs)
