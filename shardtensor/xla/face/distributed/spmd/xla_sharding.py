"""``torch_xla.distributed.spmd.xla_sharding`` under the face: meshes, specs and the annotation calls,
with PyTorch/XLA's rules (re-marking a computed sharded tensor with another spec is an error; a pending
one gets a sharding constraint) on shardtensor's ``Mesh``, ``mark_sharding`` and ``ShardingSpec``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

import shardtensor as st
from shardtensor.xla.face import _support

ShardingType = st.ShardingType
PartitionSpec = st.PartitionSpec
set_global_mesh = st.set_global_mesh
get_global_mesh = st.get_global_mesh


class OpSharding:
    """What ``mesh.get_op_sharding(spec)`` gives: the mesh, the spec and its sharding string
    (``str()``), for a tensor with one dimension per spec entry."""

    def __init__(self, mesh: st.Mesh, partition_spec: tuple) -> None:
        self.mesh = mesh
        self.partition_spec = st.PartitionSpec(*partition_spec)
        rank = types.SimpleNamespace(shape=(1,) * len(self.partition_spec))
        self._text = st.ShardingSpec(mesh, tuple(self.partition_spec)).xla_spec(rank) or "{replicated}"

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"OpSharding({self._text})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpSharding) and str(other) == self._text

    def __hash__(self) -> int:
        return hash(self._text)


class _OpShardings:
    def get_op_sharding(self, partition_spec: tuple, flatten_opsharding: bool = False) -> OpSharding:
        """The sharding of ``partition_spec`` on this mesh (``str()`` is its sharding string).

        Example: ``str(mesh.get_op_sharding(('data', None)))``.
        """
        if isinstance(partition_spec, list):
            raise TypeError("get_op_sharding: give the partition spec as a tuple (it must be hashable), not a list.")
        return OpSharding(self, partition_spec)  # type: ignore[arg-type]

    get_op_sharding_v2 = get_op_sharding


class Mesh(_OpShardings, st.Mesh):
    """PyTorch/XLA's ``Mesh(device_ids, mesh_shape, axis_names=None)``: shardtensor's ``Mesh`` (validated
    as PyTorch/XLA does), plus ``get_op_sharding``."""


class HybridMesh(_OpShardings, st.HybridMesh):
    """PyTorch/XLA's ``HybridMesh(*, ici_mesh_shape, dcn_mesh_shape=None, axis_names=None)``."""


def get_1d_mesh(axis_name: str | None = None) -> Mesh:
    """A mesh of every device on one axis."""
    n = st.global_runtime_device_count()
    return Mesh(np.arange(n), (n,), None if axis_name is None else (axis_name,))


class ShardingSpec(st.ShardingSpec):
    """PyTorch/XLA's ``ShardingSpec(mesh, partition_spec, minibatch=False)``, with ``apply(t)``."""

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """``mark_sharding(t, mesh, partition_spec)``."""
        return mark_sharding(t, self.mesh, self.partition_spec)


def mark_sharding(t: Any, mesh: st.Mesh, partition_spec: tuple) -> Any:
    """Shard ``t`` in place over ``mesh`` as ``partition_spec`` says and return it (``st.mark_sharding``;
    a module marks each parameter of the spec's rank). As in PyTorch/XLA: a pending tensor (an
    intermediate result) gets a sharding constraint; a computed tensor moves to the new layout, unless
    it already holds another non-replicated sharding, which is a RuntimeError ("Existing annotation must
    be cleared first": ``clear_sharding(t)``, or ``annotate_custom_sharding``). shardtensor always runs
    SPMD, so this works before ``xr.use_spmd()`` too."""
    if isinstance(t, st.ShardedTensor) and not t.pending and t.partition_spec is not None:
        wanted = st.ShardingSpec(mesh, tuple(partition_spec)).xla_spec(t)
        current = t.sharding_spec
        if wanted is not None and wanted != current and t.sharding_type != st.ShardingType.REPLICATED:
            raise RuntimeError(
                f"Existing annotation must be cleared first: the tensor is sharded {current} and the new spec "
                f"{tuple(partition_spec)} gives {wanted}. Call xs.clear_sharding(t) first, or "
                "xs.annotate_custom_sharding(t, mesh, spec) to constrain it without moving it."
            )
    return st.mark_sharding(t, mesh, partition_spec)


def clear_sharding(t: torch.Tensor) -> torch.Tensor:
    """Drop ``t``'s sharding annotation, in place; returns ``t``."""
    return st.clear_sharding(t)


