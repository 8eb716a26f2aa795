"""Manual regions: a torch function run per shard on local tensors, as ``jax.shard_map`` (``st.shard_map``),
and the collectives over named mesh axes for its inside (``st.manual.all_reduce`` ...).

Outside a region the compiler partitions the program; inside one, the code sees each device's local
block and says itself how devices talk. ``st.shard_map(fn, mesh, in_specs, out_specs)`` returns a
function of global tensors: each argument is split by its spec, ``fn`` runs on the local blocks (so
``x.shape`` inside is the block's shape), and its results are put together by ``out_specs``. The
region is one node of the program (it is a ``call_jax`` op of the function ``fn`` lowers to): it works
in lazy steps, eager mode and ``st.compile``, and on CPU tensors; its gradient is ``jax.vjp`` of the
shard_map'd function, where each collective has its transpose (the gradient of an all-reduce is an
all-reduce, of an all-gather a reduce-scatter ...).

Inside ``fn``, use only torch ops on the arguments (tensors created inside are fine), and these
collectives, named so they are not mistaken for the process-level ``st.all_reduce``:

    st.manual.all_reduce(x, "tp")                 # sum over the devices along mesh axis "tp"
    st.manual.all_gather(x, "tp", dim=0)          # the blocks along "tp", concatenated along dim 0
    st.manual.reduce_scatter(x, "tp", dim=0)      # sum, then each keeps its part along dim 0
    st.manual.all_to_all(x, "tp", split_dim=0, concat_dim=1)
    st.manual.ppermute(x, "sp", [(0, 1), (1, 2), (2, 3), (3, 0)])   # a ring
    st.manual.axis_index("tp", like=x), st.manual.axis_size("tp")

``axis`` may be one mesh axis name or a tuple of names. Limits: ``fn`` cannot read values (``.item()``,
printing), draw random numbers, or update tensors from outside in place; tensors it uses that are not
arguments enter as constants seen whole by every device (small ones only: pass the others as arguments).

Example::

    mesh = st.Mesh(range(8), (4, 2), ("dp", "tp"))

    def mlp(x, w1, w2):                       # local blocks: w1 (D, H/2), w2 (H/2, D)
        return st.manual.all_reduce(torch.relu(x @ w1) @ w2, "tp")

    y = st.shard_map(mlp, mesh, in_specs=(st.P("dp", None), st.P(None, "tp"), st.P("tp", None)),
                     out_specs=st.P("dp", None))(x, w1, w2)
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import torch
from jax._src.lax.lax import _convert_element_type

from shardtensor import jax_ops
from shardtensor.dtypes import to_jax
from shardtensor.graph import rng, views
from shardtensor.graph.capture import capture
from shardtensor.graph.ir import Cell, Failed, Leaf, Node, Pending, ScalarLeaf
from shardtensor.graph.program import SCALAR_DTYPES, scalar_kind
from shardtensor.graph.state import set_concrete, set_failed, set_pending
from shardtensor.mesh import Mesh
from shardtensor.ops import jax_call
from shardtensor.tensor import ShardedTensor

__all__ = [
    "shard_map",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "ppermute",
    "axis_index",
    "axis_size",
]

_MAX_CONSTANT = 1 << 16  # elements: a tensor from outside the region larger than this must be an argument


# --------------------------------------------------------------------------- the region's context


class _Regions(threading.local):
    stack: list = []  # the jax meshes of the regions being captured, innermost last

    def __init__(self):
        self.stack = []


_REGIONS = _Regions()


@contextlib.contextmanager
def _inside(jmesh):
    _REGIONS.stack.append(jmesh)
    try:
        yield
    finally:
        _REGIONS.stack.pop()


def _axes(axis, what: str) -> str:
    """The axis names of ``axis`` (a name or a tuple of names), checked against the current region."""
    if not _REGIONS.stack:
        raise RuntimeError(
            f"st.manual.{what} is a collective over mesh axes of a manual region: call it inside a function "
            "run by st.shard_map or st.local_map (for collectives across processes use st.{what})."
        )
    names = list(axis) if isinstance(axis, (tuple, list)) else [axis]
    known = _REGIONS.stack[-1].axis_names
    for n in names:
        if n not in known:
            raise ValueError(f"st.manual.{what}: {n!r} is not an axis of the region's mesh (axes: {tuple(known)}).")
    return ",".join(names)


def axis_size(axis) -> int:
    """How many devices the region's mesh has along ``axis`` (a name or a tuple of names).

    Example: ``st.manual.axis_size("tp")`` is 2 on a (4, 2) mesh ("dp", "tp").
    """
    names = _axes(axis, "axis_size").split(",")
    shape = _REGIONS.stack[-1].shape
    return math.prod(shape[n] for n in names)


def all_reduce(x: torch.Tensor, axis, op: str = "sum") -> torch.Tensor:
    """The ``op`` ("sum", "avg", "max", "min") of ``x`` over the devices along ``axis``.

    Example: ``st.manual.all_reduce(partial_sums, "tp")``.
    """
    from shardtensor.ops.manual_collectives import AXIS_REDUCE_OPS

    if op not in AXIS_REDUCE_OPS:
        raise ValueError(f"st.manual.all_reduce: unknown op {op!r}; use one of {', '.join(AXIS_REDUCE_OPS)}.")
    return torch.ops.shardtensor.axis_reduce(x, _axes(axis, "all_reduce"), op)


def all_gather(x: torch.Tensor, axis, dim: int = 0) -> torch.Tensor:
    """The blocks of ``x`` of the devices along ``axis``, concatenated along ``dim`` in axis order.

    Example: ``st.manual.all_gather(k_block, "sp", dim=1)``.
    """
    names = _axes(axis, "all_gather")
    return torch.ops.shardtensor.axis_all_gather(x, names, _dim(x, dim), axis_size(axis))


def reduce_scatter(x: torch.Tensor, axis, dim: int = 0) -> torch.Tensor:
    """The sum of ``x`` over the devices along ``axis``, split along ``dim``; each device keeps its part.

    Example: ``st.manual.reduce_scatter(y_partial, "tp", dim=0)``.
    """
    names, size = _axes(axis, "reduce_scatter"), axis_size(axis)
    d = _dim(x, dim)
    _check_split(x, d, size, "reduce_scatter")
    return torch.ops.shardtensor.axis_reduce_scatter(x, names, d, size)


def all_to_all(x: torch.Tensor, axis, split_dim: int, concat_dim: int) -> torch.Tensor:
    """``x`` split along ``split_dim``, part i sent to device i along ``axis``, the received parts
    concatenated along ``concat_dim``.

    Example: ``st.manual.all_to_all(x, "sp", split_dim=2, concat_dim=1)`` (heads <-> sequence).
    """
    names, size = _axes(axis, "all_to_all"), axis_size(axis)
    s, c = _dim(x, split_dim), _dim(x, concat_dim)
    _check_split(x, s, size, "all_to_all")
    return torch.ops.shardtensor.axis_all_to_all(x, names, s, c, size)


def ppermute(x: torch.Tensor, axis, perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Device ``src`` (its index along ``axis``) sends ``x`` to device ``dst`` for each ``(src, dst)``
    in ``perm``; a device no one sends to gets zeros.

    Example (a ring)::

        n = st.manual.axis_size("sp")
        k_next = st.manual.ppermute(k, "sp", [(i, (i + 1) % n) for i in range(n)])
    """
    names, size = _axes(axis, "ppermute"), axis_size(axis)
    pairs = [int(v) for pair in perm for v in pair]
    if any(not 0 <= v < size for v in pairs):
        raise ValueError(f"st.manual.ppermute: {list(perm)} names devices outside 0..{size - 1} along {axis!r}.")
    return torch.ops.shardtensor.axis_ppermute(x, names, pairs)


