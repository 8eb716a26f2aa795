"""Building one program from pending cells: the nodes behind them in order, the inputs (concrete
arrays and Python scalars), and the outputs with their layouts.

A ``Program`` is everything about a graph except its input values, and its ``key`` is structural
(ops, static arguments, input shapes, dtypes and shardings, donation and whether donation is allowed
at all), so a loop of identical steps maps to one cached executable. Inputs stored padded are sliced
on entry; outputs whose cell asks for a sharding are padded and constrained on exit; arrays of cells
that the graph overwrites are donated, unless parameter aliasing is off (``aliasing``). Python
scalars travel in one vector per kind; uses of equal values share one entry (``_scalar_inputs``).

With on-device checks on (``ops.checks``), the program has one more output: the rows of the checks its
lowerings declared. If any fails, every cell the program overwrites gets its value from before the
program back (one conditional on the device), so parameters, optimizer state and step counters stay
those before the step; ``graph.checks`` reads the rows after the run and fails the new results that
depend on a checked op. Scratch cells (``mark_scratch``: a decode loop's KV cache and state, which
its owner rewrites before any use) are not restored, and a failure does not poison them: restoring
a buffer updated in place costs a copy of it and a pass over it every step.
"""

from __future__ import annotations

import functools
import math
import os
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lax.lax import _convert_element_type
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as JaxSpec

from shardtensor import metrics as counters
from shardtensor import sharding as sh
from shardtensor.graph.aliasing import param_aliasing_enabled
from shardtensor.graph.ir import Cell, Leaf, Pending
from shardtensor.mesh import default_mesh
from shardtensor.ops import checks as op_checks


def scalar_kind(value) -> str:
    if isinstance(value, bool):
        return "b"
    if isinstance(value, int):
        return "i"
    if isinstance(value, float):
        return "f"
    return "c"


SCALAR_DTYPES = {"b": np.bool_, "i": np.int64, "f": np.float64, "c": np.complex128}


class StructuralKey(tuple):
    """A tuple whose hash is computed once: a program key (thousands of nested node keys) is looked up
    in the executable cache and the scalar-sharing table at every sync, and Python does not keep a
    tuple's hash. It equals the plain tuple of the same items.

    Example::

        k = StructuralKey((("add", 1), ("mul", 2)))
        k == (("add", 1), ("mul", 2)) and hash(k) == hash(tuple(k))   # True
    """

    _hash: int

    def __new__(cls, items):
        self = super().__new__(cls, items)
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self):
        return self._hash

    def __reduce__(self):  # pickles (and copies) as the plain tuple it equals
        return tuple, (tuple(self),)


# The key of the last program built (any thread): a step that repeats the last one has an equal key;
# reusing that object skips hashing it again, and makes the cache lookup an identity match.
_LAST_KEY: list = [None]
REPEATED_GRAPH = "RepeatedGraph"  # counter: builds whose key equals the previous build's


def _reuse(key: tuple, last):
    """``last`` when it equals ``key`` (cheap: equal parts are mostly the same objects), else ``key``
    as a new ``StructuralKey``."""
    if last is not None and len(last) == len(key) and last == key:
        return last
    return StructuralKey(key)


# cells whose value after a failed check does not matter (mark_scratch); weak: they go with their tensors
_SCRATCH: weakref.WeakSet = weakref.WeakSet()


def mark_scratch(cell: Cell) -> None:
    """Let programs leave ``cell`` as they computed it when one of their checks fails.

    A program with checks restores every cell it overwrites when a check fails, by a select per
    cell: for a buffer updated in place at one position (a KV cache), XLA then keeps the old and the
    new buffer at once, so it copies the whole buffer and passes over it twice more on every step.
    A buffer whose owner rewrites it before any later use (the device decode loop's cache and
    state: the next prefill resets them) needs none of that. Its value after a failed run is
    unspecified, and reading it does not raise the failure.

    Example::

        mark_scratch(cache.layers[0].keys._cell)
    """
    _SCRATCH.add(cell)


