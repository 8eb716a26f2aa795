"""State dicts and pickles of an FSDPv2-wrapped module keep its parameters sharded; a failed
``load_state_dict`` changes nothing.

``torch.save`` of a whole FSDPv2 model writes each parameter as a plain CPU ``nn.Parameter`` (so the
file holds no jax object) and the wrapper's pickled state records their meshes and specs
(``parameter_layouts``); ``torch.load`` puts them back on the devices (``restore_parameter_layouts``).

FSDPv2 registers ``keep_sharding_on_load`` as a load-state-dict pre-hook of the module it wraps, so
it runs whether the wrapper or the wrapped module is loaded into. Plain ``load_state_dict``
(``assign=False``) already copies a CPU value straight into the parameter's shards; the hook adds two
things torch does not do for a sharded module:

- ``assign=True`` replaces each parameter by the state dict's tensor (torch keeps *its* device and
  dtype). A CPU value would make a sharded parameter a CPU one, which no FSDPv2 user wants: it is
  sent to the devices with the old parameter's mesh and spec instead (its dtype kept, as torch); a
  buffer on the devices stays there.
- torch loads every key it can and reports a shape mismatch only at the end, so a wrong checkpoint
  leaves the module half overwritten. When any value's shape does not match, the hook points every
  other key at the module's current tensor, so torch raises its own error and nothing changes.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn

import shardtensor as st


def keep_sharding_on_load(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """``nn.Module.register_load_state_dict_pre_hook`` of a module FSDPv2 wraps (see the module doc).

    Example::

        model = FSDPv2(net, mesh=mesh)
        net.load_state_dict(torch.load("net.pt"), assign=True)
        net.fc.weight.partition_spec   # still PartitionSpec(None, 'fsdp')
    """
    targets: dict[str, torch.Tensor] = {prefix + name: t for name, t in module.named_parameters()}
    targets.update({prefix + name: t for name, t in module.named_buffers()})
    if any(_mismatched(targets[key], value) for key, value in state_dict.items() if key in targets):
        for key, target in targets.items():
            if key in state_dict and not _mismatched(target, state_dict[key]):
                state_dict[key] = target.detach()  # loading a tensor into itself changes nothing
        return
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    for name, target in targets.items():
        value = state_dict.get(name)
        if not (
            isinstance(target, st.ShardedTensor) and isinstance(value, torch.Tensor) and value.device.type == "cpu"
        ):
            continue
        if target.mesh is not None and target.partition_spec is not None:
            state_dict[name] = st.shard(value.detach(), target.mesh, target.partition_spec)
        else:  # a buffer FSDPv2 moved without a sharding (BatchNorm's running stats): to the devices too
            state_dict[name] = value.detach().to(st.device())


def _mismatched(target: torch.Tensor, value: Any) -> bool:
    """Whether torch will refuse ``value`` for ``target`` for its shape (it accepts a 1-element 1-d
    value for a 0-d target, from old checkpoints)."""
    if not isinstance(value, torch.Tensor):
        return False
    if target.dim() == 0 and value.shape == (1,):
        return False
    return value.shape != target.shape


def parameter_layouts(module: nn.Module) -> dict[str, tuple]:
    """Each sharded parameter's mesh and spec as plain data, by name (tied names included), for
    ``FSDPv2.__getstate__``: a pickled ShardedTensor parameter is a plain CPU ``nn.Parameter``.

    Example::

        parameter_layouts(net)["fc.weight"]   # ([0, ..., 7], (8,), ('fsdp',), (None, 'fsdp'))
    """
    layouts = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if isinstance(p, st.ShardedTensor) and p.mesh is not None and p.partition_spec is not None:
            mesh = p.mesh
            layouts[name] = (mesh.device_ids.tolist(), tuple(mesh.mesh_shape), mesh.axis_names, tuple(p.partition_spec))
    return layouts


def restore_parameter_layouts(module: nn.Module, layouts: dict[str, tuple]) -> None:
    """Send the CPU parameters named in ``layouts`` back to the devices with their saved sharding
    (``FSDPv2.__setstate__``); tied parameters stay tied. When a saved mesh cannot be built here
    (another number of devices), the parameters stay CPU ``nn.Parameter``s, with a warning.

    Example::

        restore_parameter_layouts(net, parameter_layouts(net))   # a no-op on a sharded module
    """
    meshes: dict[tuple, st.Mesh] = {}
    for device_ids, mesh_shape, axis_names, _ in layouts.values():
        key = (tuple(device_ids), mesh_shape, axis_names)
        if key not in meshes:
            try:
                meshes[key] = st.Mesh(device_ids, mesh_shape, axis_names)
            except st.MeshError as e:
                warnings.warn(
                    f"FSDPv2: the saved parameters were sharded over a mesh {mesh_shape} {axis_names} of "
                    f"{len(device_ids)} devices, which this process cannot build ({e}); they are loaded as "
                    "CPU nn.Parameters. Wrap the module with FSDPv2 again once such a mesh exists.",
                    stacklevel=3,
                )
                return
    placed: dict[int, nn.Parameter] = {}
    for module_name, sub in module.named_modules(remove_duplicate=False):
        for name, p in list(sub.named_parameters(recurse=False)):
            layout = layouts.get(f"{module_name}.{name}" if module_name else name)
            if layout is None or isinstance(p, st.ShardedTensor):
                continue
            new = placed.get(id(p))
            if new is None:
                device_ids, mesh_shape, axis_names, spec = layout
                mesh = meshes[(tuple(device_ids), mesh_shape, axis_names)]
                new = placed[id(p)] = nn.Parameter(st.shard(p.detach(), mesh, spec), requires_grad=p.requires_grad)
            setattr(sub, name, new)
