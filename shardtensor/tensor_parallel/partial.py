"""``Partial`` as a value: a tensor still to be reduced over some mesh axes (DTensor's ``Partial``).

A partial tensor is a ShardedTensor whose value is the reduction, plus a record (``PartialState``)
of its *summands*: one array with a hidden leading dimension per ``Partial`` mesh axis (in mesh-axis
order), each hidden dimension split over its own mesh axis, so that every device holds exactly the
piece DTensor's rank at that mesh coordinate would hold. Reading the tensor (``.cpu()``,
``full_tensor()``, any op on it) reads the reduction; ``redistribute`` to ``Replicate()`` or
``Shard(d)`` reduces the summands over the hidden dimensions: an all-reduce or a reduce-scatter over
the mesh axis (``reduce``), or, where the layouts do not fit that, a sum under the target sharding
that XLA partitions (an all-reduce and a local slice).

Only ``"sum"`` and ``"avg"`` are supported; the record goes stale when the tensor is changed in
place (the tensor is then an ordinary one, its placements derived from its layout).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, cast

import torch

from shardtensor.annotate import mark_sharding, shard
from shardtensor.mesh import Mesh
from shardtensor.sharding import ShardingSpecError
from shardtensor.tensor import LocalShard, ShardedTensor
from shardtensor.tensor_parallel.placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _axis_label,
    _checked_placements,
    placements_to_spec,
)
from shardtensor.tensor_parallel.reduce import plan

SUPPORTED_REDUCE_OPS = ("sum", "avg")


@dataclasses.dataclass(eq=False)
class PartialState:
    """What makes a ShardedTensor partial: its summands and placements.

    ``summands`` has shape ``(k_1, ..., k_h, *shape)``, one hidden dimension per ``Partial`` axis of
    ``placements`` (mesh order), split over that axis. ``cell`` and ``version`` are the tensor's
    storage cell and torch version counter when it was made: an in-place change makes it stale.
    """

    summands: ShardedTensor
    mesh: Mesh
    placements: tuple[Placement, ...]
    cell: Any
    version: int

    @property
    def reduce_op(self) -> str:
        """The one reduce op of the Partial placements ("sum" or "avg")."""
        return next(p.reduce_op for p in self.placements if isinstance(p, Partial))

    @property
    def partial_axes(self) -> tuple[int, ...]:
        """The mesh axes (indices) the tensor is partial over, in mesh order."""
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Partial))

    def local_shards(self) -> list[LocalShard]:
        """Each addressable device's summand piece (DTensor's local tensor of that mesh coordinate),
        with ``indices`` into the global tensor (the hidden dimensions dropped)."""
        h = len(self.partial_axes)
        out = []
        for s in self.summands.local_shards:
            data = s.data.reshape(s.data.shape[h:])  # each hidden dimension is 1 on a device
            indices = s.indices if s.indices is Ellipsis else tuple(s.indices[h:])
            out.append(LocalShard(data, indices, s.device, s.replica_id))
        return out


def summand_spec(mesh: Mesh, placements: Sequence[Placement], ndim: int) -> tuple:
    """The PartitionSpec of the summands array: one hidden dim per Partial axis, then the data dims."""
    hidden = tuple(_axis_label(mesh, a) for a, p in enumerate(placements) if isinstance(p, Partial))
    return hidden + tuple(placements_to_spec(without_partial(placements), mesh, ndim))


def without_partial(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` with every ``Partial`` read as ``Replicate()`` (the layout of its data dims)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def check_partial(placements: Sequence[Placement], dtype: torch.dtype) -> str | None:
    """The reduce op of ``placements``'s Partials (None when there are none); a clear error for ops
    shardtensor does not support, for mixed ops and for dtypes the op cannot reduce."""
    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    if not ops:
        return None
    if len(ops) > 1:
        raise ValueError(f"placements {list(placements)} mix Partial reduce ops {sorted(ops)}: give one reduce op")
    (op,) = ops
    if op not in SUPPORTED_REDUCE_OPS:
        raise NotImplementedError(
            f"Partial({op!r}) is not supported as a value: shardtensor supports Partial('sum') and "
            "Partial('avg'). Reduce the parts yourself (e.g. torch.amax) and use Replicate()."
        )
    if dtype == torch.bool or (op == "avg" and not (dtype.is_floating_point or dtype.is_complex)):
        raise TypeError(f"Partial({op!r}) cannot hold a {dtype} tensor: use a floating-point tensor")
    return op


def make_partial(summands: ShardedTensor, mesh: Mesh, placements: Sequence[Placement]) -> ShardedTensor:
    """The partial tensor whose summands are ``summands`` (see ``PartialState``); its value is their
    reduction, recorded as a pending op (lazy mode) that reading resolves.

    Example: ``make_partial(st.shard(torch.ones(8, 3), mesh8, ("x", None)), mesh8, [Partial()])``.
    """
    placements = _checked_placements(placements, mesh)
    hidden = tuple(range(len([p for p in placements if isinstance(p, Partial)])))
    ndim = summands.dim() - len(hidden)
    placements = tuple(Shard(p.dim + ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in placements)
    summands = cast(ShardedTensor, summands.detach())
    op = check_partial(placements, summands.dtype)
    with torch.no_grad():
        value = cast(ShardedTensor, reduce_hidden(summands, hidden, op or "sum"))
    value._partial = PartialState(  # type: ignore[attr-defined]  # (ShardedTensor's partial slot)
        summands, mesh, tuple(placements), value._cell, value._version
    )
    return value


def reduce_hidden(summands: torch.Tensor, dims: Sequence[int], op: str) -> torch.Tensor:
    """``summands`` summed (``op="sum"``) or averaged (``"avg"``) over the hidden ``dims``, in its dtype."""
    if not dims:
        return summands
    total = summands.sum(dim=tuple(dims), dtype=summands.dtype)
    if op == "avg":
        total = total / math.prod(summands.shape[d] for d in dims)
    return total


def distribute_partial(tensor: torch.Tensor, mesh: Mesh, placements: Sequence[Placement]) -> ShardedTensor:
    """``distribute_tensor`` with ``Partial`` placements, with DTensor's meaning: every device along a
    ``Partial("sum")`` axis of size n holds ``tensor / n`` (so the sum is ``tensor``, up to
    rounding), along a ``Partial("avg")`` axis ``tensor`` itself.

    Example: ``distribute_partial(torch.ones(4), mesh8, [Partial()])`` (each device: 1/8).
    """
    placements = _checked_placements(placements, mesh)
    op = check_partial(placements, tensor.dtype)
    if op == "sum" and not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        raise TypeError(
            f"distribute_tensor with Partial('sum') divides the tensor by the axis size (as DTensor does), "
            f"which a {tensor.dtype} tensor cannot hold exactly: use a floating-point tensor, or build the "
            "summands yourself with st.from_local"
        )
    piece = tensor.detach()
    sizes = [mesh.mesh_shape[a] for a, p in enumerate(placements) if isinstance(p, Partial)]
    if op == "sum":
        for n in sizes:  # (one division per axis, in mesh order: DTensor's values bit for bit)
            piece = piece / n
    host = piece.expand(*sizes, *piece.shape).contiguous()
    summands = shard(host, mesh, summand_spec(mesh, placements, tensor.dim()))
    out = make_partial(summands, mesh, placements)
    if tensor.requires_grad:
        out.requires_grad_(True)
    return out


class _FromSummands(torch.autograd.Function):
    """The partial tensor ``x`` reduced over some of its partial axes (forward); the gradient passes
    through unchanged (the result has ``x``'s value)."""

    @staticmethod
    def forward(ctx, x, state: PartialState, placements: tuple):
        mesh = state.mesh
        axes = state.partial_axes
        reduced = tuple(i for i, a in enumerate(axes) if not isinstance(placements[a], Partial))
        kept = [a for a in axes if isinstance(placements[a], Partial)]
        hidden = tuple(_axis_label(mesh, a) for a in kept)
        spec = hidden + tuple(placements_to_spec(without_partial(placements), mesh, x.dim()))
        source_spec = summand_spec(mesh, state.placements, x.dim())
        layout = plan(mesh, state.placements, placements, source_spec, spec, tuple(x.shape))
        if layout is not None:  # explicit all-reduce / reduce-scatter instructions
            summands = torch.ops.shardtensor.partial_reduce(state.summands, layout)
        else:  # a sum under the target sharding: XLA partitions it (an all-reduce)
            summands = reduce_hidden(state.summands, reduced, state.reduce_op)
        if summands is state.summands:  # nothing reduced: a copy to lay out anew, not the stored summands
            summands = summands.clone()
        # a fresh result: on a pending value this is a sharding constraint the reduction is partitioned by
        mark_sharding(cast(ShardedTensor, summands), mesh, spec)
        if kept:
            return make_partial(cast(ShardedTensor, summands), mesh, placements)
        return summands

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def redistribute_partial(x: ShardedTensor, state: PartialState, mesh: Mesh, placements) -> ShardedTensor:
    """``x`` (partial as ``state`` says) laid out as ``placements``: the Partial axes that become
    ``Replicate()`` or ``Shard(d)`` are reduced (an all-reduce or a reduce-scatter), those that stay
    ``Partial`` stay.

    Example: ``x.redistribute(mesh, [st.Replicate()])`` on ``x`` partial over the mesh's one axis.
    """
    if mesh != state.mesh:
        raise ValueError(
            f"a partial tensor redistributes within its own mesh {dict(state.mesh.shape())}; redistribute it "
            f"to Replicate()/Shard(dim) first, then to the mesh {dict(mesh.shape())}"
        )
    ndim = x.dim()
    placements = tuple(
        Shard(p.dim + ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in _checked_placements(placements, mesh)
    )
    for a, (src, dst) in enumerate(zip(state.placements, placements)):
        if isinstance(dst, Partial) and src != dst:
            raise ShardingSpecError(
                f"cannot redistribute from {src!r} to {dst!r} on mesh axis {_axis_label(mesh, a)}: a tensor "
                "becomes partial only from st.from_local, st.distribute_tensor or a manual region, and a "
                "Partial keeps its reduce op (DTensor's rule too). Redistribute to Replicate() or Shard(dim)."
            )
    if placements == state.placements:
        return x
    return cast(ShardedTensor, _FromSummands.apply(x, state, tuple(placements)))


def is_partial_placements(placements) -> bool:
    """True when ``placements`` (a placement or a sequence of them) has a ``Partial``."""
    if isinstance(placements, Partial):
        return True
    return placements is not None and any(isinstance(p, Partial) for p in placements)