class Program:
    """The structure of one graph: everything about it except the concrete input values."""

    def __init__(self):
        self.steps = []  # (caller, codes)
        self.leaf_shapes = []  # (logical shape, padded?)
        self.scalar_slots = []  # (kind, position within that kind's vector), one per use
        self.shares_scalars = False  # some uses of equal values read one position
        self.outputs = []  # (code, pad widths or None, jax sharding or None)
        self.donated = []
        self.kept = []
        self.leaf_cells = []
        self.forwarded = set()  # outputs that are an input leaf unchanged
        self.forwarded_leaves = set()
        self.key = None
        self.aliasing = True  # built while programs could donate (the key tells the two apart)
        self.mesh: jax.sharding.Mesh | None = None
        # this build's inputs copied onto the mesh: (position, the array before); not a structural fact
        self.moved: list[tuple[int, jax.Array]] = []
        # on-device checks: whether traced, this build's user lines per step, output -> leaf restored
        # on failure; filled by the trace: the declared checks, outputs depending on a checked op
        self.checks = False
        self.sites = {}
        self.rollback = {}
        self.check_table = []
        self.tainted: frozenset[int] = frozenset()
        self.scratch: frozenset[int] = frozenset()  # outputs to scratch cells (mark_scratch)
        self.restored: frozenset[int] = frozenset()

    @functools.cached_property
    def single_device(self) -> bool:
        """Whether the program runs on one device (its check rows, replicated, are then one array)."""
        return self.mesh is not None and self.mesh.devices.size == 1

    @classmethod
    def build(cls, cells, donate=True, checks=None):
        """(program, input arrays, scalar vectors) computing ``cells``; ``checks``: trace the on-device
        checks (default: ``ops.checks.checks_enabled()``)."""
        prog = cls()
        prog.checks = op_checks.checks_enabled() if checks is None else checks
        prog.aliasing = param_aliasing_enabled()
        donate = donate and prog.aliasing
        node_pos: dict[int, int] = {}
        leaf_pos: dict[int, int] = {}
        arrays: list = []
        scalar_refs: list = []  # the Python scalars, one per use (slot)
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
            scalar_refs.append(ref.value)
            return (2, len(scalar_refs) - 1)

        constrained = []  # meshes of mark_sharding constraints on pending values
        steps, sites = prog.steps, prog.sites
        # (code_of inlined for the commonest inputs: this loop runs for every node of every step)
        for node in _topological_order([c.value.node for c in cells]):
            codes: list = []
            for r in node.inputs:
                kind = type(r)
                if kind is Pending:
                    codes.append((0, node_pos[id(r.node)], r.index))
                elif kind is Leaf and id(r.array) in leaf_pos:
                    codes.append((1, leaf_pos[id(r.array)]))
                else:
                    codes.append(code_of(r))
            wiring = tuple(codes)
            if node.site is not None:
                sites[len(steps)] = node.site
            node_pos[id(node)] = len(steps)
            steps.append((node.caller, wiring))
            key = node.key
            key_parts.append((key, wiring))
            if type(key[0]) is str and key[0] == "constraint":  # (annotate.mark_sharding's key)
                constrained.append(key[1].mesh)

        mesh = _graph_mesh(cells, arrays, constrained)
        for i, a in enumerate(arrays):
            on_mesh = to_mesh(a, mesh)
            if on_mesh is not a:
                prog.moved.append((i, a))
                arrays[i] = on_mesh
        out_keys = []
        layouts = [_output_layout(cell, mesh) for cell in cells]
        # No input arrays and no output layout: jit would run on one device, not the mesh, so the
        # outputs are replicated over it. With one output laid out on the mesh, the program runs
        # there and XLA propagates that layout to the others (sharded zeros + 1 stays sharded).
        on_one_device = not arrays and not constrained and all(sharding is None for _, sharding in layouts)
        for cell, (pad, sharding) in zip(cells, layouts):
            code = code_of(cell.value)
            if sharding is None and on_one_device:
                sharding = NamedSharding(mesh, JaxSpec())
            prog.outputs.append((code, pad, sharding))
            out_keys.append((code, pad, sharding))

        overwritten = {id(c) for c in cells}
        out_layouts = {id(c): out[2] for c, out in zip(cells, prog.outputs)}
        for i, c in enumerate(prog.leaf_cells):
            # donate only a buffer the output can reuse: same cell, sole owner, same layout
            reusable = (
                donate
                and c is not None
                and id(c) in overwritten
                and c.owned
                and out_layouts[id(c)] in (None, arrays[i].sharding)
            )
            (prog.donated if reusable else prog.kept).append(i)
        prog.donated = _paired_order(prog.donated, prog.leaf_cells, cells, prog.outputs)
        if prog.checks:  # an overwritten cell whose old value is an input can be restored
            leaf_of = {id(c): k for k, c in enumerate(prog.leaf_cells) if c is not None}
            if _SCRATCH:
                prog.scratch = frozenset(i for i, cell in enumerate(cells) if cell in _SCRATCH)
            for i, cell in enumerate(cells):
                k = leaf_of.get(id(cell))
                if k is not None and prog.leaf_shapes[k][0] == cell.shape and i not in prog.scratch:
                    prog.rollback[i] = k
        leaf_sigs = tuple((a.shape, a.dtype, shape, a.sharding) for a, (shape, _) in zip(arrays, prog.leaf_shapes))
        last = _LAST_KEY[0]
        parts = _reuse(tuple(key_parts), last[0] if last is not None else None)
        scalars = _scalar_inputs(prog, scalar_refs, parts)
        prog.mesh = mesh
        checked = (tuple(sorted(prog.rollback.items())), tuple(sorted(prog.scratch))) if prog.checks else None
        key = (
            parts,
            tuple(out_keys),
            leaf_sigs,
            tuple(prog.scalar_slots),
            tuple(prog.donated),
            mesh,
            checked,
            prog.aliasing,
        )
        prog.key = _reuse(key, last)
        if prog.key is last:
            counters.increment(REPEATED_GRAPH)
        _LAST_KEY[0] = prog.key
        return prog, arrays, scalars

    def make_executable(self):
        steps, leaf_shapes, slots, outputs = self.steps, self.leaf_shapes, self.scalar_slots, self.outputs
        order = self.donated + self.kept
        forwarded, forwarded_leaves = self.forwarded, self.forwarded_leaves
        checked, rollback, scratch = self.checks, self.rollback, self.scratch
        # An overwritten value computed after the last checked op (checked ops carry a user line) is
        # selected where it is computed, so its other readers (the parameter update reading the new
        # moments) read the output itself: selected at the end instead, they read the update before
        # the select, which XLA recomputes from the old buffer after the output overwrote it, and so
        # copies every such buffer first (a pass over parameters and optimizer state each step).
        # float32 values only: a bfloat16 step's updates (computed in float32, then rounded) are
        # fused the other way round, and selecting them early made XLA:CPU copy 56 buffers, not 0
        last_checked = max(self.sites, default=-1)
        early: dict[int, list] = {}  # step -> [(output, index in the step's values)]
        by_selects = checked and rollback_by_selects(self.mesh)
        late = [code for i, (code, _, _) in enumerate(outputs) if by_selects and i in rollback]
        for i, (code, _, _) in enumerate(outputs):
            # (a value that overwrites two cells is selected against each one's old value at the end)
            if by_selects and i in rollback and code[0] == 0 and code[1] > last_checked and late.count(code) == 1:
                early.setdefault(code[1], []).append((i, code[2]))

        def replay(donated, kept, vecs):
            arrays: list = [None] * len(order)
            for i, a in zip(order, list(donated) + list(kept)):
                arrays[i] = a
            leaves = [
                a[tuple(slice(0, n) for n in shape)] if padded else a for a, (shape, padded) in zip(arrays, leaf_shapes)
            ]
            read: dict = {}  # one read per position: the uses of a shared scalar get one value
            for slot in slots:
                if slot not in read:
                    k, j = slot
                    read[slot] = _convert_element_type(vecs[k][j], vecs[k].dtype, weak_type=True)
            scalars = [read[slot] for slot in slots]
            values: list = []

            def resolve(code):
                if code[0] == 0:
                    return values[code[1]][code[2]]
                return leaves[code[1]] if code[0] == 1 else scalars[code[1]]

            collector = op_checks.Collector() if checked else None
            failed, restored, early_restored = None, {}, set()
            selected: dict = {}  # output -> how many check rows its early select saw
            if collector is None:
                for caller, codes in steps:
                    values.append(caller(*[resolve(c) for c in codes]))
            else:
                tainted = set()  # steps whose values depend on a checked op
                with op_checks.collecting(collector):
                    for j, (caller, codes) in enumerate(steps):
                        collector.step, declared = j, len(collector.rows)
                        values.append(caller(*[resolve(c) for c in codes]))
                        if len(collector.rows) > declared or any(c[0] == 0 and c[1] in tainted for c in codes):
                            tainted.add(j)
                        if j in early and collector.rows:
                            so_far = jnp.any(collector.output()[:, 0] != 0)
                            step_values = list(values[j])
                            for i, k in early[j]:
                                old, new = leaves[rollback[i]], step_values[k]
                                if old.shape == new.shape and old.dtype == new.dtype == _EARLY_DTYPE:
                                    step_values[k] = jnp.where(so_far, old, new)
                                    selected[i] = len(collector.rows)
                            values[j] = step_values
                            tainted.add(j)  # (its readers now depend on the checks)
                rows = collector.output()
                self.check_table = collector.checks
                self.tainted = frozenset(
                    i
                    for i, (code, _, _) in enumerate(outputs)
                    if code[0] == 0 and code[1] in tainted and i not in scratch
                )
                failed = None if rows is None else jnp.any(rows[:, 0] != 0)
            results = []
            for i, (code, pad, sharding) in enumerate(outputs):
                x = resolve(code)
                if code[0] == 1 and not leaf_shapes[code[1]][1]:
                    forwarded.add(i)
                    forwarded_leaves.add(code[1])
                if pad is not None:
                    x = jnp.pad(x, pad)
                if checked and failed is not None and i in rollback:
                    old = arrays[rollback[i]]  # as stored (padded)
                    if collector is not None and selected.get(i) == len(collector.rows):
                        early_restored.add(i)  # (selected where computed, after every check)
                    elif old.shape == x.shape and old.dtype == x.dtype:
                        restored[i] = old
                if sharding is not None:
                    x = jax.lax.with_sharding_constraint(x, sharding)
                results.append(x)
            if restored:
                # a failed check keeps the values before the step
                keys = sorted(restored)
                assert failed is not None  # (restored is filled only when it is set)
                if rollback_by_selects(self.mesh):
                    chosen = [jnp.where(failed, restored[i], results[i]) for i in keys]
                else:
                    chosen = jax.lax.cond(
                        failed,
                        lambda old, new: old,
                        lambda old, new: new,
                        [restored[i] for i in keys],
                        [results[i] for i in keys],
                    )
                for i, x in zip(keys, chosen):
                    sharding = outputs[i][2]
                    results[i] = x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)
            if checked:
                self.restored = frozenset(restored) | frozenset(early_restored)
                return results, rows
            return results

        out_shardings: list | tuple = [sharding for _, _, sharding in outputs]
        if checked:  # (results, check rows or None): the rows travel replicated
            assert self.mesh is not None  # set by build()
            out_shardings = (out_shardings, NamedSharding(self.mesh, JaxSpec()))
        fn = jax.jit(replay, donate_argnums=(0,), out_shardings=out_shardings)
        fn.program = self  # type: ignore[attr-defined]  # a function object takes attributes
        if checked:  # the check rows alone (graph.early_rows): XLA drops what they do not need
            fn.rows_only = jax.jit(  # type: ignore[attr-defined]
                lambda donated, kept, vecs: replay(donated, kept, vecs)[1], out_shardings=out_shardings[1]
            )
        return fn


