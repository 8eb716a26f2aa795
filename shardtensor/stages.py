"""A compiled step's stages, as JAX's: the program it runs, lowered and compiled, without running it.

``step.lower(*args, **kwargs)`` (``step`` an ``st.compile``'d function) gives a ``Lowered``: the
program a call with these arguments runs, as StableHLO with the shardings of its inputs and
outputs. ``.compile()`` gives a ``Compiled``: the optimized, SPMD-partitioned HLO XLA makes of it,
XLA's memory and cost analysis (per device), and the collectives it runs with the bytes they move
(``hlo_collectives``). ``st.explain(step, *args)`` prints the same for a step. The step does not run
on the devices and no tensor changes. (Lazy work pending before is computed first, as a call
would; a first optimizer step's state, made from shapes, is computed in a small program of its own
before the step records, as a call does it: ``optim_prime``.)

Where the program comes from:

- a call with these arguments has frozen (its replays run a program without the Python, and what
  they assume still holds): that program, and no Python runs;
- otherwise the function runs once, recording (as a call that traces does: the same program), and
  anything that would need a value computed on the devices (``.item()``, printing) raises instead
  of running. Then everything the recording changed is taken back: every tensor's value (parameters,
  buffers, optimizer state, the random key and the seed last given), the gradients of tensors that
  require grad, optimizers' ``state`` and ``param_groups`` and attributes, torch's CPU random
  generator. Other Python state the function changes (a counter of its own, a scheduler it steps)
  stays changed, as after a call.

Memory and collectives are per device; ``Compiled.memory()`` sums XLA's analysis as shardtensor's
out-of-memory check does (arguments + outputs + temporaries - outputs written into donated inputs).
``Lowered.retarget(topology=...)`` / ``.compile(topology=...)`` compile the program for devices that
need not be attached (a TPU slice, through libtpu's compile-only topology): the program is exported
with ``jax.export`` and called on a mesh of those devices of the same shape.

Example::

    @st.compile
    def train_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward(); opt.step(); opt.zero_grad()
        return loss.detach()

    lowered = train_step.lower(x, y)          # nothing runs; no tensor changes
    print(lowered.as_text()[:300])            # StableHLO: func.func public @main(%arg0: ... sdy.sharding ...
    compiled = lowered.compile()
    compiled.memory().total                   # bytes per device
    compiled.collectives()["all-gather"]      # Collective(count=..., bytes=...)
    compiled.cost_analysis()["flops"]
    lowered.compile(topology="v5e:4x4").memory()   # per chip of a 4x4 slice (recorded on 16 devices)
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as JaxSpec
from torch.utils import _pytree as pytree

from shardtensor import optim_steps, runtime
from shardtensor.dtypes import to_torch
from shardtensor.graph import rng
from shardtensor.graph.aliasing import param_aliasing_enabled
from shardtensor.graph.capture import capture
from shardtensor.graph.capture import lower as lower_cells
from shardtensor.graph.execute import run_cells
from shardtensor.graph.program import SCALAR_DTYPES
from shardtensor.graph.state import (
    STATE,
    check_execution_allowed,
    others_pending,
    pending_cells,
    take_back,
    undo_journal,
)
from shardtensor.hlo_collectives import Collective, CollectiveOp, collective_ops, collectives_in_hlo, format_bytes
from shardtensor.mesh import Mesh, mesh_for_jax_mesh
from shardtensor.ops.checks import checks_enabled
from shardtensor.tensor import ShardedTensor

NEW_VALUE = "new pending value"  # (st.explain's label for values a call makes: gradients, new state)
UPDATED = "updated in place"


class Output(NamedTuple):
    """One output of a step's program: what it is (``"output 0"``: the first value the step returns;
    ``"updated in place"``: a tensor it overwrites, a parameter or optimizer state; ``"new pending
    value"``: one it makes and keeps, a gradient), its logical shape and its dtype."""

    label: str
    shape: tuple
    dtype: torch.dtype


