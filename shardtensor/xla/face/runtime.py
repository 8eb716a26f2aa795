"""``torch_xla.runtime`` (``xr``) under the face: SPMD mode, device counts and attributes, processes,
the compilation cache, with PyTorch/XLA's SPMD answers (one logical device per process: ``world_size()``,
``global_device_count()`` ... are 1; the ``*_runtime_*`` counts are the physical devices).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import shardtensor as st
from shardtensor.xla.face import _support

R = TypeVar("R")

_DEVICE_TYPES = {"cpu": "CPU", "tpu": "TPU", "gpu": "CUDA", "cuda": "CUDA"}


def use_spmd(auto: bool | None = False) -> None:
    """Turn on SPMD mode: sets ``XLA_USE_SPMD=1`` (as PyTorch/XLA does). shardtensor always runs one
    process over all its devices, so tensors made before stay valid. ``auto=True`` (XLA
    auto-sharding) raises NotImplementedError."""
    st.use_spmd(auto=bool(auto))


def is_spmd() -> bool:
    """Whether SPMD mode is on (``XLA_USE_SPMD`` / ``SHARDTENSOR_USE_SPMD``)."""
    return st.is_spmd()


def device_type() -> str | None:
    """The platform in PyTorch/XLA's words: ``'CPU'``, ``'TPU'`` or ``'CUDA'``."""
    platform = st.global_runtime_device_attributes()[0]["platform"]
    return _DEVICE_TYPES.get(platform, platform.upper())


def set_device_type(pjrt_device: str) -> None:
    """The platform is the one shardtensor started on (``PJRT_DEVICE`` / ``SHARDTENSOR_PLATFORM``, read
    when the devices start): the same is accepted, another raises RuntimeError, as PyTorch/XLA does
    once its runtime is initialized. Choose the platform with ``PJRT_DEVICE=TPU`` in the environment."""
    wanted = pjrt_device.upper()
    current = device_type()
    if wanted != current and not (wanted == "GPU" and current == "CUDA"):
        raise RuntimeError(
            f"Can't change device type to {wanted} after the runtime is initialized (it runs {current}); "
            "set PJRT_DEVICE before starting the script."
        )


def is_bf16_supported() -> bool:
    """bfloat16 runs on every platform shardtensor uses (XLA's CPU emulates it)."""
    return True


def using_pjrt() -> bool:
    return True


def requires_pjrt(fn: Callable[..., R]) -> Callable[..., R]:
    """PyTorch/XLA's decorator for PJRT-only functions: shardtensor always runs on PJRT."""
    return fn


def global_runtime_device_count() -> int:
    """The physical devices of all processes."""
    return st.global_runtime_device_count()


def addressable_runtime_device_count() -> int:
    """The physical devices this process drives."""
    return st.addressable_runtime_device_count()


def world_size() -> int:
    """1 in SPMD mode (one logical device); else the number of processes (one logical device each)."""
    return 1 if st.is_spmd() else st.process_count()


def global_device_count() -> int:
    """1 in SPMD mode; else the number of processes."""
    return world_size()


def addressable_device_count() -> int:
    """1: each process drives its devices as one logical device."""
    return 1


def local_device_count() -> int:
    """1: each process drives its devices as one logical device."""
    return 1


def global_ordinal() -> int:
    """0 in SPMD mode; else this process's index."""
    return 0 if st.is_spmd() else st.process_index()


def local_ordinal() -> int:
    """0: each process has one logical device."""
    return 0


def process_index() -> int:
    return st.process_index()


def process_count() -> int:
    return st.process_count()


def host_index() -> int:
    """This host's index (one process per host under shardtensor's SPMD)."""
    return st.process_index()


def local_process_count() -> int:
    """Processes on this host: 1 for a single process; a job of several cannot tell without a launcher."""
    if st.process_count() == 1:
        return 1
    value = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun's
    if value is None:
        raise NotImplementedError(
            "torch_xla.runtime.local_process_count(): shardtensor does not know how many of the job's "
            "processes share this host; start them with torchrun (LOCAL_WORLD_SIZE) or count them yourself."
        )
    return int(value)


def runtime_device_attributes(device: str) -> dict[str, object]:
    """One device's attributes (``'CPU:3'`` or ``'TPU:0'``)."""
    return st.runtime_device_attributes(device)


def global_runtime_device_attributes() -> list[dict[str, object]]:
    """Each device's attributes (``name``, ``coords``, ``slice_index`` where the platform has them), in
    global order."""
    return st.global_runtime_device_attributes()


def initialize_cache(path: str, readonly: bool = False) -> None:
    """The persistent compilation cache (``st.initialize_cache``)."""
    st.initialize_cache(path, readonly=readonly)


def get_num_cached_compilation_graph() -> int:
    """Programs compiled and kept in memory."""
    compiled = st.counter_value("UncachedCompile") or 0
    return max(0, compiled - (st.counter_value("ExecutableCacheEvictions") or 0))


def save(data: Any, path: str, master_only: bool = True) -> None:
    """Save a state dict with its tensors copied to the host (``st.save``: plain ``torch.save`` files)."""
    st.save(data, path, master_only=master_only)


get_master_ip = _support.unsupported(
    "torch_xla.runtime.get_master_ip",
    "it asks the TPU metadata server for the coordinator; shardtensor's processes meet through "
    "shardtensor.runtime.initialize_distributed(coordinator_address, ...)",
)
