"""Partition specs and the placement math: which device holds which slice of a tensor.

Pure functions of shapes, meshes and specs (no tensors, no device arrays). A spec has one entry
per tensor dimension: ``None`` (not split), a mesh axis name or index, or a tuple of axes (split
over their product, the first listed being the major one). Mesh axes that no entry uses replicate
the tensor. A dimension of size N split k ways gives shards of ``ceil(N/k)``, padded at the end,
exactly PyTorch/XLA's layout.

Example::

    mesh = Mesh(range(8), (4, 2), ('x', 'y'))
    sharding_string(mesh, P('x', None), 2)
    # '{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}'
    placements((8, 4), mesh, P('x', 'y'))[3].indices   # (slice(2, 4, 1), slice(2, 4, 1))
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from types import EllipsisType
from typing import Protocol, TypeAlias

import jax
import numpy as np

from shardtensor import runtime
from shardtensor.mesh import Mesh, jax_axis_names, mesh_for_jax_mesh

_SPEC_HELP = (
    "A partition spec has one entry per tensor dimension: None (replicate it), a mesh axis "
    "name, a mesh axis index, or a tuple of those (first is major)."
)


class ShardingSpecError(AssertionError, ValueError):
    """An invalid partition spec (an AssertionError or ValueError, as in PyTorch/XLA)."""


# One entry of a partition spec: a mesh axis (its name, or its index), several axes (major first; a
# list counts as a tuple), or None (the dimension is not split).
SpecEntry: TypeAlias = "str | int | tuple[str | int, ...] | list[str | int] | None"
# A partition spec as users write it: a PartitionSpec, a tuple or a list of entries.
SpecLike: TypeAlias = "Sequence[SpecEntry]"


class Shaped(Protocol):
    """Anything with a shape: a torch tensor, a numpy or jax array."""

    @property
    def shape(self) -> Sequence[int]: ...


class PartitionSpec(tuple):
    """A partition spec: one entry per tensor dimension. `P` is an alias.

    Lists given as entries become tuples, so specs are hashable.

    Example::

        P('x', None, ('x', 'y'))   # dim 0 over 'x', dim 1 whole, dim 2 over x*y (x major)
        P() == ()                  # a scalar's spec
    """

    def __new__(cls, *entries: SpecEntry) -> PartitionSpec:
        return super().__new__(cls, (_tuple_if_list(e) for e in entries))

    def __getnewargs__(self):  # pickle/deepcopy: rebuild from the entries
        return tuple(self)

    def __repr__(self):
        return f"PartitionSpec({', '.join(map(repr, self))})"


P = PartitionSpec


class ShardingType(IntEnum):
    """PyTorch/XLA's sharding types (OpSharding's numbering)."""

    REPLICATED = 0
    MAXIMAL = 1
    TUPLE = 2
    TILED = 3
    MANUAL = 4
    PARTIAL = 5
    UNKNOWN = 6


@dataclass(frozen=True)
class Placement:
    """What one device holds of a tensor.

    `indices` are the slices of the tensor it holds, without padding (Ellipsis when the tensor is
    fully replicated); `padded_shape` is its shard's shape with padding; `replica_id` is 0 for a
    tiled tensor, the device's place within its replica group for a partly replicated one, and the
    device id for a fully replicated one.
    """

    device_id: int
    indices: tuple[slice, ...] | EllipsisType
    padded_shape: tuple[int, ...]
    replica_id: int


@dataclass(frozen=True)
class ShardingSpec:
    """A mesh and a partition spec, to apply to any tensor of matching rank.

    ``minibatch=True`` says that each process holds only its own slice of the batch (dimension 0,
    which the spec must split): the global batch is the processes' slices together, and each
    process's slice must divide evenly over the shards of dimension 0 its devices hold (see
    ``global_shape``). On one process the local batch is the global batch.

    Example::

        spec = ShardingSpec(mesh, ('x', None))
        spec.can_apply(torch.zeros(8, 4))   # True
        spec.xla_spec(torch.zeros(8))       # None: wrong rank (such a tensor stays replicated)
        ShardingSpec(mesh, ('x', None), minibatch=True).global_shape((8, 4))   # (8, 4) on one process
    """

    mesh: Mesh
    partition_spec: tuple
    minibatch: bool = False

    def __post_init__(self):
        spec = PartitionSpec(*_canonical_spec(self.partition_spec))
        object.__setattr__(self, "partition_spec", spec)
        _check_entry_types(spec)
        per_dim = _mesh_axes_per_dim(self.mesh, spec)  # validate names and indices now
        if self.minibatch and (not per_dim or not per_dim[0]):
            raise ShardingSpecError(
                f"minibatch=True needs a partition spec that splits the batch dimension (dim 0) over "
                f"mesh axes, got {tuple(spec)}: each process's batch is its slice of dim 0. Name a mesh "
                "axis first, e.g. ('data', None), or drop minibatch=True."
            )

    def global_shape(
        self, local_shape: Sequence[int], local_device_ids: Iterable[int] | None = None
    ) -> tuple[int, ...]:
        """The shape of the global tensor of which this process holds ``local_shape``.

        Without ``minibatch`` that is ``local_shape`` itself (every process holds the whole tensor).
        With it, dimension 0 is this process's slice: the global size is the local size times the
        number of dimension-0 shards over the number of them held by ``local_device_ids`` (this
        process's device ids; default: all the mesh's devices, i.e. one process) — the process count
        when the batch is split over every device. The local size must divide by the number of
        shards held locally, else a RuntimeError (as in PyTorch/XLA).

        Example::

            spec = ShardingSpec(Mesh(range(8), (8,), ('data',)), ('data', None), minibatch=True)
            spec.global_shape((16, 3))                               # (16, 3)
            spec.global_shape((16, 3), local_device_ids=range(4))    # (32, 3): half of the devices
        """
        shape = _as_shape(local_shape)
        if not self.minibatch:
            return shape
        _check_rank(self.partition_spec, len(shape))
        tiling = _tiling(self.mesh, self.partition_spec)
        ids = self.mesh.device_ids if local_device_ids is None else local_device_ids
        local_tiles = minibatch_local_tiles(self.mesh, self.partition_spec, ids)
        if not local_tiles:
            raise ValueError(
                f"minibatch: none of this process's devices ({sorted(int(i) for i in ids)}) is in the "
                f"mesh {self.mesh}; build the mesh over every process's devices."
            )
        if shape[0] % len(local_tiles):
            raise RuntimeError(
                "When minibatch is configured, the per-host batch size must be divisible by local "
                f"runtime device count. Per host input data shape = {list(shape)}; dimension 0 is "
                f"split into {len(local_tiles)} shards over this host's devices (spec "
                f"{tuple(self.partition_spec)}). Use a per-host batch size that is a multiple of "
                f"{len(local_tiles)} (e.g. drop_last=True in the DataLoader), or drop minibatch=True."
            )
        return (shape[0] // len(local_tiles) * tiling.shard_counts[0],) + shape[1:]

    def can_apply(self, t: Shaped) -> bool:
        """Whether the spec fits `t` (anything with a ``.shape``): one entry per dimension."""
        return len(t.shape) == len(self.partition_spec)

    def xla_spec(self, t: Shaped) -> str | None:
        """The sharding string for `t`, or None when the spec does not fit it."""
        if not self.can_apply(t):
            return None
        return sharding_string(self.mesh, self.partition_spec, len(t.shape))


# --------------------------------------------------------------------------- checking specs


def _tuple_if_list(entry):
    return tuple(entry) if isinstance(entry, list) else entry


def _canonical_spec(spec) -> tuple:
    """`spec` as a plain tuple with list entries turned into tuples."""
    if isinstance(spec, (str, int)) or spec is None:
        raise ShardingSpecError(
            f"A partition spec must be a tuple, got {spec!r}; for one dimension write ({spec!r},). {_SPEC_HELP}"
        )
    return tuple(_tuple_if_list(e) for e in spec)


def _is_axis_index(entry) -> bool:
    return isinstance(entry, (int, np.integer)) and not isinstance(entry, bool)


def _check_entry_types(spec: tuple) -> None:
    for entry in spec:
        members = entry if isinstance(entry, tuple) else (entry,)
        if isinstance(entry, tuple) and any(isinstance(m, tuple) for m in entry):
            raise ShardingSpecError(
                f"Partition spec cannot contain nested tuples, got {entry!r} in {spec}. "
                "List all the axes of one dimension in one flat tuple, e.g. ('x', 'y')."
            )
        for member in members:
            if member is None and not isinstance(entry, tuple):
                continue
            if not (isinstance(member, str) or _is_axis_index(member)):
                raise ShardingSpecError(
                    f"Spec type {type(member)} is not supported in partition spec {spec}. {_SPEC_HELP}"
                )


def _check_rank(spec: tuple, ndim: int) -> None:
    if len(spec) != ndim:
        raise ShardingSpecError(
            f"Partition spec length ({len(spec)}) should be equal to the input rank ({ndim}). {_SPEC_HELP}"
        )


def _axis_index(mesh: Mesh, axis) -> int:
    if isinstance(axis, str):
        index = mesh.get_axis_name_idx(axis)
        if index is None:
            raise ShardingSpecError(
                f"Axis name {axis} is not defined in the given mesh "
                f"(its axes are {mesh.axis_names or 'unnamed: use indices'})."
            )
        return index
    return int(axis)


@functools.lru_cache(maxsize=4096)
def _mesh_axes_per_dim(mesh: Mesh, spec: tuple) -> tuple[tuple[int, ...], ...]:
    per_dim = tuple(
        tuple(_axis_index(mesh, a) for a in (entry if isinstance(entry, tuple) else (entry,)))
        if entry is not None
        else ()
        for entry in spec
    )
    used = [a for axes in per_dim for a in axes]
    if not all(0 <= a < len(mesh.mesh_shape) for a in used):
        raise ShardingSpecError(
            f"partition_spec ({spec}) contains out of bound index into mesh_shape "
            f"{mesh.mesh_shape} (valid indices: 0..{len(mesh.mesh_shape) - 1})."
        )
    if len(set(used)) != len(used):
        raise ShardingSpecError(
            f"Each device mesh dimension should appear at most once in partition_spec {spec}; "
            "to split one tensor dimension over several axes, put them in one tuple."
        )
    return per_dim


def normalize_spec(mesh: Mesh, spec, ndim: int) -> tuple[tuple[int, ...], ...]:
    """Check `spec` for a rank-`ndim` tensor; per dimension, the mesh-axis indices it uses.

    Example::

        normalize_spec(Mesh(range(8), (4, 2), ('x', 'y')), ('y', None), 2)   # ((1,), ())
    """
    spec = _canonical_spec(spec)
    _check_rank(spec, ndim)
    _check_entry_types(spec)
    return _mesh_axes_per_dim(mesh, spec)


# --------------------------------------------------------------------------- tile assignment


@dataclass(frozen=True)
class _Tiling:
    shard_counts: tuple[int, ...]  # shards per tensor dimension
    replicas: int  # copies of each shard (product of unused mesh axes)
    device_order: tuple[int, ...]  # device ids, row-major over shard_counts + (replicas,)

    @property
    def is_replicated(self) -> bool:
        return math.prod(self.shard_counts) == 1


@functools.lru_cache(maxsize=4096)
def _tiling(mesh: Mesh, spec: tuple) -> _Tiling:
    per_dim = _mesh_axes_per_dim(mesh, spec)
    used = [a for axes in per_dim for a in axes]
    unused = [a for a in range(len(mesh.mesh_shape)) if a not in used]
    replicas = math.prod(mesh.mesh_shape[a] for a in unused)
    # Axes in spec order (tuple members adjacent, major first), then the replicating axes:
    # flattening gives the devices in tile order. XLA lists each replica group in id order
    # (its normal form), so sort within groups; this also fixes the replica ids.
    order = mesh.get_logical_mesh().transpose(used + unused).reshape(-1, replicas)
    return _Tiling(
        shard_counts=tuple(math.prod(mesh.mesh_shape[a] for a in axes) for axes in per_dim),
        replicas=replicas,
        device_order=tuple(np.sort(order, axis=1).reshape(-1).tolist()),
    )


def _checked_tiling(mesh: Mesh, spec, ndim: int) -> tuple[tuple, _Tiling]:
    spec = _canonical_spec(spec)
    normalize_spec(mesh, spec, ndim)
    return spec, _tiling(mesh, spec)


def tile_assignment(mesh: Mesh, spec, ndim: int) -> tuple[tuple[int, ...], list[int], bool]:
    """XLA's tile assignment: (tile dims, flat device ids, last_tile_dim_replicate).

    The tile dims are the shard counts per dimension plus a trailing replica dim when unused mesh
    axes give more than one copy (a replica factor of 1 is dropped).

    Example::

        tile_assignment(Mesh(range(8), (4, 2), ('x', 'y')), ('x', None), 2)
        # ((4, 1, 2), [0, 1, 2, 3, 4, 5, 6, 7], True)
    """
    _, tiling = _checked_tiling(mesh, spec, ndim)
    replicate = tiling.replicas > 1
    dims = tiling.shard_counts + ((tiling.replicas,) if replicate else ())
    return dims, list(tiling.device_order), replicate


def sharding_type(mesh: Mesh, spec, ndim: int) -> ShardingType:
    """REPLICATED (nothing split), PARTIAL (split and replicated) or TILED.

    Example: ``sharding_type(Mesh(range(8), (4, 2)), (0, None), 2) == ShardingType.PARTIAL``.
    """
    _, tiling = _checked_tiling(mesh, spec, ndim)
    if tiling.is_replicated:
        return ShardingType.REPLICATED
    return ShardingType.PARTIAL if tiling.replicas > 1 else ShardingType.TILED


def sharding_string(mesh: Mesh, spec, ndim: int) -> str:
    """PyTorch/XLA's sharding string (HLO's V1 format), for debugging.

    Example::

        sharding_string(Mesh(range(8), (4, 2), ('x', 'y')), ('y', 'x'), 2)
        # '{devices=[2,4]0,2,4,6,1,3,5,7}'
    """
    if sharding_type(mesh, spec, ndim) == ShardingType.REPLICATED:
        return "{replicated}"
    dims, devices, replicate = tile_assignment(mesh, spec, ndim)
    suffix = " last_tile_dim_replicate" if replicate else ""
    return f"{{devices=[{','.join(map(str, dims))}]{','.join(map(str, devices))}{suffix}}}"


def shard_counts(mesh: Mesh, spec, ndim: int) -> tuple[int, ...]:
    """How many shards each dimension is split into.

    Example: ``shard_counts(Mesh(range(8), (4, 2), ('x', 'y')), (None, ('x', 'y')), 2) == (1, 8)``.
    """
    return _checked_tiling(mesh, spec, ndim)[1].shard_counts


def minibatch_local_tiles(mesh: Mesh, spec, local_device_ids) -> tuple[int, ...]:
    """The dimension-0 shard indices held by ``local_device_ids``, ascending.

    With ``minibatch``, a process's batch is cut into that many equal blocks, given in this order
    to those shards (on one process: every shard, in order).

    Example::

        minibatch_local_tiles(Mesh(range(8), (4, 2), ('x', 'y')), ('x', None), [4, 5, 6, 7])   # (2, 3)
    """
    spec = _canonical_spec(spec)
    tiling = _tiling(mesh, spec)
    grid = tiling.shard_counts + (tiling.replicas,)
    local = {int(i) for i in local_device_ids}
    return tuple(
        sorted(
            {
                int(np.unravel_index(position, grid)[0])
                for position, device in enumerate(tiling.device_order)
                if device in local
            }
        )
    )


# --------------------------------------------------------------------------- shapes and placement


def _as_shape(shape) -> tuple[int, ...]:
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"A shape has no negative sizes, got {shape}.")
    return shape


def shard_shape(shape, mesh: Mesh, spec) -> tuple[int, ...]:
    """The padded shape of each shard: ``ceil(N / k)`` per dimension.

    Example: ``shard_shape((10,), Mesh(range(8), (8,)), (0,)) == (2,)``.
    """
    shape = _as_shape(shape)
    counts = shard_counts(mesh, spec, len(shape))
    return tuple(-(-n // k) for n, k in zip(shape, counts))


def padded_shape(shape, mesh: Mesh, spec) -> tuple[int, ...]:
    """The tensor's shape padded so that every shard has the same size.

    Example: ``padded_shape((10, 3), Mesh(range(8), (4, 2)), (0, 1)) == (12, 4)``.
    """
    shape = _as_shape(shape)
    counts = shard_counts(mesh, spec, len(shape))
    return tuple(s * k for s, k in zip(shard_shape(shape, mesh, spec), counts))


def placements(shape, mesh: Mesh, spec) -> tuple[Placement, ...]:
    """For every global device, in id order, the part of the tensor it holds.

    Example::

        p = placements((5,), Mesh(range(4), (4,)), (0,))    # on 4 devices
        [x.indices for x in p]   # [(slice(0, 2, 1),), (slice(2, 4, 1),), (slice(4, 5, 1),), (slice(5, 5, 1),)]
        p[3].padded_shape        # (2,): all padding
    """
    shape = _as_shape(shape)
    spec, _ = _checked_tiling(mesh, spec, len(shape))
    return _placements(shape, mesh, spec)


@functools.lru_cache(maxsize=1024)
def _placements(shape: tuple, mesh: Mesh, spec: tuple) -> tuple[Placement, ...]:
    tiling = _tiling(mesh, spec)
    if tiling.is_replicated:
        return tuple(Placement(d, Ellipsis, shape, d) for d in sorted(tiling.device_order))
    sizes = shard_shape(shape, mesh, spec)
    grid = tiling.shard_counts + (tiling.replicas,)
    by_device = {}
    for position, device in enumerate(tiling.device_order):
        *tile, replica = (int(c) for c in np.unravel_index(position, grid))
        indices = tuple(slice(min(t * s, n), min((t + 1) * s, n), 1) for t, s, n in zip(tile, sizes, shape))
        by_device[device] = Placement(device, indices, sizes, replica)
    return tuple(by_device[d] for d in sorted(by_device))


def to_jax_spec(mesh: Mesh, spec, ndim: int):
    """The same spec as a ``jax.sharding.PartitionSpec`` over `mesh.get_jax_mesh()`'s names.

    Example::

        to_jax_spec(Mesh(range(8), (4, 2)), ((1, 0), None), 2)   # PartitionSpec(('1', '0'), None)
    """
    spec = _canonical_spec(spec)
    per_dim = normalize_spec(mesh, spec, ndim)
    names = jax_axis_names(mesh)
    entries: list[str | tuple[str, ...] | None] = []
    for entry, axes in zip(spec, per_dim):
        if not axes:
            entries.append(None)
        elif isinstance(entry, tuple):
            entries.append(tuple(names[a] for a in axes))
        else:
            entries.append(names[axes[0]])
    return jax.sharding.PartitionSpec(*entries)


def named_sharding(mesh: Mesh, spec, ndim: int) -> jax.sharding.NamedSharding:
    """The jax NamedSharding of (mesh, spec) for a tensor of rank ``ndim``.

    Example: ``named_sharding(mesh, ('x', None), 2).spec == jax.P('x', None)``.
    """
    return jax.sharding.NamedSharding(mesh.get_jax_mesh(), to_jax_spec(mesh, spec, ndim))


# --------------------------------------------------------------------------- reading shardings back


@dataclass(frozen=True)
class ParsedSharding:
    """A sharding string taken apart.

    ``kind`` is ``'replicated'``, ``'maximal'`` (one device holds everything) or ``'tiled'``;
    ``tile_dims`` are the shard counts of the tensor's dimensions (the replica dimension of
    ``last_tile_dim_replicate`` excluded); ``replicas`` the size of each replica group;
    ``devices`` the device ids row-major over ``tile_dims + (replicas,)``.
    """

    kind: str
    tile_dims: tuple[int, ...]
    replicas: int
    devices: tuple[int, ...]

    def device_grid(self) -> np.ndarray:
        """Device ids as an array of shape ``tile_dims + (replicas,)``."""
        return np.array(self.devices, dtype=np.int64).reshape(self.tile_dims + (self.replicas,))


_TILED = re.compile(
    r"\{devices=\[(?P<dims>\d+(?:,\d+)*)\]"
    r"(?:(?P<ids>\d+(?:,\d+)*)|<=\[(?P<iota>\d+(?:,\d+)*)\](?:T\((?P<perm>\d+(?:,\d+)*)\))?)"
    r"(?P<suffix>(?:\s+last_tile_dim_replicate|\s+last_tile_dims=\{replicated\})?)\}"
)
_MAXIMAL = re.compile(r"\{maximal device=(\d+)\}")


def _ints(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


def parse_sharding_string(sharding: str, device_count: int | None = None) -> ParsedSharding:
    """Parse an HLO sharding string, in V1 (explicit ids) or V2 (iota) form.

    ``''`` (no sharding) and ``'{replicated}'`` mean every one of ``device_count`` devices (default:
    all devices of the runtime) holds everything. Anything else that is not a tiling or
    ``{maximal device=N}`` raises ValueError.

    Example::

        parse_sharding_string('{devices=[4,1,2]<=[8] last_tile_dim_replicate}').tile_dims   # (4, 1)
    """
    if not isinstance(sharding, str):
        raise TypeError(f"a sharding string is a str, got {type(sharding).__name__}")
    text = sharding.strip()
    if text in ("", "{replicated}"):
        n = runtime.global_runtime_device_count() if device_count is None else device_count
        return ParsedSharding("replicated", (), n, tuple(range(n)))
    m = _MAXIMAL.fullmatch(text)
    if m:
        return ParsedSharding("maximal", (), 1, (int(m.group(1)),))
    m = _TILED.fullmatch(text)
    if not m:
        raise ValueError(
            f"sharding {sharding!r} is not organized as expected: expected '{{replicated}}', "
            "'{devices=[d0,d1,...]id,id,... (last_tile_dim_replicate)}' or its iota form "
            "'{devices=[...]<=[...]}' (manual and tuple shardings cannot be shown)"
        )
    dims = _ints(m.group("dims"))
    total = math.prod(dims)
    if m.group("ids") is not None:
        devices = _ints(m.group("ids"))
    else:
        # V2: the ids are arange reshaped to the iota dims, transposed, flattened
        iota = _ints(m.group("iota"))
        perm = _ints(m.group("perm")) if m.group("perm") else list(range(len(iota)))
        if math.prod(iota) != total or sorted(perm) != list(range(len(iota))):
            raise ValueError(
                f"sharding {sharding!r}: its iota {iota} T{tuple(perm)} does not fill the tile dims {dims}"
            )
        devices = np.arange(total).reshape(iota).transpose(perm).reshape(-1).tolist()
    if len(devices) != total or len(set(devices)) != total:
        raise ValueError(
            f"sharding {sharding!r}: tile dims {dims} need {total} distinct device ids, "
            f"got {len(devices)} ids ({len(set(devices))} distinct)"
        )
    replicas = dims.pop() if m.group("suffix").strip() else 1
    return ParsedSharding("tiled", tuple(dims), replicas, tuple(devices))


def _v1_string(parsed: ParsedSharding) -> str:
    """PyTorch/XLA's V1 form of a parsed sharding (explicit device ids)."""
    if parsed.kind == "replicated":
        return "{replicated}"
    if parsed.kind == "maximal":
        return f"{{maximal device={parsed.devices[0]}}}"
    dims = parsed.tile_dims + ((parsed.replicas,) if parsed.replicas > 1 else ())
    suffix = " last_tile_dim_replicate" if parsed.replicas > 1 else ""
    return f"{{devices=[{','.join(map(str, dims))}]{','.join(map(str, parsed.devices))}{suffix}}}"


