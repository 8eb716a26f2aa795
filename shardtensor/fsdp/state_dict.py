"""State dicts and pickles of an FSDPv2-wrapped module keep its parameters sharded and its names;
a failed ``load_state_dict`` changes nothing.

The state dict of an FSDPv2 wrapper has the wrapped module's keys (``fc.weight``, not
``_orig_module.fc.weight``), as ``torch.distributed.fsdp``'s full state dict does, so a checkpoint of a
wrapped model — ``Trainer.save_model``, ``save_pretrained``, ``accelerator.save_state`` — loads into the
plain model and the plain model's checkpoint loads into the wrapper. ``drop_wrapper_prefix`` (a
state-dict post-hook of the wrapper) drops the prefix; ``add_wrapper_prefix`` (a load pre-hook) puts it
back for torch's loading, which walks the real module tree, and accepts keys that already carry it.
Parameter names (``named_parameters``) keep the prefix.

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

WRAPPED = "_orig_module"  # the attribute FSDPv2 keeps the wrapped module in: a segment of real names


def state_dict_name(name: str) -> str:
    """``name`` (a parameter or module name inside FSDPv2 wrappers) as it appears in state dicts.

    Example::

        state_dict_name("_orig_module.layers.0._orig_module.fc.weight")   # 'layers.0.fc.weight'
    """
    return ".".join(part for part in name.split(".") if part != WRAPPED)


def drop_wrapper_prefix(wrapper: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict) -> None:
    """``nn.Module.register_state_dict_post_hook`` of an FSDPv2 wrapper: its keys without ``_orig_module.``.

    The wrapper holds nothing but the wrapped module, so its keys are the last ones in ``state_dict``
    and renaming them in order keeps the order. The module versions in ``state_dict._metadata`` are
    copied under the names without the prefix too (the old names stay, for loading into a wrapper).

    Example::

        FSDPv2(nn.Linear(4, 4)).state_dict().keys()   # odict_keys(['weight', 'bias'])
    """
    inner = f"{prefix}{WRAPPED}."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [k for k in metadata if k == inner[:-1] or k.startswith(inner)]:
            metadata[(prefix + key[len(inner) :]).rstrip(".")] = metadata[key]


def add_wrapper_prefix(
    wrapper: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """``nn.Module.register_load_state_dict_pre_hook`` of an FSDPv2 wrapper: its keys get ``_orig_module.``
    back, so torch finds them in the wrapped module (a key that already has it is left as is).

    Example::

        FSDPv2(net).load_state_dict(net_cpu.state_dict())   # the plain module's keys load
    """
    inner = f"{prefix}{WRAPPED}."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


def name_keys_as_state_dict(wrapper: nn.Module, incompatible_keys) -> None:
    """``nn.Module.register_load_state_dict_post_hook`` of an FSDPv2 wrapper: missing and unexpected keys
    are reported as the state dict names them (without ``_orig_module.``).

    Example::

        FSDPv2(net).load_state_dict({}, strict=False).missing_keys   # ['fc.weight', 'fc.bias']
    """
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [state_dict_name(k) for k in keys]


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
    # keys of FSDPv2 wrappers nested inside: their own pre-hooks rename them only when torch reaches
    # them, after this module's other keys are loaded; renamed here so the checks below see them
    for name in targets:
        short = prefix + state_dict_name(name[len(prefix) :])
        if short != name and short in state_dict and name not in state_dict:
            state_dict[name] = state_dict.pop(short)
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
