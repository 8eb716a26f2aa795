"""What a tensor-parallel style's placements mean on a shardtensor mesh: the specs of parameters
and activations, and an autograd-aware layout change for module inputs and outputs.

A style speaks of one mesh axis, the tensor-parallel one (DTensor passes a 1-D ``mesh["tp"]``).
shardtensor keeps one whole mesh, so ``TensorParallelMesh`` names that axis inside it. On the other
axes (the data-parallel ones: ``"fsdp"``, ``"dp"``...) a parameter keeps whatever they did to it
(replicated, or FSDPv2's sharding) and an activation keeps its batch dimension, dim 0, split over them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

import shardtensor as st
from shardtensor.mesh import Mesh
from shardtensor.sharding import PartitionSpec
from shardtensor.tensor_parallel.placements import Partial, Placement, Replicate, Shard, placements_to_spec

# Set on the parameters a tensor-parallel plan placed: FSDPv2 adds its own axis to these
# (fsdp/wrapper.py) instead of leaving them alone as it does other parameters that carry a sharding.
_PLACED_BY_PLAN = "_shardtensor_tensor_parallel"


def is_tensor_parallel(parameter: torch.Tensor) -> bool:
    """True when ``parameter`` was placed by ``st.parallelize_module`` (a tensor-parallel style).

    Example::

        st.parallelize_module(model, mesh, {"fc1": st.ColwiseParallel()})
        st.tensor_parallel.is_tensor_parallel(model.fc1.weight)   # True
    """
    return getattr(parameter, _PLACED_BY_PLAN, False) is True


def mark_tensor_parallel(parameter: torch.Tensor) -> None:
    """Record ``parameter`` as placed by a tensor-parallel plan (``is_tensor_parallel`` is then True).

    Example: ``mark_tensor_parallel(new_param)`` after re-sharding a planned parameter.
    """
    setattr(parameter, _PLACED_BY_PLAN, True)


@dataclasses.dataclass(frozen=True)
class TensorParallelMesh:
    """A mesh and the one axis of it that tensor-parallel placements speak of.

    Example: ``TensorParallelMesh.of(st.init_device_mesh("cpu", (4, 2), mesh_dim_names=("fsdp", "tp")))``.
    """

    mesh: Mesh
    axis: int  # index of the tensor-parallel axis

    @staticmethod
    def of(mesh: Mesh, tp_axis: str | int | None = None) -> TensorParallelMesh:
        """The tensor-parallel axis: ``tp_axis`` if given, the only axis of a 1-D mesh, else the axis
        named ``"tp"``. Example: ``TensorParallelMesh.of(mesh42, "model")``."""
        names = mesh.axis_names
        if tp_axis is None:
            if len(mesh.mesh_shape) == 1:
                return TensorParallelMesh(mesh, 0)
            if names is not None and "tp" in names:
                return TensorParallelMesh(mesh, names.index("tp"))
            raise ValueError(
                f"parallelize_module on a mesh with {len(mesh.mesh_shape)} axes {dict(mesh.shape())} needs to know "
                "which one is tensor parallel: name it 'tp' or pass tp_axis=<its name>"
            )
        if isinstance(tp_axis, str):
            if names is None or tp_axis not in names:
                raise ValueError(f"tp_axis={tp_axis!r} is not an axis of the mesh {dict(mesh.shape())}")
            return TensorParallelMesh(mesh, names.index(tp_axis))
        if isinstance(tp_axis, bool) or not isinstance(tp_axis, int) or not 0 <= tp_axis < len(mesh.mesh_shape):
            raise ValueError(f"tp_axis={tp_axis!r} is not an axis of the mesh {dict(mesh.shape())}")
        return TensorParallelMesh(mesh, tp_axis)

    @property
    def size(self) -> int:
        """Devices along the tensor-parallel axis. Example: 2 on a ("fsdp", "tp") mesh of (4, 2)."""
        return self.mesh.mesh_shape[self.axis]

    def activation_spec(self, placement: Placement, ndim: int) -> PartitionSpec:
        """The spec of an activation laid out as ``placement`` on the tensor-parallel axis, its batch
        dimension (dim 0) split over every other axis.

        Example: on ("fsdp", "tp"), ``activation_spec(Shard(1), 3) == P("fsdp", "tp", None)``.
        """
        batch: Placement = Shard(0) if ndim > 0 else Replicate()
        placements = [placement if a == self.axis else batch for a in range(len(self.mesh.mesh_shape))]
        return placements_to_spec(placements, self.mesh, ndim)

    def parameter_spec(self, parameter: torch.Tensor, placement: Placement) -> PartitionSpec:
        """The spec of ``parameter`` with ``placement`` on the tensor-parallel axis; what other axes
        already do to it (an FSDPv2 sharding) is kept.

        Example: a (64, 32) weight already ("fsdp", None), ColwiseParallel's ``Shard(0)``:
        ``P(("fsdp", "tp"), None)``.
        """
        placements: list[Placement] = [Replicate() for _ in self.mesh.mesh_shape]
        p = parameter
        if isinstance(p, st.ShardedTensor) and p.partition_spec is not None and p.device_mesh == self.mesh:
            placements = list(p.placements)
        placements[self.axis] = placement
        return placements_to_spec(placements, self.mesh, parameter.dim())


def checked_layouts(layouts, what: str, allow_none: bool = False) -> tuple:
    """``layouts`` (one placement or a sequence) as a tuple, each a Shard or Replicate (None too with
    ``allow_none``). Example: ``checked_layouts(Shard(1), "input_layouts") == (Shard(1),)``."""
    if layouts is None or isinstance(layouts, (Shard, Replicate, Partial)):
        layouts = (layouts,)
    if not isinstance(layouts, Sequence):
        raise TypeError(f"{what} takes placements (st.Shard(dim), st.Replicate()), got {layouts!r}")
    for p in layouts:
        if p is None and allow_none:
            continue
        if isinstance(p, Partial):
            raise ValueError(
                f"{what} cannot hold {p!r}: in shardtensor a module input or output is a whole value (never a "
                "pending partial sum); a row-wise layer's partial sums are resolved by its output_layouts"
            )
        if not isinstance(p, (Shard, Replicate)):
            raise TypeError(f"{what} takes st.Shard(dim) or st.Replicate() placements, got {p!r}")
    return tuple(layouts)


class _Relayout(torch.autograd.Function):
    """Sharding constraints on a value, one after another, and on its gradient in reverse order: a
    layout change the compiler lowers into collectives, in forward and in backward (DTensor's
    ``redistribute`` and its backward)."""

    @staticmethod
    def forward(ctx, x, mesh, specs):
        ctx.mesh, ctx.specs = mesh, specs
        for spec in specs:
            x = st.shard(x, mesh, spec)
        return x

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, st.ShardedTensor):
            for spec in reversed(ctx.specs):
                grad = st.shard(grad, ctx.mesh, spec)
        return grad, None, None


def relayout(x, tp: TensorParallelMesh, layouts: Sequence[Placement], what: str):
    """``x`` constrained to each layout of ``layouts`` in turn (``None`` entries are skipped); its
    gradient goes back through them in reverse. A non-tensor ``x`` is returned as it is.

    Example: ``relayout(h, tp, [Shard(1), Replicate()], "input")`` (an all-gather of the sequence).
    """
    if not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, st.ShardedTensor):
        raise TypeError(
            f"the {what} is a tensor on {x.device}, not on st.device(): tensor-parallel layouts apply to "
            "ShardedTensors (move the module's inputs with st.shard(t, mesh, spec) or t.to(st.device()))"
        )
    specs = tuple(tp.activation_spec(p, x.dim()) for p in layouts if p is not None)
    if not specs:
        return x
    for p in layouts:
        if isinstance(p, Shard) and not -x.dim() <= p.dim < max(x.dim(), 1):
            raise ValueError(f"the {what} has {x.dim()} dimension(s): it cannot be laid out as {p!r}")
    return _Relayout.apply(x, tp.mesh, specs)
