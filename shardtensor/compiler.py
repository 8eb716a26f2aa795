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
import operator
from collections.abc import Callable
from typing import Any, overload

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from shardtensor import metrics as counters
from shardtensor import optim_steps, trace_diff
from shardtensor.dispatch.record import signature as record_signature
from shardtensor.frozen_replay import STALE, Trace
from shardtensor.graph import checks, inflight, recompile
from shardtensor.graph.capture import capture
from shardtensor.graph.execute import Execution, recover, run_cells
from shardtensor.graph.ir import noting_sites
from shardtensor.graph.state import (
    STATE,
    check_execution_allowed,
    locked,
    others_pending,
    pending_cells,
)
from shardtensor.ops import precision as matmul_precision
from shardtensor.replay_guard import Roots, Snapshot, Touched, touched
from shardtensor.tensor import ShardedTensor
from shardtensor.trace_reads import global_reads, recording

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
    it, so each call waits for its check flags: on an accelerator, when they need no product (index
    bounds of ids and targets), a repeated call computes them first in a small program of their own
    and waits for that only (``graph.early_rows``: the host prepares the next call while the device
    runs this one); else it waits for its program to finish. With ``raise_on_call=False`` a call returns as
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
        self._roots: dict = {}  # signature -> where its last trace's state was found (replay_guard.Roots)
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
            # (it reads the earlier runs' checks first)
            result = frozen.replay(flat, self.name, tensors, own_checks=self.raise_on_call)
            if result is not STALE:
                if self.raise_on_call:  # a failed on-device check raises on the call that ran it
                    checks.verify(wait_late=False)  # (its early rows, when it has them: graph.early_rows)
                return result
            self._frozen.pop(signature, None)
            if recompile.enabled():
                recompile.emit(f"{self.name}: runs its Python again: {frozen.stale_reason()}")
        elif not synced:
            run_cells(())  # nothing pending: an earlier run's failed check or failure raises first
        out = self._trace(signature, flat, args, kwargs, frozen)
        if self.raise_on_call:
            checks.verify()
        return out

    def _trace(self, signature, flat, args, kwargs, stale=None):
        """Run ``fn`` and record it; ``stale``: the frozen trace this call could not replay.

        The call freezes when it could be replayed (``Trace.broken`` is None: no host reads, no CPU
        state changed, nothing a replay could not repeat) and left the Python state it could read
        as it found it (``replay_guard.Snapshot``: the state on entry, reached from the roots the
        last trace found, equals the state on exit)."""
        counters.increment("CompileTrace")
        objects = [x for x in flat if not isinstance(x, torch.Tensor)]
        tensor_args = [x for x in flat if isinstance(x, ShardedTensor)]
        roots = self._roots.get(signature)
        entry = Snapshot(roots, objects) if roots is not None else None  # the state before fn runs
        monitor = _HostStateMonitor(flat)
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
        with capture(tracing=True, guard=guard) as seen, touched() as noted, monitor, sites:
            monitor.touched = noted
            with recording() as ran:
                try:
                    out = self.fn(*args, **kwargs)
                finally:
                    optim_steps.restore_groups()
        broken = seen.broken or monitor.reason or ran.reason
        cells = seen.pending()  # nothing else of this thread is pending: the call started with a sync
        arguments = [(i, x._cell) for i, x in enumerate(flat) if isinstance(x, ShardedTensor)]
        positions = {id(x): i for i, x in enumerate(flat) if type(x) is torch.Tensor}
        hosts = {id(cell): (positions[id(src)], how) for src, how, cell in seen.uploads if id(src) in positions}
        trace = _run_trace(cells, arguments, self.name, flat, out, seen.first_serial, broken, hosts)
        before = roots
        roots = self._roots[signature] = Roots(self.fn, noted.objects(), global_reads(ran.code_globals))
        last = self._last_trace.get(signature)
        self._last_trace[signature] = trace.fingerprint
        exit_ = None
        if trace.broken is None and entry is not None and before is not None:
            exit_, trace.broken = _unchanged(entry, before, roots, objects, trace.made_cells())
        if trace.broken is None and exit_ is not None:
            replay_guard = exit_.guard(None if self.guarded_state else tensor_args, exit_.produced_grads, debug)
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