def annotate_custom_sharding(t: torch.Tensor, mesh: st.Mesh, partition_spec: tuple) -> torch.Tensor:
    """Constrain ``t`` to a sharding in the program, even when it already has one: its value is
    recomputed under the new layout at the next run (an already sharded tensor keeps its identity)."""
    if isinstance(t, st.ShardedTensor) and not t.pending:
        with torch.no_grad():
            t.data = t.detach().clone()
    return st.mark_sharding(t, mesh, partition_spec)


def wrap_if_sharded(x: Any) -> Any:
    """``x``: a tensor on the device is its own sharded view under shardtensor."""
    return x


def wrap_as_sharded_tensor(t: torch.Tensor, mesh_shape: Any = None, partition_spec: Any = None) -> torch.Tensor:
    """``t`` itself (a ShardedTensor is PyTorch/XLA's XLAShardedTensor and its global tensor at once)."""
    if not isinstance(t, st.ShardedTensor):
        raise TypeError(f"wrap_as_sharded_tensor needs a tensor on torch_xla.device(), got one on {t.device}.")
    return t


def unwrap_sharded_tensor(t: Any) -> Any:
    return t


class MarkShardingFunction(torch.autograd.Function):
    """``y = MarkShardingFunction.apply(t, mesh, spec)``: a copy of ``t`` sharded as ``spec``, whose
    gradient is sharded the same way in backward."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, mesh: st.Mesh, partition_spec: tuple) -> torch.Tensor:
        ctx.mesh, ctx.partition_spec = mesh, partition_spec
        return st.mark_sharding(t.clone(), mesh, partition_spec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return st.mark_sharding(grad.clone(), ctx.mesh, ctx.partition_spec), None, None


def mark_sharding_with_gradients(t: torch.Tensor, mesh: st.Mesh, partition_spec: tuple) -> torch.Tensor:
    """Out of place: a copy of ``t`` sharded as ``partition_spec``, whose gradient gets the same sharding."""
    return MarkShardingFunction.apply(t, mesh, partition_spec)


class XLAPatchedLinear:
    """``XLAPatchedLinear.apply(input, weight, bias=None)``: ``F.linear`` as an einsum, which keeps the
    leading dimensions (and their sharding) as they are."""

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.einsum("...n,mn->...m", input, weight)
        return out if bias is None else out + bias


def xla_patched_nn_linear_forward(m: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return XLAPatchedLinear.apply(input, m.weight, m.bias)


def apply_xla_patch_to_nn_linear(
    module: nn.Module,
    patched_function: Callable[[nn.Linear, torch.Tensor], torch.Tensor] = xla_patched_nn_linear_forward,
) -> nn.Module:
    """Make every ``nn.Linear`` of ``module`` compute with ``patched_function`` (the einsum linear)."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            sub.forward = types.MethodType(patched_function, sub)  # type: ignore[method-assign]
    return module


def apply_backward_optimization_barrier(m: nn.Module) -> None:
    """An XLA optimization barrier over each backward of ``m``'s gradients (input gradients, after the
    parameters' gradients), so XLA does not merge work across modules' backward passes."""
    from shardtensor.fsdp import optimization_barrier

    def hook(module: nn.Module, grad_input: tuple, grad_output: tuple) -> tuple:
        present = [g for g in grad_input if isinstance(g, st.ShardedTensor)]
        if not present:
            return grad_input
        after = [p.grad for p in module.parameters() if isinstance(p.grad, st.ShardedTensor)]
        fenced = iter(optimization_barrier(present, after=after))
        return tuple(next(fenced) if isinstance(g, st.ShardedTensor) else g for g in grad_input)

    m.register_full_backward_hook(hook)


_MANUAL = (
    "manual sharding regions are written as a function under shardtensor: st.shard_map(fn, mesh, in_specs, "
    "out_specs) runs fn on each device's block (local shapes), with st.manual.all_reduce / all_gather / "
    "reduce_scatter inside"
)
enable_manual_sharding = _support.unsupported("torch_xla.distributed.spmd.enable_manual_sharding", _MANUAL)
disable_manual_sharding = _support.unsupported("torch_xla.distributed.spmd.disable_manual_sharding", _MANUAL)
_mark_manual_sharding = _support.unsupported("torch_xla.distributed.spmd._mark_manual_sharding", _MANUAL)
shard_as = _support.unsupported(
    "torch_xla.distributed.spmd.shard_as",
    "JAX's shard_alike is not exposed; mark both tensors with the same mesh and spec (mark_sharding)",
)
