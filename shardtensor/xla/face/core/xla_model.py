"""``torch_xla.core.xla_model`` (``xm``) under the face: devices and ordinals, ``mark_step`` and step
closures, ``RateTracker``, ``master_print``, collectives and ``optimizer_step`` across processes, saving,
with PyTorch/XLA's signatures and SPMD answers.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch

import shardtensor as st
from shardtensor.xla.face import _support
from shardtensor.xla.face import runtime as xr

REDUCE_SUM = st.REDUCE_SUM
REDUCE_MUL = st.REDUCE_MUL
REDUCE_AND = st.REDUCE_AND
REDUCE_OR = st.REDUCE_OR
REDUCE_MIN = st.REDUCE_MIN
REDUCE_MAX = st.REDUCE_MAX

all_reduce = st.all_reduce
all_gather = st.all_gather
reduce_scatter = st.reduce_scatter
all_to_all = st.all_to_all
collective_permute = st.collective_permute
rendezvous = st.rendezvous
mesh_reduce = st.mesh_reduce
reduce_gradients = st.reduce_gradients
add_step_closure = _support.add_step_closure


# --------------------------------------------------------------------------- devices and ordinals


def xla_device(n: int | None = None, devkind: str | None = None) -> torch.device:
    """PyTorch/XLA's older name of ``torch_xla.device()``: ``st.device()``."""
    return st.device()


def xla_devices() -> list:
    """Every physical device of the job (``st.xla_devices()``), e.g. for ``Mesh(xm.xla_devices(), (8,))``."""
    return st.xla_devices()


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, st.ShardedTensor)


def get_xla_supported_devices(max_devices: int | None = None) -> list[str]:
    """The devices of this process as strings: one logical device in SPMD mode."""
    return [str(st.device())]


def xla_real_devices(devices: Sequence[Any] | None = None) -> list[str]:
    """The physical device behind each given device (``['CPU:0']`` for the logical device); all of
    this process's physical devices when ``devices`` is None."""
    import shardtensor.xla.face as torch_xla

    real = torch_xla.real_devices()
    if devices is None:
        return real
    return [real[0] for _ in devices]


def xla_device_hw(device: str | torch.device) -> str:
    """The hardware of the device: ``'CPU'``, ``'TPU'`` or ``'CUDA'``."""
    _support.as_st_device(device)
    return str(xr.device_type())


def xla_device_kind(device: str | torch.device | None = None) -> str:
    """The device kind PJRT reports (``'cpu'``, ``'TPU v5 lite'`` ...)."""
    _support.as_st_device(device)
    return str(st.global_runtime_device_attributes()[0]["device_kind"])


def xla_replication_devices(local_devices: Sequence[Any] | None = None) -> list[str]:
    """The physical devices a replicated computation spans: every device of the job."""
    return [str(a["name"]) for a in st.global_runtime_device_attributes()]


def get_local_ordinal() -> int:
    return xr.local_ordinal()


def get_ordinal() -> int:
    return xr.global_ordinal()


def xrt_world_size() -> int:
    return xr.world_size()


def is_master_ordinal(local: bool = True) -> bool:
    """True for the first (local or global) ordinal: always in SPMD mode; process 0 otherwise."""
    return (xr.local_ordinal() if local else xr.global_ordinal()) == 0


def master_print(*args: Any, fd: Any = sys.stdout, local: bool = False, flush: bool = False) -> None:
    """``print`` on the master ordinal only."""
    if is_master_ordinal(local=local):
        print(*args, file=fd, flush=flush)


# --------------------------------------------------------------------------- steps


def mark_step(wait: bool = False, reset_scope: bool = True) -> None:
    """PyTorch/XLA's older name of ``torch_xla.sync()``: run what is pending, then the step closures."""
    _support.sync(wait)


def wait_device_ops(devices: Sequence[str] = ()) -> None:
    """Wait until the devices have finished (what is still pending is run first, then waited for)."""
    st.sync(wait=True)


def unlazy(tensors: Sequence[torch.Tensor]) -> None:
    """Compute the given tensors now (with everything else pending)."""
    st.sync(wait=True)


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    barrier: bool = False,
    optimizer_args: dict | None = None,
    groups: Sequence[Sequence[int]] | None = None,
    pin_layout: bool = True,
) -> Any:
    """Reduce the gradients over the processes, then ``optimizer.step()`` (``st.optimizer_step``);
    ``barrier=True`` then runs the step."""
    return st.optimizer_step(
        optimizer, barrier=barrier, optimizer_args=optimizer_args, groups=groups, pin_layout=pin_layout
    )


class RateTracker:
    """Samples per second: ``rate()`` since the previous call (smoothed), ``global_rate()`` since
    creation. ``smooth_factor`` (default ``RATE_TRACKER_SMOOTHING`` or 0.4) weighs the previous rate."""

    def __init__(self, smooth_factor: float | None = None) -> None:
        if smooth_factor is None:
            import os

            smooth_factor = float(os.environ.get("RATE_TRACKER_SMOOTHING", 0.4))
        self._smooth_factor = smooth_factor
        self._start = self._last = time.time()
        self._total = 0.0
        self._since_last = 0.0
        self._rate: float | None = None

    def add(self, count: float) -> None:
        self._total += count
        self._since_last += count

    def rate(self) -> float:
        now = time.time()
        elapsed = now - self._last
        if elapsed <= 0:
            return 0.0
        current = self._since_last / elapsed
        if self._rate is not None:
            current = (1 - self._smooth_factor) * current + self._smooth_factor * self._rate
        self._rate, self._last, self._since_last = current, now, 0.0
        return current

    def global_rate(self) -> float:
        elapsed = time.time() - self._start
        return self._total / elapsed if elapsed > 0 else 0.0