class Memory(NamedTuple):
    """Bytes per device of a compiled program (XLA's memory analysis). ``total``: what it holds while
    it runs, its inputs included: ``argument + output + temp - alias`` (``alias``: outputs written
    into donated inputs), as shardtensor's out-of-memory check counts it; ``code``: its machine code."""

    argument: int
    output: int
    temp: int
    alias: int
    code: int
    total: int

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {format_bytes(getattr(self, k))}" for k in ("argument", "output", "temp", "alias"))
        return f"{format_bytes(self.total)} per device ({parts})"


class Lowered:
    """A step's program lowered for its arguments, not compiled: ``as_text()`` (StableHLO),
    ``cost_analysis()`` (XLA's estimate before optimization), ``compile()``.

    ``outputs`` lists what the program computes (``Output``), ``mesh`` is the mesh it runs on,
    ``frozen`` says whether it is the program of a frozen replay (no Python ran), ``jax_lowered`` is
    ``jax.stages.Lowered`` itself.

    Example::

        lowered = step.lower(x, y)
        "sdy.sharding" in lowered.as_text()   # True: the inputs' shardings
        lowered.compile().memory()
    """

    def __init__(self, name: str, jax_lowered, program, outputs: list[Output], frozen: bool, call=None, target=None):
        self.name = name
        self.jax_lowered = jax_lowered
        self.outputs = outputs
        self.frozen = frozen
        self.ops = len(program.steps)
        self.target: Target | None = target  # the devices it was lowered for, when not the mesh's own
        self._program = program
        self._checks = program.checks  # (the program returns its on-device check rows too)
        self._jax_mesh = program.mesh
        self._call = call  # (the jitted replay, its abstract arguments): what ``retarget`` exports
        self._compiled: Compiled | None = None

    @property
    def mesh(self) -> Mesh:
        """The mesh the program was recorded on (``target.mesh``: the devices it was lowered for
        instead, same shape and axes, after ``retarget``)."""
        return mesh_for_jax_mesh(self._jax_mesh)

    def as_text(self, dialect: str = "stablehlo") -> str:
        """The program's text: ``"stablehlo"`` (default; the inputs and outputs carry their
        shardings) or ``"hlo"``. Example: ``step.lower(x).as_text()[:200]``."""
        return self.jax_lowered.as_text(dialect)

    def cost_analysis(self) -> dict | None:
        """XLA's cost estimate of the program before optimization (``flops``, ``bytes accessed``, ...).

        Example: ``step.lower(x).cost_analysis()["flops"]``."""
        return _one_dict(self.jax_lowered.cost_analysis())

    @runtime.with_x64
    def compile(self, topology=None, *, devices=None) -> Compiled:
        """The program compiled by XLA (not run; compiled once per ``Lowered``). With ``topology``
        or ``devices``: ``retarget(topology, devices=devices).compile()``, compiled for those devices.

        Example: ``step.lower(x).compile().as_text()``; ``step.lower(x).compile("v5e:2x4").memory()``."""
        if topology is not None or devices is not None:
            return self.retarget(topology, devices=devices).compile()
        if self._compiled is None:
            _check_tpu_export(self)
            with _donation_warnings_off():
                self._compiled = Compiled(self, self.jax_lowered.compile())
        return self._compiled

    def retarget(self, topology=None, *, devices=None) -> Lowered:
        """This program lowered for other devices, which need not be attached: ``topology``, a TPU
        topology (a name such as ``"v5e:2x4"`` for ``jax.experimental.topologies.get_topology_desc``,
        which needs libtpu installed but no TPU, or a ``TopologyDescription``), or ``devices``, jax
        devices (or a ``jax.sharding.Mesh`` of them), as many as the program's mesh has.

        The program keeps its mesh's shape and axis names and every sharding; it is exported
        (``jax.export``, lowered with the target platform's rules) and called on a mesh of the new
        devices, laid out as ``jax.experimental.mesh_utils.create_device_mesh`` lays them out. So a
        step recorded on simulated CPU devices (``SHARDTENSOR_CPU_DEVICES=16``) shows the memory
        and collectives each chip of a 4x4 v5e slice would have. (A shardtensor lowering with a
        variant for the recording platform keeps it: one, ``optimization_barrier`` on CPU.)

        Example::

            compiled = train_step.lower(x, y).retarget("v5e:4x4").compile()
            compiled.memory().total, compiled.collectives()   # per chip of the slice
        """
        if self._call is None:
            raise ValueError(f"{self.name}: this Lowered has no program to export again")
        return _retargeted(self, _target(self._jax_mesh, topology, devices, self.name))

    def __repr__(self) -> str:
        source = "a frozen replay's program" if self.frozen else "recorded"
        where = f", for {self.target.description}" if self.target is not None else ""
        return (
            f"<Lowered {self.name}: {self.ops} ops, {len(self.outputs)} outputs, mesh {_mesh_text(self.mesh)}"
            f"{where}, {source}>"
        )


