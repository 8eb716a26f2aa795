"""DTensor's placements (``Shard(dim)``, ``Replicate()``, ``Partial()``) and their conversion to and
from the PartitionSpecs that ``st.shard`` takes.

A list of placements has one entry per mesh axis (what that axis does to the tensor); a
PartitionSpec has one entry per tensor dimension (which mesh axes split it). Several mesh axes on
one dimension are a tuple entry in mesh-axis order (the first axis major), which is what DTensor's
``[Shard(0), Shard(0)]`` means.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from shardtensor.mesh import Mesh
from shardtensor.sharding import PartitionSpec, ShardingSpecError, SpecLike, normalize_spec


@dataclasses.dataclass(frozen=True)
class Shard:
    """The tensor dimension ``dim`` is split over this mesh axis (DTensor's ``Shard``).

    Example: ``placements_to_spec([Shard(0), Replicate()], mesh42, 2) == P('x', None)``.
    """

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"Shard(dim) takes an int dimension, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        """True (for ``dim``: when it is this placement's dimension). Example: ``Shard(1).is_shard(1)``."""
        return dim is None or dim == self.dim

    def is_replicate(self) -> bool:
        """False. Example: ``not Shard(0).is_replicate()``."""
        return False

    def is_partial(self) -> bool:
        """False. Example: ``not Shard(0).is_partial()``."""
        return False

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Every device along this mesh axis holds the whole tensor (DTensor's ``Replicate``).

    Example: ``placements_to_spec([Replicate()], mesh8, 2) == P(None, None)``.
    """

    def is_shard(self, dim: int | None = None) -> bool:
        """False. Example: ``not Replicate().is_shard()``."""
        return False

    def is_replicate(self) -> bool:
        """True. Example: ``Replicate().is_replicate()``."""
        return True

    def is_partial(self) -> bool:
        """False. Example: ``not Replicate().is_partial()``."""
        return False

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"


_REDUCE_OPS = ("sum", "avg", "product", "min", "max")


@dataclasses.dataclass(frozen=True)
class Partial:
    """Devices along this mesh axis hold parts still to be reduced with ``reduce_op`` (DTensor's
    ``Partial``): a partial tensor comes from ``st.from_local`` or ``st.distribute_tensor``, and
    reading it resolves it; a PartitionSpec cannot say it. Supported as a value: "sum" and "avg".

    Example: ``Partial()`` (a pending sum), ``Partial("max")``.
    """

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in _REDUCE_OPS:
            raise ValueError(f"Partial(reduce_op) must be one of {_REDUCE_OPS}, got {self.reduce_op!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        """False. Example: ``not Partial().is_shard()``."""
        return False

    def is_replicate(self) -> bool:
        """False. Example: ``not Partial().is_replicate()``."""
        return False

    def is_partial(self) -> bool:
        """True. Example: ``Partial().is_partial()``."""
        return True

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


Placement = Shard | Replicate | Partial


def placements_to_spec(placements: Sequence[Placement], mesh: Mesh, ndim: int) -> PartitionSpec:
    """The PartitionSpec of a rank-``ndim`` tensor laid out as ``placements`` over ``mesh``.

    Mesh axes are named in the spec by name (by index on an unnamed mesh); several axes on one
    dimension form a tuple in mesh-axis order. ``Shard(-1)`` counts from the end, as in DTensor.

    Example::

        mesh = st.Mesh(range(8), (4, 2), ("x", "y"))
        placements_to_spec([Shard(0), Shard(0)], mesh, 2)    # P(('x', 'y'), None)
        placements_to_spec([Replicate(), Shard(1)], mesh, 2) # P(None, 'y')
    """
    placements = _checked_placements(placements, mesh)
    axes_per_dim: list[list[str | int]] = [[] for _ in range(ndim)]
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ShardingSpecError(
                f"{p!r} on mesh axis {_axis_label(mesh, axis)} has no PartitionSpec: a partial value exists "
                "only as a partial tensor (st.from_local or st.distribute_tensor with Partial()), not as a "
                "layout. Redistribute it to Replicate() or Shard(dim) first."
            )
        if isinstance(p, Shard):
            dim = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= dim < ndim:
                raise ShardingSpecError(
                    f"{p!r} on mesh axis {_axis_label(mesh, axis)} is out of range for a tensor with {ndim} "
                    f"dimension(s) (valid: {-ndim}..{ndim - 1})"
                )
            axes_per_dim[dim].append(_axis_label(mesh, axis))
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else tuple(a) for a in axes_per_dim))


def spec_to_placements(mesh: Mesh, spec: SpecLike, ndim: int) -> tuple[Placement, ...]:
    """DTensor's placements (one per mesh axis) of a rank-``ndim`` tensor laid out as ``spec``.

    A dimension split over several axes maps when its tuple lists them in mesh-axis order; another
    order (DTensor's ``_StridedShard``) is an error.

    Example::

        mesh = st.Mesh(range(8), (4, 2), ("x", "y"))
        spec_to_placements(mesh, ("y", None), 2)        # (Replicate(), Shard(dim=0))
        spec_to_placements(mesh, (("x", "y"), None), 2) # (Shard(dim=0), Shard(dim=0))
    """
    axes_per_dim = normalize_spec(mesh, spec, ndim)  # raises a clear ShardingSpecError
    placements: list[Placement] = [Replicate() for _ in mesh.mesh_shape]
    for dim, axes in enumerate(axes_per_dim):
        if list(axes) != sorted(axes):
            names = tuple(_axis_label(mesh, a) for a in axes)
            raise ShardingSpecError(
                f"dimension {dim} of spec {tuple(spec)} is split over mesh axes {names}, minor axis first; "
                "DTensor's placements can say that only with _StridedShard, which shardtensor does not "
                f"support. List the axes in mesh order: {tuple(sorted(names, key=lambda n: _axis_index(mesh, n)))}."
            )
        for a in axes:
            placements[a] = Shard(dim)
    return tuple(placements)


def _checked_placements(placements, mesh: Mesh) -> tuple[Placement, ...]:
    if isinstance(placements, (Shard, Replicate, Partial)):
        placements = (placements,)
    placements = tuple(placements)
    for p in placements:
        if not isinstance(p, (Shard, Replicate, Partial)):
            raise TypeError(f"placements must be st.Shard(dim), st.Replicate() or st.Partial(), got {p!r}")
    if len(placements) != len(mesh.mesh_shape):
        raise ValueError(
            f"give one placement per mesh axis: the mesh {dict(mesh.shape())} has {len(mesh.mesh_shape)} "
            f"axes, got {len(placements)} placements {list(placements)}"
        )
    return placements


def _axis_label(mesh: Mesh, axis: int) -> str | int:
    return mesh.axis_names[axis] if mesh.axis_names is not None else axis


def _axis_index(mesh: Mesh, label: str | int) -> int:
    return mesh.axis_names.index(label) if isinstance(label, str) and mesh.axis_names else int(label)