def axis_index(axis, *, like: torch.Tensor) -> torch.Tensor:
    """This device's index along ``axis`` as an int64 scalar tensor on ``like``'s device.

    Example: ``start = st.manual.axis_index("sp", like=q) * q.shape[1]``.
    """
    return torch.ops.shardtensor.axis_index(like, _axes(axis, "axis_index"))


def _dim(x: torch.Tensor, dim: int) -> int:
    return dim + x.dim() if dim < 0 else dim


def _check_split(x, dim, size, what):
    if x.shape[dim] % size:
        raise ValueError(
            f"st.manual.{what}: dimension {dim} of a block of shape {tuple(x.shape)} does not split into {size} "
            "equal parts (one per device along the axis)."
        )


# --------------------------------------------------------------------------- shard_map


def shard_map(fn: Callable, mesh: Mesh | jax.sharding.Mesh, in_specs: Sequence, out_specs: Any) -> Callable:
    """``fn`` (a torch function) run per shard: see the module's doc.

    ``mesh``: an ``st.Mesh`` (or a ``jax.sharding.Mesh``); ``in_specs``: one partition spec per tensor
    argument (how it is split; ``None`` or ``st.P()``: every device gets all of it); ``out_specs``: a
    spec (``st.P(...)``) for a single result, or a tuple of specs, one per result (a mesh axis a spec
    does not name means the result is the same on every device along it).

    Example::

        f = st.shard_map(lambda a: st.manual.all_reduce(a.sum(0, keepdim=True), "x"), mesh,
                         in_specs=(st.P("x", None),), out_specs=st.P())
        f(x)   # x.sum(0, keepdim=True)
    """
    jmesh = mesh if isinstance(mesh, jax.sharding.Mesh) else jax_ops._jax_mesh(mesh)
    names = tuple(jmesh.axis_names)
    ins = tuple(jax_ops.jax_partition_spec(s, names) for s in in_specs)

    def converted(specs):
        if jax_ops._is_spec_sequence(specs):
            return tuple(jax_ops.jax_partition_spec(s, names) for s in specs)
        return jax_ops.jax_partition_spec(specs, names)

    if callable(out_specs):  # (internal: st.local_map's specs depend on the results' ranks)

        def out_for(ndims):
            return converted(out_specs(ndims))

    else:
        outs = converted(out_specs)

        def out_for(ndims):
            return outs

    name = getattr(fn, "__qualname__", None) or repr(fn)
    region = _RegionSpec(fn, name, jmesh, ins, out_for)
    region_id = next(_REGION_IDS)
    _REGION_SPECS[region_id] = region

    def mapped(*tensors: torch.Tensor) -> Any:
        if len(tensors) != len(ins):
            raise ValueError(
                f"st.shard_map({name}): in_specs has {len(ins)} specs but it got {len(tensors)} tensors; "
                "give one partition spec per tensor argument."
            )
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"st.shard_map({name}): argument {i} is a {type(t).__name__}, not a tensor.")
        key = _region_key(region_id, tuple(tuple(t.shape) for t in tensors), tuple(t.dtype for t in tensors))
        out = torch.ops.shardtensor.call_jax(list(tensors), key)
        return out[0] if jax_ops._returns_single(key) else tuple(out)

    # the table holds the region weakly: it lives as long as the function
    mapped._region = region  # type: ignore[attr-defined]
    return mapped