_OLDER_CPU_EMITTER = "--xla_cpu_use_fusion_emitters=false"
_EARLY_DTYPE = np.dtype(np.float32)  # the overwritten values a checked program selects where computed


def rollback_by_selects(mesh) -> bool:
    """How a program with checks keeps the values before a failed step: a select per overwritten
    value (True), which XLA fuses into the update that computes it, or one conditional over all of
    them (False), which makes XLA copy every overwritten buffer each step (the old value and the new
    one are both alive where the conditional's result must go: +150 copies on a 2-layer GPT's AdamW
    step, a whole extra pass over the parameters and optimizer state). Selects everywhere except on
    XLA:CPU's older fusion emitter (``--xla_cpu_use_fusion_emitters=false``, the test suite's), which
    computes wrong BatchNorm/conv updates with them."""
    platform = mesh.devices.flat[0].platform if mesh is not None else "cpu"
    return platform != "cpu" or _OLDER_CPU_EMITTER not in os.environ.get("XLA_FLAGS", "").split()


def _scalar_identity(value):
    """What makes two Python scalars one runtime input: the same kind and value, and for floats the
    same sign of zero (``1 / -0.0`` is not ``1 / 0.0``)."""
    kind = scalar_kind(value)
    if kind == "f":
        return kind, value, math.copysign(1.0, value)
    if kind == "c":
        return kind, repr(value)
    return kind, value