# --------------------------------------------------------------------------- data and state


def send_cpu_data_to_device(datas: Any, device: str | torch.device, input_sharding: Any = None) -> Any:
    """Upload every CPU tensor of ``datas`` (a tensor, which gives a list of one, or nested lists,
    tuples and dicts) to the device, sharded by ``input_sharding`` (a ShardingSpec) where its rank
    fits, replicated elsewhere."""
    _support.as_st_device(device)
    if input_sharding is not None and input_sharding.minibatch:
        raise NotImplementedError(
            "send_cpu_data_to_device with a minibatch ShardingSpec: use "
            "torch_xla.distributed.parallel_loader.MpDeviceLoader, which assembles the global batch."
        )

    def upload(t: Any) -> Any:
        if type(t) is not torch.Tensor or t.device.type != "cpu":
            return t
        if input_sharding is not None and input_sharding.can_apply(t):
            return st.shard(t, input_sharding.mesh, input_sharding.partition_spec)
        return t.to(st.device())

    if type(datas) is torch.Tensor:
        datas = [datas]
    return torch.utils._pytree.tree_map(upload, datas)


def save(data: Any, file_or_path: Any, master_only: bool = True, global_master: bool = False) -> None:
    """``torch.save`` of ``data`` with its tensors on the host (``st.save``), by the master only."""
    st.save(data, file_or_path, master_only=master_only or global_master)


def set_rng_state(seed: int, device: Any = None) -> None:
    """Seed the device's random numbers (``st.manual_seed``)."""
    _support.as_st_device(device)
    st.manual_seed(int(seed))


@contextlib.contextmanager
def fork_rng(device: Any = None, enabled: bool = True) -> Iterator[None]:
    """Random numbers drawn inside the block leave the device's generator as it was."""
    _support.as_st_device(device)
    with torch.random.fork_rng(device_type=st.device().type, enabled=enabled):
        yield


def get_memory_info(device: Any = None) -> dict[str, int]:
    """``{'bytes_used', 'bytes_limit', 'peak_bytes_used'}`` of the first device, where the platform
    reports them (TPU, GPU); the CPU platform reports none and this raises."""
    _support.as_st_device(device)
    stats = st.xla_devices()[0].memory_stats()
    if not stats:
        raise NotImplementedError(
            "xm.get_memory_info(): the CPU platform reports no device memory (its devices share the host's RAM)."
        )
    return {
        "bytes_used": int(stats.get("bytes_in_use", 0)),
        "bytes_limit": int(stats.get("bytes_limit", 0)),
        "peak_bytes_used": int(stats.get("peak_bytes_in_use", 0)),
    }


def optimization_barrier_(tensors: list[torch.Tensor]) -> None:
    """Put the tensors behind an XLA optimization barrier, in place (each keeps its value)."""
    from shardtensor.fsdp import optimization_barrier

    for t, fenced in zip(tensors, optimization_barrier(tensors)):
        t.data = fenced


def broadcast_master_param(model: torch.nn.Module) -> None:
    """Give every process the parameters of process 0 (one process: they are already the only copy)."""
    if st.process_count() == 1:
        return
    with torch.no_grad():
        for p in model.parameters():
            mine = p if st.process_index() == 0 else torch.zeros_like(p)
            p.copy_(cast(torch.Tensor, st.all_reduce(REDUCE_SUM, mine)))


_UNAVAILABLE = {
    "get_stablehlo": "use st.export(fn, *args).mlir_text() for a function's StableHLO",
    "get_stablehlo_bytecode": "use st.export(fn, *args).serialize()",
    "get_rng_state": "shardtensor's generator is a JAX key, not a seed: read torch.random.get_rng_state-like "
    "state with torch.shardtensor.get_rng_state()",
    "set_replication": "replication is SPMD sharding under shardtensor (mark_sharding / FSDPv2)",
    "all_gather_bucketized": "use xm.all_gather on each tensor",
    "reduce_scatter_bucketized": "use xm.reduce_scatter on each tensor",
    "all_reduce_bucketized_gradients": "use xm.reduce_gradients(optimizer)",
    "collective_broadcast": "use xm.all_reduce of the source's values and zeros elsewhere",
    "send": "point-to-point channels are not supported; use xm.collective_permute",
    "recv": "point-to-point channels are not supported; use xm.collective_permute",
    "do_on_ordinals": "run the code where xr.global_ordinal() matches, then xm.rendezvous(tag)",
    "ToXlaTensorArena": "use send_cpu_data_to_device",
}
for _name, _why in _UNAVAILABLE.items():
    globals()[_name] = _support.unsupported(f"torch_xla.core.xla_model.{_name}", _why)
del _name, _why
