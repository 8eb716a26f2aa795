"""``st.explain``: the shardings XLA will choose and the collectives it will run, before running.

``explain(t)`` compiles the pending graph that would compute ``t`` (or a list of tensors) and
reports, for every output, its shape, dtype and the sharding XLA's propagation gave it, and the
collectives of the compiled program, with the bytes they move. ``explain(fn, *args)`` first calls
``fn`` in lazy mode, then explains what it recorded. ``explain(step, *args)``, ``step`` an
``st.compile``'d function, explains the program a call with these arguments runs (``step.lower``:
nothing runs, nothing changes), with XLA's memory and flops per device; ``explain(compiled)`` does
the same for a ``step.lower(...)`` (or its ``.compile()``). Nothing is executed.

What "bytes" means: for each collective instruction of the compiled (per-device, SPMD-partitioned)
HLO, the size of its result buffer on one device, summed over the instructions of that kind: the
data each device ends up receiving, not the wire traffic of the algorithm (``hlo_collectives``,
which reads them from the HLO text, says more).

Example::

    a = st.shard(torch.randn(8, 16), mesh, (None, "x"))
    b = st.shard(torch.randn(16, 4), mesh, ("x", None))
    print(st.explain(a @ b))
    # output 0: (8, 4) float32  {replicated}  P(None, None)
    # all-reduce  1  128 B
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jax.sharding import NamedSharding
from torch.utils import _pytree as pytree

from shardtensor import debug, runtime, stages
from shardtensor import sharding as sh
from shardtensor.compiler import CompiledFunction
from shardtensor.graph import views
from shardtensor.graph.capture import capture, lower
from shardtensor.graph.ir import Cell, Pending
from shardtensor.hlo_collectives import (  # noqa: F401  (result_bytes, COLLECTIVE_KINDS: read from here too)
    COLLECTIVE_KINDS,
    Collective,
    CollectiveOp,
    collective_ops,
    collectives_in_hlo,
    format_bytes,
    result_bytes,
)
from shardtensor.mesh import Mesh, mesh_for_jax_mesh
from shardtensor.tensor import ShardedTensor

# --------------------------------------------------------------------------- the explanation


@dataclass
class OutputSharding:
    """One output: what it is, its shape and dtype, and the sharding it gets (or has)."""

    label: str  # "output 0", "updated in place", "new pending value"
    shape: tuple
    dtype: torch.dtype
    sharding: str  # PyTorch/XLA's sharding string
    partition_spec: sh.PartitionSpec | None  # over the mesh's axes, when a spec expresses it
    pending: bool  # computed by the explained program (False: already computed)


def _spec_text(spec) -> str:
    if spec is None:
        return "(no PartitionSpec expresses it)"
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


@dataclass
class Explanation:
    """What ``st.explain`` found: per output its sharding, and the program's collectives.

    ``collectives`` maps each kind (all-gather, all-reduce, reduce-scatter, all-to-all,
    collective-permute) to ``Collective(count, bytes)``; ``ops`` lists the instructions; ``hlo`` is
    the compiled program's text ('' when nothing needed compiling).
    """

    outputs: list[OutputSharding]
    collectives: dict[str, Collective]
    mesh: Mesh | None
    compiled: bool
    ops: list[CollectiveOp] = field(default_factory=list)
    hlo: str = field(default="", repr=False)
    # a compiled step's (``explain(step, *args)``): XLA's memory and flops per device, what it is
    memory: stages.Memory | None = None
    flops: float | None = None
    step: str | None = None  # "train_step", or "train_step for v5e:2x4"
    platform: str | None = None  # the devices' platform, when not this process's (a step compiled for a TPU)

    @property
    def total_count(self) -> int:
        """The number of collective instructions."""
        return sum(c.count for c in self.collectives.values())

    @property
    def total_bytes(self) -> int:
        """The bytes of all collective instructions (per-device result buffers, summed)."""
        return sum(c.bytes for c in self.collectives.values())

    def _header(self) -> str:
        n = len(self.outputs)
        what = "compiled, not run" if self.compiled else "already computed, nothing to compile"
        mesh = ""
        if self.mesh is not None:
            axes = ", ".join(f"{k}={v}" for k, v in zip(debug._axis_labels(self.mesh), self.mesh.mesh_shape))
            mesh = f" on mesh ({axes}), {self.mesh.size()} {self.platform or runtime.device_type()} devices"
        step = f"{self.step}: " if self.step else ""
        return f"st.explain: {step}{n} output{'s' if n != 1 else ''}{mesh} ({what})"

    def _costs(self) -> list[str]:
        """A compiled step's memory and flops lines."""
        lines = []
        if self.memory is not None:
            lines.append(f"memory: {self.memory}")
        if self.flops is not None:
            lines.append(f"flops per device: {self.flops:.4g}")
        return lines

    def __str__(self) -> str:
        lines = [self._header()]
        shown = [o for o in self.outputs if o.label != "new pending value"]
        hidden = len(self.outputs) - len(shown)
        width = max((len(o.label) for o in shown), default=0)
        for o in shown:
            dtype = str(o.dtype).removeprefix("torch.")
            state = "" if o.pending else "  [computed]"
            lines.append(
                f"  {o.label:<{width}}  {tuple(o.shape)} {dtype}  {o.sharding}  {_spec_text(o.partition_spec)}{state}"
            )
        if hidden:
            lines.append(
                f"  and {hidden} other pending value(s) the call created (gradients, values "
                "saved for backward, ...): see .outputs"
            )
        lines += self._costs()
        if not self.total_count:
            lines.append("collectives: none")
            return "\n".join(lines)
        lines.append("collectives (bytes: each instruction's result buffer on one device, summed):")
        for kind, c in self.collectives.items():
            if c.count:
                lines.append(f"  {kind:<20} {c.count:>4}  {format_bytes(c.bytes):>10}")
        lines.append(f"  {'total':<20} {self.total_count:>4}  {format_bytes(self.total_bytes):>10}")
        for op in self.ops[:20]:
            lines.append(f"    {op.kind} -> {op.result_type}")
        if len(self.ops) > 20:
            lines.append(f"    ... {len(self.ops) - 20} more (see .ops)")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        e = html.escape
        cell = 'style="padding:2px 8px;text-align:left;border-bottom:1px solid #dddddd"'
        rows = "".join(
            f"<tr><td {cell}>{e(o.label)}</td><td {cell}>{e(str(tuple(o.shape)))}</td>"
            f"<td {cell}>{e(str(o.dtype).removeprefix('torch.'))}</td><td {cell}>{e(o.sharding)}</td>"
            f"<td {cell}>{e(_spec_text(o.partition_spec))}</td>"
            f"<td {cell}>{'pending' if o.pending else 'computed'}</td></tr>"
            for o in self.outputs
        )
        head = "".join(
            f"<th {cell}>{h}</th>" for h in ("output", "shape", "dtype", "sharding", "PartitionSpec", "state")
        )
        parts = [
            f"<div><b>{e(self._header())}</b></div>",
            f'<table style="border-collapse:collapse"><tr>{head}</tr>{rows}</table>',
        ]
        parts += [f"<div>{e(line)}</div>" for line in self._costs()]
        if self.total_count:
            crow = "".join(
                f"<tr><td {cell}>{e(k)}</td><td {cell}>{c.count}</td><td {cell}>{e(format_bytes(c.bytes))}</td></tr>"
                for k, c in self.collectives.items()
                if c.count
            )
            crow += (
                f"<tr><td {cell}><b>total</b></td><td {cell}><b>{self.total_count}</b></td>"
                f"<td {cell}><b>{e(format_bytes(self.total_bytes))}</b></td></tr>"
            )
            parts.append("<div>collectives (bytes: each instruction's result buffer on one device, summed)</div>")
            parts.append(
                f'<table style="border-collapse:collapse"><tr><th {cell}>kind</th>'
                f"<th {cell}>count</th><th {cell}>bytes</th></tr>{crow}</table>"
            )
        else:
            parts.append("<div>collectives: none</div>")
        return f'<div class="shardtensor-explain" style="font-family:monospace;font-size:12px">{"".join(parts)}</div>'