class _RegionSpec:
    """What st.shard_map was given (the table below holds it while its function lives)."""

    def __init__(self, fn, name, jmesh, ins, out_for):
        self.fn, self.name, self.jmesh, self.ins, self.out_for = fn, name, jmesh, ins, out_for


_REGION_IDS = itertools.count()
_REGION_SPECS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _region_key(region_id: int, shapes: tuple, dtypes: tuple) -> int:
    """The call_jax key of a region on arguments of these global shapes and dtypes: captures the
    region's function on its local blocks. Dynamo runs it at trace time (``_dynamo_marked_constant``,
    as for ``jax_ops._key``), so under torch.compile a region is one call_jax op, not a graph break."""
    r = _REGION_SPECS[region_id]
    local = [_local_shape(r.name, i, shape, spec, r.jmesh) for i, (shape, spec) in enumerate(zip(shapes, r.ins))]
    captured, ndims = _capture(r.fn, r.name, r.jmesh, local, list(dtypes))
    specs = r.out_for(ndims)
    _check_out_specs(r.name, specs, ndims)
    return jax_call.key_for(jax_call.JaxCall(captured, (), r.jmesh, r.ins, specs))


_region_key._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _local_shape(name, i, global_shape, spec, jmesh) -> tuple:
    shape = list(global_shape)
    if len(spec) > len(shape):
        raise ValueError(
            f"st.shard_map({name}): the spec {spec} of argument {i} names {len(spec)} dimensions, but the tensor "
            f"has shape {tuple(shape)}."
        )
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        parts = math.prod(jmesh.shape[a] for a in (entry if isinstance(entry, tuple) else (entry,)))
        if shape[d] % parts:
            raise ValueError(
                f"st.shard_map({name}): dimension {d} of argument {i} (shape {tuple(shape)}) does not split into "
                f"{parts} equal blocks as its spec {spec} asks; pad it, or pick a spec whose axes divide it."
            )
        shape[d] //= parts
    return tuple(shape)


