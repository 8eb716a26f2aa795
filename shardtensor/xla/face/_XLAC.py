"""``torch_xla._XLAC`` under the face: the few private functions of PyTorch/XLA's C++ binding that user
code and tests reach for (a tensor's sharding string and type, its debug info, the HLO of pending
tensors, the metrics report). Every other ``_XLAC`` name raises an AttributeError that says so.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

import shardtensor as st
from shardtensor.xla.face import _support


def _sharded(t: Any, what: str) -> st.ShardedTensor:
    if not isinstance(t, st.ShardedTensor):
        device = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise RuntimeError(f"torch_xla._XLAC.{what} needs an XLA tensor (on torch_xla.device()); got {device}.")
    return t


def _get_xla_sharding_spec(t: torch.Tensor) -> str:
    """The tensor's sharding string, e.g. ``'{devices=[4,2]0,1,2,3,4,5,6,7}'``; ``''`` when it has none."""
    return _sharded(t, "_get_xla_sharding_spec").sharding_spec


def _get_xla_sharding_type(t: torch.Tensor) -> int | None:
    """The tensor's ShardingType as an int, or None when it has no sharding."""
    kind = _sharded(t, "_get_xla_sharding_type").sharding_type
    return None if kind is None else int(kind)


def _get_xla_tensor_debug_info(t: torch.Tensor) -> str:
    """What the tensor is: its shape and dtype, whether its value is computed or pending (PyTorch/XLA's
    "IR"), its sharding and number of shards."""
    x = _sharded(t, "_get_xla_tensor_debug_info")
    lines = ["XLATensor {", f"TensorID: {id(x)}", f"Device: {st.device()}", f"XLA Shape: {x.dtype}{list(x.shape)}"]
    if x.pending:
        lines.append("IR: pending (recorded, not computed yet)")
        lines.append("XLAData: None")
    else:
        lines.append("IR: None")
        lines.append("XLAShardedData" if x.sharding_type not in (None, st.ShardingType.REPLICATED) else "XLAData")
        lines.append("  Data Device: SPMD:0")
    spec = x.sharding_spec
    lines.append(f"  OpSharding: {spec or 'None'}")
    lines.append(f"  NumShards: {st.global_runtime_device_count() if spec else 1}")
    lines.append(f"ShardingSpec: {x.partition_spec}")
    lines.append("}")
    return "\n".join(lines)


def _get_xla_tensors_hlo(tensors: Sequence[torch.Tensor]) -> str:
    """The HLO text of the program that computes ``tensors`` (``st.explain(...).hlo``: the program as
    XLA compiled it, after partitioning, where PyTorch/XLA shows it before optimisation)."""
    return st.explain([_sharded(t, "_get_xla_tensors_hlo") for t in tensors]).hlo


def _get_xla_tensors_text(tensors: Sequence[torch.Tensor]) -> str:
    """The program computing ``tensors``, with its shardings and collectives (``str(st.explain(...))``)."""
    return str(st.explain([_sharded(t, "_get_xla_tensors_text") for t in tensors]))


def _get_graph_hash(tensors: Sequence[torch.Tensor]) -> bytes:
    """A hash of the program that computes ``tensors`` (of its compiled text)."""
    return hashlib.sha256(_get_xla_tensors_hlo(tensors).encode()).digest()


def _xla_metrics_report() -> str:
    return st.metrics_report()


def _xla_get_auto_sharding() -> bool:
    """Whether XLA auto-sharding is on: never under shardtensor (``use_spmd(auto=True)`` raises)."""
    return False


def _xla_get_default_device() -> str:
    return "xla:0"


def _xla_real_devices(devices: Sequence[str] | None = None) -> list[str]:
    import shardtensor.xla.face as torch_xla

    return torch_xla.real_devices()


def _xla_get_devices() -> list[str]:
    return ["xla:0"]


def _xla_step_marker(device: str = "", devices: Sequence[str] = (), wait: bool = False, **_: Any) -> None:
    st.sync(wait=wait)


def _xla_wait_device_ops(devices: Sequence[str] = ()) -> None:
    st.sync(wait=True)


def _xla_sync_multi(tensors: Sequence[torch.Tensor], devices: Sequence[str] = (), wait: bool = True, **_: Any) -> None:
    st.sync(wait=wait)


def _get_use_eager_mode() -> bool:
    return st.is_eager_mode()


def _set_use_eager_mode(enable: bool) -> None:
    st.eager_mode(bool(enable))


_MANUAL = (
    "manual sharding regions are written as a function under shardtensor: st.shard_map(fn, mesh, in_specs, "
    "out_specs) runs fn on each device's block, with st.manual.all_reduce / reduce_scatter / all_gather inside"
)
_PREEMPTION = "preemption is handled by CheckpointManager(chkpt_on_preemption=True): manager.reached_preemption(step)"
_REASONS = {
    "_spmd_full_to_shard_shape": _MANUAL,
    "_spmd_shard_to_full_shape": _MANUAL,
    "_xla_spmd_all_reduce": _MANUAL,
    "_xla_spmd_reduce_scatter": _MANUAL,
    "_xla_spmd_all_gather": _MANUAL,
    "_mark_manual_sharding": _MANUAL,
    "_global_tensor_from_cpu_shards": "build the global tensor on the host and st.shard(t, mesh, spec) it",
    "_xla_mark_sharding": "use torch_xla.distributed.spmd.mark_sharding(t, mesh, partition_spec)",
    "_xla_increment_counter": "shardtensor's counters are its own (torch_xla.debug.metrics reads them)",
    "OpSharding": "use mesh.get_op_sharding(partition_spec) of a torch_xla.distributed.spmd.Mesh",
    "_sync_point_reached": _PREEMPTION,
    "_activate_preemption_sync_manager": _PREEMPTION,
    "_deactivate_preemption_sync_manager": _PREEMPTION,
    "_ensure_xla_coordinator_initialized": "shardtensor's processes meet through "
    "shardtensor.runtime.initialize_distributed (jax.distributed)",
}
__getattr__ = _support.module_getattr(
    "torch_xla._XLAC",
    _REASONS,
    default="it is a private binding of PyTorch/XLA's C++ runtime; shardtensor's public API "
    "(import shardtensor as st) may have what you need",
)