def spec_of_named_sharding(mesh: Mesh, jax_spec, ndim: int) -> PartitionSpec:
    """A jax PartitionSpec over ``mesh.get_jax_mesh()`` as shardtensor's, over the mesh's own axes.

    Axis names stay names on a named mesh; on an unnamed one (jax calls its axes ``'0'``, ``'1'``)
    they become indices.

    Example::

        spec_of_named_sharding(Mesh(range(8), (4, 2)), jax.P('1', None), 2)   # PartitionSpec(1, None)
    """
    names = jax_axis_names(mesh)

    def axis(name):
        return name if mesh.axis_names is not None else names.index(name)

    entries = []
    for entry in list(jax_spec)[:ndim] + [None] * (ndim - len(jax_spec)):
        if isinstance(entry, tuple):
            entries.append(tuple(axis(n) for n in entry) if len(entry) > 1 else axis(entry[0]))
        elif isinstance(entry, str):
            entries.append(axis(entry))
        else:
            entries.append(None)  # None, or jax's UNCONSTRAINED: not split by this spec
    return PartitionSpec(*entries)


def array_sharding(array, ndim: int) -> tuple[str, Mesh | None, PartitionSpec | None]:
    """(PyTorch/XLA sharding string, Mesh, spec) of a jax array or a compiled output's sharding.

    ``array`` is a ``jax.Array`` or a ``jax.sharding.Sharding``. The mesh and spec are None when the
    sharding is not over a mesh.

    Example::

        array_sharding(jax.device_put(x, NamedSharding(m.get_jax_mesh(), P('x'))), 1)
        # ('{devices=[8]0,1,2,3,4,5,6,7}', m, PartitionSpec('x'))
    """
    s = array if isinstance(array, jax.sharding.Sharding) else array.sharding
    if isinstance(s, jax.sharding.NamedSharding):
        mesh = mesh_for_jax_mesh(s.mesh)
        spec = spec_of_named_sharding(mesh, s.spec, ndim)
        return sharding_string(mesh, spec, ndim), mesh, spec
    if s.is_fully_replicated:
        return "{replicated}", None, None
    parsed = parse_sharding_string(str(s._to_xla_hlo_sharding(ndim)))
    # HLO's ids are positions in the sharding's device assignment, not device ids
    assignment = [runtime.device_id(d) for d in s._device_assignment]
    parsed = ParsedSharding(
        parsed.kind, parsed.tile_dims, parsed.replicas, tuple(assignment[i] for i in parsed.devices)
    )
    return _v1_string(parsed), None, None