def _check_out_specs(name, specs, ndims) -> None:
    single = isinstance(ndims, int)
    seq = (specs,) if isinstance(specs, jax.sharding.PartitionSpec) else tuple(specs)
    ranks = (ndims,) if single else tuple(ndims)
    one_spec = isinstance(specs, jax.sharding.PartitionSpec)
    if single != one_spec or len(seq) != len(ranks):
        returns = "one tensor" if single else f"{len(ranks)} tensors"
        declares = "one spec" if one_spec else f"{len(seq)} specs"
        raise ValueError(
            f"st.shard_map({name}): the function returns {returns} but out_specs declares {declares}; "
            "give st.P(...) for one result, or a tuple with one spec per result."
        )
    for i, (spec, rank) in enumerate(zip(seq, ranks)):
        if len(spec) > rank:
            raise ValueError(
                f"st.shard_map({name}): result {i} has {rank} dimension(s) but its out spec {spec} declares "
                f"{len(spec)}; the declared and the actual output shapes do not match."
            )


# --------------------------------------------------------------------------- capturing fn as a jax function


def _never_run(*_):
    raise RuntimeError("a manual region's placeholder was run outside its region")


class _Region:
    """A captured region: a jax function of the local blocks, equal to another when it is the same
    graph (so the same region recorded twice is one program, and a step with it can freeze)."""

    def __init__(self, name, steps, outputs, single, key):
        self.__qualname__ = name
        self._steps, self._outputs, self._single, self._key = steps, outputs, single, key

    def __eq__(self, other):
        return isinstance(other, _Region) and other._key == self._key

    def __hash__(self):
        return hash(self._key)

    def __call__(self, *args):
        values: list = []

        def resolve(code):
            kind = code[0]
            if kind == "arg":
                return args[code[1]]
            if kind == "node":
                return values[code[1]][code[2]]
            if kind == "scalar":
                dtype = np.dtype(SCALAR_DTYPES[code[1]])
                return _convert_element_type(np.asarray(code[2], dtype), dtype, weak_type=True)
            return code[1]  # "const": a small array from outside

        for caller, codes in self._steps:
            values.append(caller(*[resolve(c) for c in codes]))
        outs = [resolve(c) for c in self._outputs]
        return outs[0] if self._single else tuple(outs)