# structure of a graph (its node keys and wiring) -> which scalar slots may share an input
_SHARING: dict = {}
_SHARING_LIMIT = 1024  # as many graphs as the executable cache keeps by default


def _scalar_inputs(prog, values, key_parts) -> dict[str, np.ndarray]:
    """Fill ``prog.scalar_slots`` for the Python scalars ``values`` (one per use) and return the
    vectors they travel in, one per kind.

    Uses with equal values share one position, so XLA sees one input where plain JAX would see one
    constant: a graph of N ops reading the same few scalars then compiles like JAX's (its common
    subexpressions are merged, a division by a shared scalar is one reciprocal, not N small
    kernels). Which uses share is part of the program key; so that a value that only sometimes
    equals another (a learning rate reaching 0.0) does not keep recompiling, a graph's uses share
    only while their values have been equal at every build of that graph so far.
    """
    first: dict = {}
    groups = tuple(first.setdefault(_scalar_identity(v), i) for i, v in enumerate(values))
    if len(first) < len(values):  # some values repeat: share them as far as earlier builds agree
        structure = key_parts if type(key_parts) is StructuralKey else tuple(key_parts)
        before = _SHARING.get(structure)
        if before is not None and before != groups:
            meet: dict = {}
            groups = tuple(meet.setdefault(pair, i) for i, pair in enumerate(zip(before, groups)))
        if before != groups:
            if len(_SHARING) >= _SHARING_LIMIT:
                _SHARING.clear()
            _SHARING[structure] = groups
    vectors: dict[str, list] = {"b": [], "i": [], "f": [], "c": []}
    position: dict[int, int] = {}
    for i, (value, group) in enumerate(zip(values, groups)):
        kind = scalar_kind(value)
        if group == i:
            position[i] = len(vectors[kind])
            vectors[kind].append(value)
        prog.scalar_slots.append((kind, position[group]))
    prog.shares_scalars = len(position) < len(values)
    return {k: np.asarray(v, dtype=SCALAR_DTYPES[k]) for k, v in vectors.items() if v}


