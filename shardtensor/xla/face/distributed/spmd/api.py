"""``torch_xla.distributed.spmd.api`` under the face: the DTensor bridge (``xla_distribute_tensor``,
``xla_distribute_module``, ``convert_to_xla_mesh``) on shardtensor's DTensor words."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import shardtensor as st
from shardtensor.xla.face import _support
from shardtensor.xla.face.distributed.spmd.xla_sharding import Mesh


def convert_to_xla_mesh(dt_mesh: Any) -> st.Mesh:
    """A mesh of PyTorch/XLA's kind from a DTensor ``DeviceMesh`` (its device ids, shape and dimension
    names); a shardtensor mesh is returned as it is."""
    if isinstance(dt_mesh, st.Mesh):
        return dt_mesh
    ids = np.asarray(dt_mesh.mesh.tolist() if hasattr(dt_mesh.mesh, "tolist") else dt_mesh.mesh)
    names = getattr(dt_mesh, "mesh_dim_names", None)
    return Mesh(ids.reshape(-1), tuple(ids.shape), tuple(names) if names else None)


def xla_distribute_tensor(tensor: torch.Tensor, device_mesh: Any = None, placements: Sequence | None = None) -> Any:
    """``st.distribute_tensor`` on the mesh (a DTensor ``DeviceMesh`` is converted)."""
    mesh = None if device_mesh is None else convert_to_xla_mesh(device_mesh)
    return st.distribute_tensor(tensor, mesh, placements)


def xla_distribute_module(
    module: nn.Module,
    device_mesh: Any = None,
    partition_fn: Callable[[str, nn.Module, Any], None] | None = None,
    input_fn: Callable[..., Any] | None = None,
    output_fn: Callable[..., Any] | None = None,
) -> nn.Module:
    """DTensor's ``distribute_module``: ``partition_fn(name, submodule, mesh)`` for every submodule
    (default: the parameters replicated on the device), ``input_fn(inputs, mesh)`` /
    ``output_fn(outputs, mesh)`` around ``forward``."""
    mesh = convert_to_xla_mesh(device_mesh) if device_mesh is not None else st.get_global_mesh()
    module.to(st.device())
    if partition_fn is not None:
        for name, sub in module.named_modules():
            partition_fn(name, sub, mesh)
    if input_fn is not None:
        module.register_forward_pre_hook(lambda m, inputs: input_fn(inputs, mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda m, inputs, outputs: output_fn(outputs, mesh))
    return module


auto_policy = _support.unsupported(
    "torch_xla.distributed.spmd.auto_policy",
    "XLA auto-sharding is not supported; give shardings with mark_sharding, FSDPv2 or st.parallelize_module",
)
