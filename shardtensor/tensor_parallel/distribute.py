"""DTensor's entry points over shardtensor: ``init_device_mesh``, ``distribute_tensor`` and the
resharding behind ``ShardedTensor.redistribute``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch

from shardtensor.annotate import shard
from shardtensor.mesh import Mesh, default_mesh
from shardtensor.sharding import ShardingSpecError
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor_parallel.partial import distribute_partial, is_partial_placements, redistribute_partial
from shardtensor.tensor_parallel.placements import (
    Partial,
    Placement,
    Replicate,
    _axis_label,
    _checked_placements,
    placements_to_spec,
)


def init_device_mesh(
    device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Sequence[str] | None = None
) -> Mesh:
    """A ``st.Mesh`` over all devices shaped ``mesh_shape`` (DTensor's ``init_device_mesh``).

    ``device_type`` is accepted for DTensor's signature and otherwise unused: the mesh is always
    over shardtensor's devices (``st.device()``).

    Example::

        mesh = st.init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    """
    if not isinstance(device_type, str):
        raise TypeError(f"init_device_mesh(device_type, ...) takes a string such as 'cpu', got {device_type!r}")
    if isinstance(mesh_shape, int):
        mesh_shape = (mesh_shape,)
    shape = tuple(mesh_shape)
    return Mesh(range(math.prod(shape)), shape, None if mesh_dim_names is None else tuple(mesh_dim_names))


def distribute_tensor(
    tensor: torch.Tensor, device_mesh: Mesh | None = None, placements: Sequence[Placement] | None = None
) -> ShardedTensor:
    """A new ShardedTensor holding ``tensor`` laid out as ``placements`` over ``device_mesh``
    (DTensor's ``distribute_tensor``; defaults: the global mesh, replicated). With ``Partial()`` on
    a mesh axis, DTensor's meaning too: each device along it holds ``tensor / n`` (``Partial("avg")``:
    ``tensor``), and the result is a partial tensor whose value is ``tensor``.

    Example::

        mesh = st.init_device_mesh("cpu", (4, 2), mesh_dim_names=("x", "y"))
        x = st.distribute_tensor(torch.randn(8, 6), mesh, [st.Shard(0), st.Replicate()])
        x.placements   # (Shard(dim=0), Replicate())
    """
    mesh = as_mesh(device_mesh)
    if placements is None:
        placements = [Replicate() for _ in mesh.mesh_shape]
    if is_partial_placements(placements):
        return distribute_partial(tensor, mesh, placements)
    return shard(tensor, mesh, placements_to_spec(placements, mesh, tensor.dim()))


def redistribute(
    tensor: ShardedTensor, device_mesh: Mesh | None, placements: Sequence[Placement] | None
) -> ShardedTensor:
    """A new tensor with ``tensor``'s values laid out as ``placements`` over ``device_mesh`` (by
    default its own mesh and placements); what ``ShardedTensor.redistribute`` calls. A partial
    tensor's ``Partial`` axes that become ``Replicate()`` or ``Shard(d)`` are reduced.

    Example: ``redistribute(x, mesh, [st.Replicate(), st.Shard(1)])``.
    """
    mesh = tensor.device_mesh if device_mesh is None else as_mesh(device_mesh)
    if placements is None:
        placements = tensor.placements
    partial = tensor._partial_state()
    if partial is not None:
        return redistribute_partial(tensor, partial, mesh, placements)
    for axis, p in enumerate(_checked_placements(placements, mesh)):
        if isinstance(p, Partial):
            raise ShardingSpecError(
                f"cannot redistribute a {tensor.placements[axis]!r} tensor to {p!r} on mesh axis "
                f"{_axis_label(mesh, axis)}: a tensor becomes partial only from st.from_local, "
                "st.distribute_tensor or a manual region (DTensor's rule too). Redistribute it to "
                "Replicate() or Shard(dim)."
            )
    return cast(ShardedTensor, _Redistribute.apply(tensor, mesh, placements_to_spec(placements, mesh, tensor.dim())))


class _Redistribute(torch.autograd.Function):
    """``st.shard`` of a tensor to a new layout, with the gradient passing through (DTensor's
    redistribute is differentiable; the gradient's layout is left to XLA)."""

    @staticmethod
    def forward(ctx, tensor, mesh, spec):
        return shard(tensor, mesh, spec)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def as_mesh(mesh) -> Mesh:
    """``mesh`` as a st.Mesh: a st.Mesh, a DeviceMesh-shaped object (``shape``, ``mesh_dim_names``) or
    None (the global mesh)."""
    if mesh is None:
        return default_mesh()
    if isinstance(mesh, Mesh):
        return mesh
    shape = getattr(mesh, "shape", None)
    if isinstance(shape, tuple) and hasattr(mesh, "mesh_dim_names"):
        names = mesh.mesh_dim_names
        return Mesh(range(math.prod(shape)), shape, None if names is None else tuple(names))
    raise TypeError(f"expected a st.Mesh (e.g. from st.init_device_mesh), got {type(mesh).__name__}")