def _unchanged(entry: Snapshot, before: Roots, roots: Roots, objects: list, made: frozenset):
    """(the state on exit, None) if the call left what it could read as it found it on entry, else
    (None, why not). ``entry`` was reached from ``before``, the last call's roots; this call's
    ``roots`` must be among them (a first call reads more: an optimizer's state made), and what
    ``before`` reaches now must equal ``entry`` (``made``: the cells the program made, a gradient
    among them counting as the one it replaced)."""
    if not before.covers(roots):
        return None, "it read state the last call did not (it is traced again before it freezes)"
    again = Snapshot(before, objects, made)
    if not again.same_as(entry):
        return None, f"the state it can read changed during the call: {again.difference(entry)}"
    exit_ = again if roots.covers(before) else Snapshot(roots, objects, made)
    return exit_, exit_.reason


@locked
def _run_trace(cells, arguments, name, flat, out, first_serial, broken, hosts=None):
    """Compile and run what a traced call left pending; the ``Trace`` of the call (``hosts``: see
    ``Trace``)."""
    with recompile.naming(arguments, name):
        # another thread's pending graph may read a buffer this one would donate
        execution = Execution.prepare(cells, donate=not others_pending()) if cells else None
    trace = Trace(execution, flat, out, first_serial, broken, hosts)
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
            # (a float by its bits: -0.0 and 0.0 are other programs' scalars, as NaN is one value)
            key = x.hex() if type(x) is float else x if isinstance(x, (int, float, bool, str, type(None))) else id(x)
            parts.append(("V", type(x), key))
    return parts


class _HostStateMonitor(TorchDispatchMode):
    """Notices what a replay could not repeat: reading CPU scalars, updating CPU tensors in place,
    drawing random numbers on the CPU; notes the parameters the ops read (``touched``)."""

    def __init__(self, flat=()):
        super().__init__()
        self.reason: str | None = None
        self.touched: Touched | None = None
        # the CPU tensor arguments' storages: a replay uploads such an argument again when the trace
        # moved it whole to the devices, but cannot repeat host work done with it (a slice, an op)
        self._cpu_args = {_storage(x) for x in flat if type(x) is torch.Tensor and x.device.type == "cpu"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # (backward sees saved parameters as new objects)
        if self.touched is not None and torch._C._current_autograd_node() is None:
            for a in args:
                if isinstance(a, ShardedTensor):
                    self.touched.note_tensor(a)
        if self.reason is None:
            self.reason = self._why_unrepeatable(func, args, kwargs)
        return func(*args, **kwargs)

    def _why_unrepeatable(self, func, args, kwargs) -> str | None:
        if self._cpu_args and not _moves_to_device(func, kwargs):
            used = [a for a in (*args, *kwargs.values()) if type(a) is torch.Tensor and a.device.type == "cpu"]
            if any(_storage(a) in self._cpu_args for a in used):
                return (
                    f"it computes with a CPU tensor argument on the host ({func}): a replay could only "
                    "move such an argument to the devices whole (x.to(device))"
                )
        if func is aten._local_scalar_dense.default and not isinstance(args[0], ShardedTensor):
            return "it reads a CPU tensor's value (.item())"
        if func._schema.is_mutable and any(type(a) is torch.Tensor and a.device.type == "cpu" for a in args):
            return f"it updates a CPU tensor in place ({func})"
        on_device = any(isinstance(a, ShardedTensor) for a in (*args, *kwargs.values()))
        device = kwargs.get("device")
        cpu = not on_device and (device is None or torch.device(device).type == "cpu")
        if cpu and torch.Tag.nondeterministic_seeded in func.tags:
            return f"it draws random numbers on the CPU ({func})"
        return None


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else id(t)


def _moves_to_device(func, kwargs) -> bool:
    """``x.to(device)`` of a CPU tensor (what a replay can do again with a new argument)."""
    device = kwargs.get("device")
    return func is aten._to_copy.default and device is not None and torch.device(device).type != "cpu"