class Compiled:
    """A step's program as XLA compiled it (nothing run): ``as_text()`` (the optimized HLO, one
    device's share), ``memory_analysis()`` and ``memory()``, ``cost_analysis()``, ``collectives()``.

    ``jax_compiled`` is ``jax.stages.Compiled`` itself; ``outputs`` and ``mesh`` as ``Lowered``'s.

    Example::

        compiled = step.lower(x, y).compile()
        print(compiled)                          # memory, flops and collectives per device
        compiled.collectives()["all-reduce"].bytes
    """

    def __init__(self, lowered: Lowered, jax_compiled):
        self.lowered = lowered
        self.jax_compiled = jax_compiled
        self.name, self.outputs = lowered.name, lowered.outputs
        self.target: Target | None = lowered.target  # the devices it was compiled for, if not the mesh's
        self._text: str | None = None

    @property
    def mesh(self) -> Mesh:
        """The mesh the program was recorded on (as ``Lowered.mesh``)."""
        return self.lowered.mesh

    def as_text(self) -> str:
        """The optimized HLO XLA compiled (per device, after SPMD partitioning)."""
        if self._text is None:
            self._text = self.jax_compiled.as_text()
        return self._text

    def memory_analysis(self):
        """XLA's memory analysis (bytes per device: ``argument_size_in_bytes``, ``output_size_in_bytes``,
        ``temp_size_in_bytes``, ``alias_size_in_bytes``, ...), or None where the backend has none."""
        return self.jax_compiled.memory_analysis()

    def memory(self) -> Memory | None:
        """``memory_analysis()`` summed up (``Memory``), or None where the backend has none.

        Example: ``step.lower(x).compile().memory().total``   # bytes per device"""
        stats = self.memory_analysis()
        if stats is None:
            return None
        argument, output = stats.argument_size_in_bytes, stats.output_size_in_bytes
        temp, alias = stats.temp_size_in_bytes, stats.alias_size_in_bytes
        code = stats.generated_code_size_in_bytes
        return Memory(argument, output, temp, alias, code, argument + output + temp - alias)

    def cost_analysis(self) -> dict | None:
        """XLA's cost analysis of the compiled program (``flops``, ``bytes accessed``, ...; per device)."""
        return _one_dict(self.jax_compiled.cost_analysis())

    def collectives(self) -> dict[str, Collective]:
        """kind -> ``Collective(count, bytes)``: the collectives of the compiled program (each
        instruction's result buffer on one device, summed: see ``hlo_collectives``).

        Example: ``step.lower(x).compile().collectives()["all-gather"].count``"""
        return collectives_in_hlo(self.as_text())

    def collective_ops(self) -> list[CollectiveOp]:
        """Every collective instruction of the compiled program, in program order."""
        return collective_ops(self.as_text())

    @property
    def output_shardings(self) -> list:
        """The jax sharding of each output (``outputs``' order), as XLA laid them out."""
        shardings = self.jax_compiled.output_shardings
        return list(shardings[0] if self.lowered._checks else shardings)

    def __str__(self) -> str:
        memory = self.memory()
        cost = self.cost_analysis() or {}
        where = f" for {self.target.description}" if self.target is not None else ""
        lines = [f"{self.name}: {self.lowered.ops} ops on mesh {_mesh_text(self.mesh)}, compiled{where} (not run)"]
        lines.append(f"  memory: {memory}" if memory is not None else "  memory: (no analysis on this backend)")
        if "flops" in cost:
            lines.append(f"  flops per device: {cost['flops']:.4g}")
        kinds = [(k, c) for k, c in self.collectives().items() if c.count]
        if not kinds:
            lines.append("  collectives: none")
        for kind, c in kinds:
            lines.append(f"  {kind:<20} {c.count:>4}  {format_bytes(c.bytes):>10}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        where = f", for {self.target.description}" if self.target is not None else ""
        return f"<Compiled {self.name}: {self.lowered.ops} ops, mesh {_mesh_text(self.mesh)}{where}>"


def _one_dict(cost) -> dict | None:
    """XLA's cost analysis as one dict (some jax versions give a list of one per program)."""
    if isinstance(cost, (list, tuple)):
        return cost[0] if cost else None
    return cost


def _mesh_text(mesh: Mesh) -> str:
    names = mesh.axis_names or tuple(str(i) for i in range(len(mesh.mesh_shape)))
    return "(" + ", ".join(f"{n}={s}" for n, s in zip(names, mesh.mesh_shape)) + ")"


@contextlib.contextmanager
def _donation_warnings_off():
    # donation is best effort (as for a run: graph.execute); the filter is scoped to this lowering
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        yield


# --------------------------------------------------------------------------- lowering a call


def lower_call(
    fn: Callable[..., Any],
    args: Sequence,
    kwargs: dict,
    flat: list,
    *,
    name: str,
    frozen=None,
) -> Lowered:
    """The ``Lowered`` program of ``fn(*args, **kwargs)`` (``CompiledFunction.lower``): ``frozen``'s
    (the frozen trace of a call with these arguments, or None) while what it assumes holds, else
    ``fn`` recorded once, everything it changed then taken back. ``flat``: the arguments' leaves."""
    check_execution_allowed(f"{name}.lower(...)")
    if frozen is not None and _replayable(frozen, flat):
        return _from_frozen(frozen, name)
    if STATE.pending:
        run_cells(pending_cells())  # (a call computes what is pending first: its program reads the values)
    return _record(fn, args, kwargs, flat, name)


def _replayable(frozen, flat) -> bool:
    """Whether a call now would replay ``frozen`` (``Frozen.replay``'s checks but the inputs' arrays)."""
    executable = getattr(frozen, "executable", None)
    if executable is None:
        return False
    program = executable.program
    if program.checks != checks_enabled() or program.aliasing != param_aliasing_enabled():
        return False
    return frozen.guard.holds([x for x in flat if isinstance(x, ShardedTensor)])


_TARGET_LABELS = {"old": UPDATED, "arg": UPDATED, "new": NEW_VALUE}


@runtime.with_x64
def _from_frozen(frozen, name: str) -> Lowered:
    """The program a frozen trace replays, lowered from its inputs' shapes, dtypes and shardings."""
    executable = frozen.executable
    program = executable.program
    avals = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype, _, sharding in program.key[2]]
    sizes: dict[str, int] = {}
    for kind, position in program.scalar_slots:
        sizes[kind] = max(sizes.get(kind, 0), position + 1)
    replicated = NamedSharding(program.mesh, JaxSpec())
    vectors = {k: jax.ShapeDtypeStruct((n,), SCALAR_DTYPES[k], sharding=replicated) for k, n in sizes.items()}
    arguments = ([avals[i] for i in program.donated], [avals[i] for i in program.kept], vectors)
    with _donation_warnings_off():
        jax_lowered = executable.lower(*arguments)
    targets = getattr(frozen, "targets", None) or [("new", None)] * len(program.outputs)
    labels = [f"output {t[1]}" if t[0] == "ret" else _TARGET_LABELS.get(t[0], NEW_VALUE) for t in targets]
    jitted = executable if hasattr(executable, "trace") else program.make_executable()  # (a stored one: again)
    outputs = _outputs(program, jax_lowered, labels)
    return Lowered(name, jax_lowered, program, outputs, frozen=True, call=(jitted, arguments))


