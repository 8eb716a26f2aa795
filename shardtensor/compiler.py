"""``st.compile(fn)``: trace a function into one JAX program and replay it without its Python.

A call either runs ``fn`` in lazy mode, recording what it does (which tensors it reads: arguments,
parameters, optimizer state, the RNG key; which it writes; what it returns), then runs that as one
program; or, once frozen, feeds the current values to the program and writes the results back,
running no Python of ``fn``. A traced call freezes when a replay could repeat it and it left the
Python state it could read as it found it (``replay_guard.Snapshot`` on entry and on exit:
``trace_reads`` notes the code it ran and the globals that code loads). A replay runs while that
state is unchanged (``replay_check.Guard``); otherwise the call traces again (one cached executable
per program: no recompile).

A replay could not repeat a call that reads a device value on the host, seeds or draws CPU random
numbers, calls a clock or a random source, prints, advances an iterator made before it, updates a
CPU tensor in place or computes with a CPU tensor argument on the host (``Trace.broken``, and
``full_graph=True`` raises on the reads). What a replay does feed anew: the tensor arguments, a CPU
tensor argument moved to the devices inside (uploaded again), an optimizer's learning rate
(``optim_steps.LiveValue``). Tensors made on the host inside ``fn`` from what the guard watches
(``torch.tensor(data, device=...)``) are constants of the program, fed by value. With
``SHARDTENSOR_DEBUG=1``, a call that could not freeze, or a frozen call that ran its Python again,
says why.

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
from shardtensor import optim_steps, stages
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
from shardtensor.trace_reads import global_reads, reads_attribute, recording

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
        self._roots: dict = {}  # signature -> where its last trace's state was found (replay_guard.Roots)
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

    def lower(self, *args: Any, **kwargs: Any) -> stages.Lowered:
        """The program a call with these arguments runs, lowered, without running it: ``.as_text()``
        (StableHLO), ``.compile()`` (then ``.as_text()``, ``.memory()``, ``.cost_analysis()``,
        ``.collectives()``), as ``jax.jit(f).lower(*args)``. A frozen call's program needs no Python;
        else ``fn`` runs once, recording, and what it changed is taken back (``stages``).

        Example::

            compiled = train_step.lower(x, y).compile()
            compiled.memory().total, compiled.collectives()["all-gather"]
        """
        flat, signature = _key(args, kwargs)
        return stages.lower_call(self.fn, args, kwargs, flat, name=self.name, frozen=self._frozen.get(signature))

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
        trace = _run_trace(cells, arguments, self.name, flat, out, seen.first_serial, broken, _uploads(flat, seen))
        before = roots
        roots = self._roots[signature] = Roots(self.fn, noted.objects(), global_reads(ran.code_globals))
        exit_ = None
        if trace.broken is None and entry is not None and before is not None:
            # (an optimizer's learning rate a replay reads anew, unless the user's code reads the groups)
            live_keys = frozenset() if reads_attribute(ran.code_globals, "param_groups") else _live_keys(seen.uploads)
            exit_, trace.broken = _unchanged(entry, before, roots, objects, trace.made_cells(), live_keys)
        if trace.broken is None and exit_ is not None:
            replay_guard = exit_.guard(None if self.guarded_state else tensor_args, exit_.produced_grads, debug)
            self._frozen[signature] = trace.freeze(replay_guard, self.name)
            counters.increment("CompileFrozen")
        elif trace.broken is not None and debug:
            recompile.emit(f"{self.name}: re-running Python each call: {trace.broken}")
        return out


def _uploads(flat, seen) -> dict:
    """id of a cell a replay uploads anew -> (a CPU tensor argument's position, or an optimizer's
    ``LiveValue``; its ``Upload``): what the trace uploaded from them (``Trace``'s ``hosts``)."""
    positions = {id(x): i for i, x in enumerate(flat) if type(x) is torch.Tensor}
    hosts: dict = {}
    for src, how, cell in seen.uploads:
        if isinstance(src, optim_steps.LiveValue):
            hosts[id(cell)] = (src, how)
        elif id(src) in positions:
            hosts[id(cell)] = (positions[id(src)], how)
    return hosts


def _live_keys(uploads) -> frozenset:
    """(id of an optimizer's group, key) for each ``LiveValue`` the trace uploaded."""
    found = [(src.group(), src.key) for src, _, _ in uploads if isinstance(src, optim_steps.LiveValue)]
    return frozenset((id(group), key) for group, key in found if group is not None)


def _unchanged(entry: Snapshot, before: Roots, roots: Roots, objects: list, made: frozenset, live: frozenset):
    """(the state on exit, None) if the call left what it could read as it found it on entry, else
    (None, why not). ``entry`` was reached from ``before``, the last call's roots; this call's
    ``roots`` must be among them (a first call reads more: an optimizer's state made), and what
    ``before`` reaches now must equal ``entry`` (``made``: the cells the program made, a gradient
    among them counting as the one it replaced; ``live``: values a replay reads anew)."""
    if not before.covers(roots):
        return None, "it read state the last call did not (it is traced again before it freezes)"
    again = Snapshot(before, objects, made, live)
    if not again.same_as(entry):
        return None, f"the state it can read changed during the call: {again.difference(entry)}"
    exit_ = again if roots.covers(before) else Snapshot(roots, objects, made, live)
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