def _capture(fn, name, jmesh, local_shapes, dtypes):
    """(the region as a jax function, the rank of each result: an int for a single result)."""
    guard = f"st.shard_map({name}): a manual region cannot read values (.item(), printing, bool(tensor))"
    key_cell = rng._cell()  # the random key: a draw inside the region is refused, and the key kept as it was
    key_before = (key_cell.value, key_cell.version, key_cell.is_pending())
    seen = None
    try:
        with _inside(jmesh), torch.no_grad(), capture(guard=guard) as seen:
            placeholders, nodes = [], {}
            for i, (shape, dtype) in enumerate(zip(local_shapes, dtypes)):
                node = Node(_never_run, ("manual_region_argument", i, shape, dtype), ())
                ref = Pending(node, 0)
                to_jax(dtype)  # a clear error for a dtype JAX cannot hold
                cell = Cell(ref, shape, dtype)
                set_pending(cell, ref)
                placeholders.append(ShardedTensor(cell))
                nodes[id(node)] = i
            out = fn(*placeholders)
        if key_cell.version != key_before[1]:
            raise RuntimeError(
                f"st.shard_map({name}): the function draws random numbers; a manual region cannot (draw them "
                "outside and pass them in as an argument)."
            )
        single = isinstance(out, torch.Tensor)
        flat = [out] if single else list(out) if isinstance(out, (tuple, list)) else None
        if not flat or not all(isinstance(o, ShardedTensor) for o in flat):
            raise TypeError(
                f"st.shard_map({name}): the function must return a tensor or a tuple of tensors computed from its "
                f"arguments, got {type(out).__name__}."
            )
        for i, p in enumerate(placeholders):
            if type(p._cell.value) is not Pending or id(p._cell.value.node) not in nodes:
                raise RuntimeError(
                    f"st.shard_map({name}): the function updates its argument {i} in place; a region only returns "
                    "values: return the updated tensor instead."
                )
        updated = seen.updated()
        if updated:
            raise RuntimeError(
                f"st.shard_map({name}): the function updates {len(updated)} tensor(s) from outside the region in "
                "place; a region only returns values (return the new values instead)."
            )
        region = _build(name, [views.read(o) for o in flat], nodes, single)
        ndims = flat[0].dim() if single else tuple(o.dim() for o in flat)
    finally:
        _restore_key(key_cell, key_before)
        if seen is not None:  # (also when fn raised: nothing of the region may stay pending)
            _forget(seen, name, key_cell)
    return region, ndims


def _restore_key(cell, before) -> None:
    value, version, was_pending = before
    if cell.version == version:
        return
    if was_pending:
        set_pending(cell, value)
    else:
        set_concrete(cell, value, cell.owned)
    cell.version = version


def _forget(seen, name, keep) -> None:
    """Take the region's own values out of the pending graph: they exist only inside the region
    (as do an outside tensor's in-place updates made by the region, which was refused)."""
    gone = Failed(RuntimeError(f"this tensor was computed inside the manual region {name}; use the region's results"))
    for cell in seen.pending():
        if cell is not keep:
            set_failed(cell, gone)


def _build(name, out_refs, arg_nodes, single) -> _Region:
    order: list = []
    position: dict = {}
    stack = [r.node for r in out_refs if type(r) is Pending and id(r.node) not in arg_nodes]
    visiting: set = set()
    while stack:  # depth-first post-order over the nodes the results need, stopping at the arguments
        node = stack[-1]
        if id(node) in position:
            stack.pop()
            continue
        deps = [
            r.node
            for r in node.inputs
            if type(r) is Pending and id(r.node) not in arg_nodes and id(r.node) not in position
        ]
        if deps and id(node) not in visiting:
            visiting.add(id(node))
            stack.extend(deps)
            continue
        stack.pop()
        position[id(node)] = len(order)
        order.append(node)
    steps, key_steps = [], []
    for node in order:
        codes = tuple(_code(name, r, arg_nodes, position) for r in node.inputs)
        steps.append((node.caller, codes))
        key_steps.append((node.key, tuple(_key_code(c) for c in codes)))
    outputs = tuple(_code(name, r, arg_nodes, position) for r in out_refs)
    key = (tuple(key_steps), tuple(_key_code(c) for c in outputs), single)
    return _Region(name, steps, outputs, single, key)


def _code(name, ref, arg_nodes, position):
    if type(ref) is Pending:
        if id(ref.node) in arg_nodes:
            return ("arg", arg_nodes[id(ref.node)])
        return ("node", position[id(ref.node)], ref.index)
    if type(ref) is ScalarLeaf:
        return ("scalar", scalar_kind(ref.value), ref.value)
    if type(ref) is Leaf:
        size = math.prod(ref.shape)
        if size > _MAX_CONSTANT:
            raise ValueError(
                f"st.shard_map({name}): the function uses a tensor of shape {tuple(ref.shape)} from outside the "
                "region; pass it as an argument with a partition spec."
            )
        array = np.asarray(jax.device_get(ref.array))[tuple(slice(0, n) for n in ref.shape)]
        return ("const", array)
    raise TypeError(f"st.shard_map({name}): unexpected value {ref!r} in the region's graph")


def _key_code(code):
    if code[0] == "const":
        a = code[1]
        return ("const", a.shape, a.dtype.str, a.tobytes())
    return code