# --------------------------------------------------------------------------- explain


def explain(
    t_or_fn: ShardedTensor | Sequence[ShardedTensor] | Callable[..., Any], *args: Any, **kwargs: Any
) -> Explanation:
    """Which shardings XLA gives the outputs, and which collectives it inserts — without running.

    ``explain(t)`` / ``explain([t1, t2])``: the pending graph that would compute these tensors is
    compiled (not run; they stay pending). A tensor already computed reports its current sharding
    and adds no collectives.

    ``explain(fn, *args, **kwargs)``: calls ``fn(*args, **kwargs)`` in lazy mode — its effects
    happen as for any call (in-place updates, ``.grad``, ...), but stay pending — then explains the
    program that computes what it returned together with what it changed, before anything runs.
    The next ``sync()`` (or reading a value) runs it as usual.

    Compiling here bypasses shardtensor's executable cache: ``UncachedCompile``, ``CachedCompile``
    and ``CompileTime`` do not change, and the next ``sync()`` compiles and counts as it would have.
    With a persistent cache (``initialize_cache``) JAX may store this compilation (a
    ``PersistentCacheMiss``), so that a later compile of the same program can be a
    ``PersistentCacheHit``. A replicated input living on another mesh is copied onto the graph's
    mesh (``ReplicateToGraphMesh``), as a run would do; nothing else moves.

    ``explain(step, *args, **kwargs)``, ``step`` an ``st.compile``'d function: the program a call
    with these arguments runs, as ``step.lower(*args, **kwargs).compile()`` gives it (a frozen
    call's program, else the function recorded once and everything it changed taken back: no
    tensor, gradient or optimizer state changes), with XLA's memory and flops per device
    (``.memory``, ``.flops``). ``explain(lowered)`` / ``explain(compiled)`` take what
    ``step.lower(...)`` and its ``.compile(...)`` return (a program compiled for a TPU topology too).

    Example::

        ex = st.explain(F.cross_entropy, logits, targets)
        ex.collectives["all-gather"].count    # 0: the batch-sharded loss stays local
        print(ex)                              # outputs, shardings, collectives and bytes
        print(st.explain(train_step, x, y))    # a compiled step: its program, memory and collectives
    """
    if isinstance(t_or_fn, CompiledFunction):
        return _explain_compiled(t_or_fn.lower(*args, **kwargs).compile())
    if isinstance(t_or_fn, (stages.Lowered, stages.Compiled)):
        if args or kwargs:
            raise TypeError(
                "st.explain(lowered or compiled step) takes no further arguments: its arguments were "
                "given to step.lower(...)"
            )
        return _explain_compiled(t_or_fn.compile() if isinstance(t_or_fn, stages.Lowered) else t_or_fn)
    if callable(t_or_fn) and not isinstance(t_or_fn, torch.Tensor):
        return _explain_call(t_or_fn, args, kwargs)
    if args or kwargs:
        raise TypeError(
            "st.explain(tensor) takes no further arguments; to explain a function, pass "
            "the function first: st.explain(fn, *args)"
        )
    tensors = list(t_or_fn) if isinstance(t_or_fn, (list, tuple)) else [t_or_fn]
    for i, t in enumerate(tensors):
        if not isinstance(t, ShardedTensor):
            raise TypeError(
                f"st.explain: item {i} is a {type(t).__name__}, not a tensor on st.device(); pass "
                "ShardedTensors (or a function and its arguments)"
            )
    return _explain([(f"output {i}", t) for i, t in enumerate(tensors)], [])