def _outputs(program, jax_lowered, labels) -> list[Output]:
    """Each output's label, logical shape (the padding of uneven shardings taken off) and dtype."""
    info = jax_lowered.out_info[0] if program.checks else jax_lowered.out_info
    outputs = []
    for label, (_, pad, _), aval in zip(labels, program.outputs, info):
        shape = tuple(aval.shape)
        if pad is not None:
            shape = tuple(n - hi for n, (_, hi) in zip(shape, pad))
        outputs.append(Output(label, shape, to_torch(aval.dtype)))
    return outputs


def _record(fn, args, kwargs, flat, name: str) -> Lowered:
    """Record ``fn`` as a traced call would, lower what it computes, and take back what it changed."""
    guard = (
        f"{name}.lower(...) records the step without running anything, and the step needs a value computed "
        "on the devices here (.item(), .cpu(), printing, a data-dependent shape or branch): its calls run as "
        "more than one program. Move that read out of the step to see its program."
    )
    before = _StateBefore()
    optim_steps.install()  # (as a traced call: torch's default optimizers count their steps on the devices)
    seen = None
    try:
        with undo_journal() as journal:
            with capture(tracing=True, guard=guard) as seen:
                try:
                    out = fn(*args, **kwargs)
                finally:
                    optim_steps.restore_groups()
                    # (a first step's priming put stand-ins into its groups' lists, then replaced the
                    # lists: given back now, the stand-ins and their updates die, as after a call)
                    before.restore_lists()
            cells = seen.pending()
            if not cells:
                raise ValueError(
                    f"{name}.lower(...): the call recorded nothing to compute on the devices (it returned no "
                    "new tensor on st.device() and changed none)"
                )
            labels = _labels(cells, flat, out, seen)
            # (a call donates the buffers it overwrites unless another thread's pending work reads them)
            lowered = lower_cells(cells, donate=not others_pending())
    finally:
        if seen is not None:
            for cell in seen.pending():  # (what it recorded stays uncomputed: no sync runs it)
                STATE.pending.pop(weakref.ref(cell), None)
        take_back(journal)
        before.restore()
    return _lower_recorded(lowered, labels, name)