def _topological_order(roots):
    """Nodes reachable from ``roots``, inputs before users (iterative: graphs can be deep)."""
    order, seen = [], set()
    stack = list(reversed(roots))
    push, pop, done = stack.append, stack.pop, _DONE
    while stack:
        node = pop()
        if node is done:  # every input of the node below the marker is placed: place it
            order.append(pop())
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        push(node)
        push(done)
        for ref in reversed(node.inputs):
            if type(ref) is Pending and id(ref.node) not in seen:
                push(ref.node)
    return order


_DONE = object()  # _topological_order's marker (cheaper than a (node, expanded) pair per node)


def _paired_order(donated: list[int], leaf_cells: list, cells, outputs: list) -> list[int]:
    """The donated leaves ordered so that ``jax.jit`` gives each one's buffer to the output that
    overwrites the same tensor.

    jit does not know which output updates which input: it gives each output, in order, the first
    donated input of the same shape and dtype that is left. A parameter, its AdamW moments (all of
    one shape in float32) and their updates in another order than the inputs' would each write into
    another one's buffer, and XLA copies every such buffer to keep the old values it still reads.
    An output that is a new value takes a buffer too, if one of its kind is left: it gets the one
    whose own output comes last (that output is then written into a new buffer).
    """
    if len(donated) < 2:
        return donated
    output_of = {id(cell): i for i, cell in enumerate(cells)}
    own = {output_of[id(leaf_cells[k])]: k for k in donated}  # output -> the donated leaf it overwrites
    kinds = []
    for cell, (_, pad, _) in zip(cells, outputs):
        shape = cell.shape if pad is None else tuple(n + lo + hi for n, (lo, hi) in zip(cell.shape, pad))
        kinds.append((tuple(shape), cell.dtype))
    left: dict = {}  # kind -> donated leaves not yet given, by their output's position
    for i in sorted(own):
        left.setdefault(kinds[i], []).append(own[i])
    order = []
    for i, kind in enumerate(kinds):
        queue = left.get(kind)
        if not queue:
            continue
        k = own.get(i)
        if k is not None and k in queue:
            queue.remove(k)
        else:
            k = queue.pop()
        order.append(k)
    # (a leaf no output of its kind took, or a second leaf of one cell — a restored RNG key and the
    # key it replaces —, is still an input: after the others)
    placed = set(order)
    return order + [k for k in donated if k not in placed]