def _explain_call(fn, args, kwargs) -> Explanation:
    with capture() as seen:  # record, whatever mode the caller is in
        out = fn(*args, **kwargs)
    returned = [(f"output {i}", x) for i, x in enumerate(pytree.tree_leaves(out)) if isinstance(x, ShardedTensor)]
    returned_cells = {id(x._cell) for _, x in returned}  # a returned view's base is no side effect
    # what the call left pending: values it updated in place and new values still alive
    effects = [
        ("new pending value" if seen.is_new(c) else "updated in place", c)
        for c in seen.pending()
        if id(c) not in returned_cells
    ]
    if not returned and not effects:
        raise ValueError(
            f"st.explain: calling {getattr(fn, '__name__', fn)!r} recorded nothing on the devices "
            "(it returned no ShardedTensor and changed none); pass tensors on st.device()"
        )
    return _explain(returned, effects)


@runtime.with_x64  # after the user's function, which ran with the caller's JAX setting
def _explain(tensors: list, effect_cells: list) -> Explanation:
    """tensors: (label, ShardedTensor); effect_cells: (label, pending Cell)."""
    # (label, shape, dtype, cell to compute or None, tensor or None): one of the last two is None
    entries: list[tuple[str, tuple, torch.dtype, Cell | None, ShardedTensor | None]] = []
    for label, t in tensors:
        ref = views.read(t)  # a view's value is a new pending node (its base may be computed)
        if isinstance(ref, Pending):
            cell = t._cell if not t._chain else Cell(ref, t.shape, t.dtype)  # not registered: never run
            entries.append((label, tuple(t.shape), t.dtype, cell, None))
        else:
            entries.append((label, tuple(t.shape), t.dtype, None, t))
    entries += [(label, c.shape, c.dtype, c, None) for label, c in effect_cells]

    cells: list[Cell] = []
    position: dict[int, int] = {}
    for _, _, _, cell, _ in entries:
        if cell is not None and id(cell) not in position:
            position[id(cell)] = len(cells)
            cells.append(cell)
    shardings: list = []
    hlo = ""
    mesh: Mesh | None = None
    if cells:
        shardings, hlo, mesh = _compile(cells)

    outputs = []
    for label, shape, dtype, cell, t in entries:
        if t is not None:  # a computed value: no cell to compute
            string, m, spec = debug.tensor_sharding(t)
            mesh = mesh or m
            outputs.append(OutputSharding(label, shape, dtype, string, spec, pending=False))
            continue
        assert cell is not None and mesh is not None  # compiled above
        string, spec = _output_sharding(cell, shardings[position[id(cell)]], mesh)
        outputs.append(OutputSharding(label, shape, dtype, string, spec, pending=True))
    ops = collective_ops(hlo)
    return Explanation(outputs, collectives_in_hlo(hlo), mesh, compiled=bool(cells), ops=ops, hlo=hlo)