@runtime.with_x64
def _lower_recorded(lowered, labels, name: str) -> Lowered:
    jitted, arguments = lowered.jitted(), lowered.abstract_arguments()
    with _donation_warnings_off():
        jax_lowered = jitted.lower(*arguments)
    program = lowered.program
    outputs = _outputs(program, jax_lowered, labels)
    return Lowered(name, jax_lowered, program, outputs, frozen=False, call=(jitted, arguments))


def _labels(cells, flat, out, seen) -> list[str]:
    """What each computed cell is to the call: a value it returns, one it updates, one it makes."""
    returned: dict[int, int] = {}
    for i, x in enumerate(pytree.tree_leaves(out)):
        if isinstance(x, ShardedTensor) and not x._chain:
            returned.setdefault(id(x._cell), i)
    labels = []
    for cell in cells:
        if id(cell) in returned:
            labels.append(f"output {returned[id(cell)]}")
        else:
            labels.append(NEW_VALUE if seen.is_new(cell) else UPDATED)
    return labels


class _StateBefore:
    """The Python state a recorded step may change, as it is now: each tensor that requires grad and
    its ``.grad``, each optimizer's attributes, ``state`` and ``param_groups``, torch's CPU generator,
    the random key's cell and the seed last given (``graph.rng``);
    ``restore()`` puts back what changed. (Tensors' values are taken back by ``graph.state``'s journal.)"""

    def __init__(self):
        self.grads: list = []
        self.optimizers: list = []
        with torch._C.DisableTorchFunctionSubclass():  # (attribute reads at C speed, no subclass code)
            for obj in gc.get_objects():
                kind = type(obj)  # (not isinstance: a proxy's __class__ may be anything, or warn)
                if issubclass(kind, torch.Tensor):
                    if obj.requires_grad and obj.is_leaf:
                        self.grads.append((obj, obj.grad))
                elif issubclass(kind, torch.optim.Optimizer):
                    self.optimizers.append(_OptimizerBefore(obj))
        self.cpu_rng = torch.get_rng_state()
        self.key = rng.saved()

    def restore(self) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            for tensor, grad in self.grads:
                if tensor.grad is not grad:
                    tensor.grad = grad
        for optimizer in self.optimizers:
            optimizer.restore()
        torch.set_rng_state(self.cpu_rng)
        rng.restore(self.key)

    def restore_lists(self) -> None:
        """Each optimizer's ``restore_lists`` (``_OptimizerBefore``)."""
        for optimizer in self.optimizers:
            optimizer.restore_lists()