def _output_layout(cell: Cell, mesh):
    """(pad widths or None, sharding or None) for an output cell: the user's sharding, else the
    layout its data had before this graph overwrote it, else XLA's choice."""
    if cell.spec is None:
        layout = cell.layout
        if isinstance(layout, NamedSharding):
            if layout.mesh == mesh:
                return None, layout
            if layout.is_fully_replicated:  # replicated on another mesh: replicated on this one (so
                return None, _replicated(mesh)  # the next step, now on this mesh, is the same program)
        return None, None
    return _spec_layout(cell.shape, cell.mesh, cell.spec)


@functools.lru_cache(maxsize=64)
def _replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, JaxSpec())


@functools.lru_cache(maxsize=4096)
def _spec_layout(shape, mesh, spec):
    """(pad widths or None, NamedSharding) of a tensor of ``shape`` stored as (mesh, spec)."""
    padded = tuple(sh.padded_shape(shape, mesh, spec))
    pad = tuple((0, p - n) for n, p in zip(shape, padded)) if padded != tuple(shape) else None
    return pad, NamedSharding(mesh.get_jax_mesh(), sh.to_jax_spec(mesh, spec, len(shape)))


def mesh_of(array):
    s = getattr(array, "sharding", None)
    return s.mesh if isinstance(s, NamedSharding) else None


def _is_replicated(array) -> bool:
    return array.sharding.is_fully_replicated


def _graph_mesh(cells, arrays, constrained=()):
    """The one jax mesh of this graph; two meshes holding sharded data are an error. A graph without
    any runs on the mesh of its first sharding constraint, if it has one."""
    meshes = {}
    for c in cells:
        if c.mesh is not None:
            m = c.mesh.get_jax_mesh()
            meshes[m] = c.mesh
    for a in arrays:
        m = mesh_of(a)
        if m is not None and not _is_replicated(a):
            meshes.setdefault(m, m)
    if len(meshes) > 1:
        raise ValueError(
            "These tensors are sharded over different meshes "
            f"({', '.join(describe_mesh(m) for m in meshes)}); one computation can use only one mesh. "
            "Reshard them onto one mesh first (st.mark_sharding / st.shard with the same Mesh)."
        )
    if meshes:
        return next(iter(meshes))
    if constrained:
        return constrained[0]
    for a in arrays:  # all replicated: stay on the inputs' mesh rather than moving them
        m = mesh_of(a)
        if m is not None:
            return m
    return default_mesh().get_jax_mesh()


def describe_mesh(mesh) -> str:
    """A jax mesh as users wrote it, e.g. ``Mesh(devices [0..7], shape (4, 2), axes ('x', 'y'))``."""
    ids = [int(i) for i in mesh.device_ids.flat]
    shown = f"[{ids[0]}..{ids[-1]}]" if ids == list(range(ids[0], ids[-1] + 1)) else str(ids)
    return f"Mesh(devices {shown}, shape {tuple(mesh.shape.values())}, axes {tuple(mesh.axis_names)})"


def to_mesh(array, mesh):
    """Put a replicated array (or one on a single device) onto ``mesh`` so jit sees one mesh."""
    m = mesh_of(array)
    if m is mesh or m == mesh:
        return array
    if m is not None and not _is_replicated(array):
        return array  # sharded on another mesh: _graph_mesh already refused a real conflict
    if array.size:  # (an empty array moves no data: not a copy worth counting)
        counters.increment("ReplicateToGraphMesh")
    return jax.device_put(array, NamedSharding(mesh, JaxSpec()))