def _explain_compiled(compiled: stages.Compiled) -> Explanation:
    """The explanation of a compiled step's program (``stages.Compiled``)."""
    mesh = compiled.mesh
    recorded = mesh.get_jax_mesh()
    outputs = []
    for out, sharding in zip(compiled.outputs, compiled.output_shardings):
        ndim = len(out.shape)
        if isinstance(sharding, NamedSharding) and sharding.mesh != recorded:  # (compiled for other devices)
            sharding = NamedSharding(recorded, sharding.spec)
        string, _, spec = debug.array_sharding(sharding, ndim)
        if spec is None:
            spec = _find_spec(string, mesh, ndim)
        outputs.append(OutputSharding(out.label, out.shape, out.dtype, string, spec, pending=True))
    hlo = compiled.as_text()
    cost = compiled.cost_analysis() or {}
    target = compiled.target
    return Explanation(
        outputs,
        collectives_in_hlo(hlo),
        mesh,
        compiled=True,
        ops=collective_ops(hlo),
        hlo=hlo,
        memory=compiled.memory(),
        flops=cost.get("flops"),
        step=compiled.name + (f" for {target.description}" if target is not None else ""),
        platform=target.platform.upper() if target is not None else None,
    )


def _compile(cells: list[Cell]) -> tuple[list, str, Mesh]:
    """(output shardings, compiled HLO text, Mesh) of the program computing ``cells``, not run."""
    lowered = lower(cells)
    # the same graph compiled earlier is in the cache: its jit finds the executable again; otherwise
    # one outside the cache, so sync() later counts (and caches) its compile as usual
    compiled = lowered.compile()
    shardings = compiled.output_shardings
    if lowered.program.checks:  # (values, on-device check rows)
        shardings = shardings[0]
    return list(shardings), compiled.as_text(), mesh_for_jax_mesh(lowered.mesh)


def _output_sharding(cell, compiled_sharding, mesh: Mesh):
    """(sharding string, spec) of one output: its annotation, else what XLA propagated."""
    if cell.spec is not None:
        return sh.sharding_string(cell.mesh, cell.spec, len(cell.shape)), sh.PartitionSpec(*cell.spec)
    ndim = len(cell.shape)
    string, _, spec = debug.array_sharding(compiled_sharding, ndim)
    if spec is None:
        spec = _find_spec(string, mesh, ndim)
    return string, spec


def _find_spec(string: str, mesh: Mesh, ndim: int):
    """A spec over ``mesh`` giving the same placement as ``string``, or None (tried exhaustively:
    each mesh axis of size > 1 either unused or on one dimension, in every order)."""
    try:
        target = _placement_key(debug.parse_sharding_string(string, mesh.size()))
    except ValueError:
        return None
    axes = [a for a, n in enumerate(mesh.mesh_shape) if n > 1]
    names = mesh.axis_names
    for order in itertools.permutations(axes):
        for dims in itertools.product(range(-1, ndim), repeat=len(order)):
            per_dim: list[list] = [[] for _ in range(ndim)]
            for a, d in zip(order, dims):
                if d >= 0:
                    per_dim[d].append(names[a] if names else a)
            spec = tuple(None if not e else (e[0] if len(e) == 1 else tuple(e)) for e in per_dim)
            candidate = debug.parse_sharding_string(sh.sharding_string(mesh, spec, ndim), mesh.size())
            if _placement_key(candidate) == target:
                return sh.PartitionSpec(*spec)
    return None


def _placement_key(parsed):
    """What a sharding places where: tile dims and each tile's set of devices."""
    if parsed.kind != "tiled" or math.prod(parsed.tile_dims) == 1:
        return ("replicated",) if parsed.kind != "maximal" else ("maximal", parsed.devices)
    grid = parsed.device_grid().reshape(-1, parsed.replicas)
    return ("tiled", parsed.tile_dims, tuple(frozenset(g.tolist()) for g in grid))