class _OptimizerBefore:
    """An optimizer's attributes, ``state`` (each parameter's dict and its entries) and
    ``param_groups`` (each group's entries, and the items of those that are lists: its ``params``,
    which a first step's priming swaps for stand-ins in place, ``optim_prime``), as they are now."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.attributes = dict(vars(optimizer))
        self.state = {key: (entry, dict(entry)) for key, entry in optimizer.state.items()}
        self.groups = [(group, dict(group)) for group in optimizer.param_groups]
        self.lists = [(v, list(v)) for group in optimizer.param_groups for v in group.values() if type(v) is list]
        self.group_list = list(optimizer.param_groups)

    def restore(self) -> None:
        opt = self.optimizer
        attributes = vars(opt)
        for key in [k for k in attributes if k not in self.attributes]:
            del attributes[key]
        for key, value in self.attributes.items():
            if attributes.get(key, _MISSING) is not value:
                attributes[key] = value
        state = opt.state
        for key in [k for k in state if k not in self.state]:
            del state[key]
        for key, (entry, contents) in self.state.items():
            if state.get(key) is not entry:
                state[key] = entry
            _put_back(entry, contents)
        groups = opt.param_groups
        if len(groups) != len(self.group_list) or any(a is not b for a, b in zip(groups, self.group_list)):
            groups[:] = self.group_list
        for group, contents in self.groups:
            _put_back(group, contents)
        self.restore_lists()

    def restore_lists(self) -> None:
        """Give the lists among the groups' items (``params``) their items again."""
        for items, before in self.lists:
            if len(items) != len(before) or any(a is not b for a, b in zip(items, before)):
                items[:] = before


_MISSING = object()


def _put_back(target: dict, contents: dict) -> None:
    """Give ``target`` the items of ``contents`` again (writing only where an item changed)."""
    if len(target) == len(contents) and all(target.get(k, _MISSING) is v for k, v in contents.items()):
        return
    target.clear()
    target.update(contents)


# --------------------------------------------------------------------------- other devices


# libtpu (with JAX 0.10.2) aborts the process compiling an exported shardtensor step for a TPU
# topology: "import_shardy_attrs.cc:184 Check failed: funcResultSharding.getNumOperands() == 1" in
# Shardy's round-trip import (seen 6 Dec 2026 on v5e 2x4 and 4x4, with and without donation). A
# CHECK failure cannot be caught: refuse first, unless asked to try (a newer libtpu may compile it).
TRY_TPU_EXPORT = "SHARDTENSOR_TRY_TPU_EXPORT"


def _check_tpu_export(lowered: Lowered) -> None:
    target = lowered.target
    if target is None or target.platform != "tpu" or os.environ.get(TRY_TPU_EXPORT) == "1":
        return
    raise RuntimeError(
        f"{lowered.name}: compiling for {target.description} is refused: libtpu aborts the whole process "
        "compiling an exported shardtensor program for a TPU topology (a CHECK failure in Shardy's import, "
        f"funcResultSharding.getNumOperands() == 1). Compile on the slice itself, or set {TRY_TPU_EXPORT}=1 "
        "to try with this libtpu in a process you can lose (lowered.as_text() works without compiling)."
    )


class Target(NamedTuple):
    """The devices a program was lowered for when they are not its mesh's own (``Lowered.retarget``):
    ``mesh``, a ``jax.sharding.Mesh`` of them with the program mesh's shape and axis names; their
    ``platform``; ``description``, e.g. ``"v5e:2x4"`` or ``"8 cpu devices"``."""

    mesh: jax.sharding.Mesh
    platform: str
    description: str


