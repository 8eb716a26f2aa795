"""``load_state_dict`` into an FSDPv2-wrapped module: the parameters stay sharded, and a failed load
changes nothing.

FSDPv2 registers ``keep_sharding_on_load`` as a load-state-dict pre-hook of the module it wraps, so
it runs whether the wrapper or the wrapped module is loaded into. Plain ``load_state_dict``
(``assign=False``) already copies a CPU value straight into the parameter's shards; the hook adds two
things torch does not do for a sharded module:

- ``assign=True`` replaces each parameter by the state dict's tensor (torch keeps *its* device and
  dtype). A CPU value would make a sharded parameter a CPU one, which no FSDPv2 user wants: it is
  sent to the devices with the old parameter's mesh and spec instead (its dtype kept, as torch).
- torch loads every key it can and reports a shape mismatch only at the end, so a wrong checkpoint
  leaves the module half overwritten. When any value's shape does not match, the hook points every
  other key at the module's current tensor, so torch raises its own error and nothing changes.
"""

from __future__ import annotations

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
    targets = {prefix + name: t for name, t in module.named_parameters()}
    targets.update({prefix + name: t for name, t in module.named_buffers()})
    if any(_mismatched(targets[key], value) for key, value in state_dict.items() if key in targets):
        for key, target in targets.items():
            if key in state_dict and not _mismatched(target, state_dict[key]):
                state_dict[key] = target.detach()  # loading a tensor into itself changes nothing
        return
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    for name, param in module.named_parameters():
        value = state_dict.get(prefix + name)
        if (
            isinstance(param, st.ShardedTensor)
            and param.mesh is not None
            and param.partition_spec is not None
            and isinstance(value, torch.Tensor)
            and value.device.type == "cpu"
        ):
            state_dict[prefix + name] = st.shard(value.detach(), param.mesh, param.partition_spec)


def _mismatched(target: torch.Tensor, value: Any) -> bool:
    """Whether torch will refuse ``value`` for ``target`` for its shape (it accepts a 1-element 1-d
    value for a 0-d target, from old checkpoints)."""
    if not isinstance(value, torch.Tensor):
        return False
    if target.dim() == 0 and value.shape == (1,):
        return False
    return value.shape != target.shape