def _target(jax_mesh, topology, devices, name: str) -> Target:
    """The ``Target`` for ``Lowered.retarget``'s arguments, the program running on ``jax_mesh``."""
    if (topology is None) == (devices is None):
        raise TypeError(
            f"{name}: retarget(...) takes a TPU topology (topology='v5e:2x4', or a "
            "jax.experimental.topologies.TopologyDescription) or devices=[jax devices], one of the two"
        )
    description = None
    if topology is not None:
        if isinstance(topology, str):
            description, topology = topology, _topology(topology, name)
        if not hasattr(topology, "devices"):
            raise TypeError(
                f"{name}: topology= takes a topology's name ('v5e:2x4') or a TopologyDescription, "
                f"not a {type(topology).__name__}"
            )
        devices = topology.devices
    shape, axes = tuple(jax_mesh.devices.shape), tuple(jax_mesh.axis_names)
    if isinstance(devices, jax.sharding.Mesh):
        if tuple(devices.devices.shape) != shape:
            raise ValueError(
                f"{name}: the program runs on a mesh of shape {shape} ({dict(jax_mesh.shape)}); the mesh given "
                f"has shape {tuple(devices.devices.shape)}"
            )
        grid = devices.devices
    else:
        devices = list(devices)
        if not devices or not all(isinstance(d, jax.Device) for d in devices):
            raise TypeError(f"{name}: devices= takes jax devices (or a jax.sharding.Mesh of them)")
        if len(devices) != jax_mesh.devices.size:
            raise ValueError(
                f"{name}: the program runs on a mesh of {jax_mesh.devices.size} devices {dict(jax_mesh.shape)}; "
                f"{description or 'devices='} has {len(devices)}. Record the step on a mesh of "
                f"{len(devices)} devices (on CPU: SHARDTENSOR_CPU_DEVICES={len(devices)}) to compile it for them"
            )
        grid = _device_grid(shape, devices)
    platform = grid.flat[0].platform
    if description is None:
        description = f"{grid.size} {platform} devices"
    return Target(jax.sharding.Mesh(grid, axes), platform, description)


def _device_grid(shape, devices):
    """``devices`` laid out as ``shape``: as jax lays out a mesh on a TPU's torus, else in order."""
    from jax.experimental import mesh_utils  # noqa: PLC0415  (jax's experimental module, read when used)

    try:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except Exception:  # noqa: BLE001  (no physical layout for this shape: the devices in order)
        return np.array(devices, dtype=object).reshape(shape)


def _topology(topology_name: str, name: str):
    """``jax.experimental.topologies.get_topology_desc(topology_name, "tpu")``, or a clear error."""
    from jax.experimental import topologies  # noqa: PLC0415

    try:
        return topologies.get_topology_desc(topology_name, "tpu")
    except RuntimeError as error:
        if "not installed" in str(error):
            raise RuntimeError(
                f"{name}: compiling for the TPU topology {topology_name!r} needs libtpu on this machine (no TPU "
                "needs to be attached: pip install 'jax[tpu]'), and it is not installed here. On any machine, "
                "devices=[...] compiles for other devices of an attached platform."
            ) from error
        raise ValueError(f"{name}: no TPU topology {topology_name!r}: {error}") from error
    except Exception as error:  # noqa: BLE001  (libtpu's errors: a name it does not know, options it needs)
        raise ValueError(
            f"{name}: no TPU topology {topology_name!r} ({error}). Make one with "
            "jax.experimental.topologies.get_topology_desc(...) and pass it as topology="
        ) from error


@runtime.with_x64
def _retargeted(lowered: Lowered, target: Target) -> Lowered:
    """``lowered``'s program exported for ``target``'s platform and lowered on its mesh."""
    jitted, arguments = lowered._call
    try:
        exported = jax.export.export(jitted, platforms=(target.platform,))(*arguments)
    except Exception as error:
        raise RuntimeError(
            f"{lowered.name}: its program could not be lowered for {target.description}: {error}"
        ) from error

    def on_target(aval):
        sharding = aval.sharding
        if isinstance(sharding, NamedSharding):
            spec = sharding.spec
        elif sharding is None or sharding.is_fully_replicated:
            spec = JaxSpec()
        else:  # (every input of a shardtensor program is laid out over its mesh)
            raise ValueError(f"{lowered.name}: an input's sharding is not over the program's mesh: {sharding}")
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=NamedSharding(target.mesh, spec))

    with _donation_warnings_off():
        jax_lowered = jax.jit(exported.call, donate_argnums=(0,)).lower(*jax.tree.map(on_target, arguments))
    return Lowered(
        lowered.name,
        jax_lowered,
        lowered._program,
        lowered.outputs,
        lowered.frozen,
        call=lowered._call,
        target=target,
    )
