"""Refusing a program that cannot fit in device memory before it runs (and donates anything).

A program that runs out of memory while it executes fails asynchronously, after its donated inputs
(parameters, optimizer state) are consumed, and on a mesh the devices that did not fail wait forever
for the ones that did. So each compiled program's per-device need is read once from XLA's memory
analysis (arguments, outputs, temporaries, minus outputs that reuse donated inputs) and checked
against the memory available before every call:

- a configured limit per device (``SHARDTENSOR_DEVICE_MEMORY`` or ``set_device_memory_limit``):
  the program's whole need (arguments included) must fit in it;
- else the device's own statistics (GPU, TPU): what the program allocates must fit in what is free;
- else (CPU devices, which share the host's RAM): what it allocates on all this host's devices must
  fit in the host's available RAM and under the process's address-space limit (``ulimit -v``).
"""

from __future__ import annotations

import os
import re
import resource

import torch

from shardtensor.runtime import environ_setting

ENV = "SHARDTENSOR_DEVICE_MEMORY"
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SKIP_FRACTION = 0.05  # needs below this share of the memory are not worth a query of what is free


class OutOfDeviceMemoryError(torch.OutOfMemoryError):
    """A program needs more device memory than is available; it was not run."""


class ProgramMemory:
    """Per-device bytes one compiled program needs (from ``compiled.memory_analysis()``)."""

    __slots__ = ("arguments", "devices", "outputs", "platform", "reused", "small_on_host", "temporaries")

    def __init__(self, analysis, mesh):
        self.arguments = analysis.argument_size_in_bytes
        self.outputs = analysis.output_size_in_bytes
        self.temporaries = analysis.temp_size_in_bytes
        self.reused = analysis.alias_size_in_bytes  # outputs written into donated inputs
        self.devices = list(mesh.local_devices)
        self.platform = self.devices[0].platform
        # CPU devices without memory statistics, needing a small share of the host's RAM: only an
        # address-space limit (ulimit -v) can refuse it (set by the first check)
        self.small_on_host = False

    @property
    def allocated(self) -> int:
        """What running it allocates on each device beyond its inputs."""
        return max(self.outputs + self.temporaries - self.reused, 0)

    @property
    def peak(self) -> int:
        """What it holds on each device while it runs, its inputs included."""
        return self.arguments + self.allocated

    def describe(self) -> str:
        return (
            f"{_size(self.peak)} per device (arguments {_size(self.arguments)} + outputs "
            f"{_size(self.outputs)} + temporaries {_size(self.temporaries)} - {_size(self.reused)} "
            f"written into donated inputs)"
        )


def analyse(compiled, mesh):
    """The ``ProgramMemory`` of a compiled program, or None when XLA gives no analysis."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001  (a backend without the analysis: nothing to check against)
        return None
    return None if analysis is None else ProgramMemory(analysis, mesh)


_configured: list = [None]  # bytes set by set_device_memory_limit (None: the environment decides)
# (read before every run: parsed again only when it changed)
_FROM_ENV = environ_setting(lambda text: parse_size(text) if text else None, ENV)


def set_device_memory_limit(limit: int | str | None) -> None:
    """Refuse programs that need more than ``limit`` per device (bytes, or a string such as "2GiB").

    ``None`` goes back to ``SHARDTENSOR_DEVICE_MEMORY``, or when that is unset to what the devices
    (or, for CPU devices, the host) have free.

    Example::

        st.set_device_memory_limit("12GiB")   # e.g. leave room for another process on the GPU
    """
    _configured[0] = None if limit is None else parse_size(limit)


def device_memory_limit() -> int | None:
    """The configured limit per device in bytes, or None when the devices' free memory decides."""
    if _configured[0] is not None:
        return _configured[0]
    return _FROM_ENV()


def parse_size(value) -> int:
    """Bytes from an int or a string like "512MB", "2GiB", "1e9". Example: ``parse_size("1KiB") == 1024``."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = m and _UNITS.get(m.group(2).lower())
        if m is None or unit is None:
            raise ValueError(
                f"{ENV} / set_device_memory_limit: cannot read {value!r} as a size; "
                "write bytes or a number with a unit, e.g. 512MB or 2GiB"
            )
        size = int(float(m.group(1)) * unit)
    if size <= 0:
        raise ValueError(f"device memory limit must be positive, got {value!r}")
    return size


def check(memory, what: str) -> None:
    """Raise ``OutOfDeviceMemoryError`` if the program of ``memory`` cannot fit now (``what``: the
    program, for the message). Cheap when it clearly fits."""
    if memory is None:  # no analysis (a backend without one)
        return
    limit = device_memory_limit()
    if limit is not None:
        if memory.peak > limit:
            _refuse(memory, what, f"the limit of {_size(limit)} per device ({ENV} / st.set_device_memory_limit)")
        return
    if memory.small_on_host and resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY:
        return  # (what the CPU path below finds every time for such a program, found once)
    device = memory.devices[0]
    total = _DEVICE_TOTAL.get(device)
    if total is not None and memory.allocated <= _SKIP_FRACTION * total:
        return  # small next to the device's memory: not worth querying what is free
    stats = None if device in _NO_STATS else _device_stats(device)
    if stats is None:
        _NO_STATS.add(device)
    else:
        total, in_use = stats
        _DEVICE_TOTAL[device] = total
        if memory.allocated > _SKIP_FRACTION * total and memory.allocated > total - in_use:
            _refuse(memory, what, f"{_size(total - in_use)} free on device {device}")
        return
    if memory.platform == "cpu":
        needed = memory.allocated * len(memory.devices)  # simulated CPU devices share the host's RAM
        memory.small_on_host = bool(_HOST_TOTAL) and needed <= _SKIP_FRACTION * _HOST_TOTAL
        free, where = _host_free(needed)
        if needed > free:
            _refuse(
                memory,
                what,
                f"{_size(free)} {where} for {len(memory.devices)} CPU device(s) needing {_size(needed)} in all",
            )


def available_in_all(devices) -> tuple[int | float, str]:
    """(bytes free on all ``devices`` together, where that number comes from): what the configured
    limit allows, else what the devices report free, else (CPU devices) what the host has available;
    ``inf`` when nothing says. For a buffer that must fit even when spread over every device.

    Example::

        free, where = available_in_all(jax.local_devices())
    """
    devices = list(devices)
    limit = device_memory_limit()
    if limit is not None:
        return limit * len(devices), f"the limit of {_size(limit)} per device x {len(devices)} device(s) ({ENV})"
    stats = [_device_stats(d) for d in devices]
    if stats and all(s is not None for s in stats):
        return sum(total - used for total, used in stats), f"free on {len(devices)} device(s)"
    free, where = _host_free(float("inf"))
    return free, f"{where} on the host"


def _refuse(memory, what, available):
    raise OutOfDeviceMemoryError(
        f"{what} needs {memory.describe()}, more than {available}. It was not run: every tensor it "
        "would have overwritten (parameters, optimizer state) keeps its value, the tensors it would have "
        "computed raise this error when read. Use a smaller batch, shard the largest tensors over more "
        f"devices, or set {ENV} (or st.set_device_memory_limit) if the limit is wrong."
    )


_DEVICE_TOTAL: dict = {}  # device -> its bytes limit, once seen
_NO_STATS: set = set()  # devices without memory statistics (CPU)


def _device_stats(device):
    """(bytes limit, bytes in use) of an accelerator, or None (CPU devices have no statistics)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001  (not every PJRT plugin implements it)
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"], stats.get("bytes_in_use", 0)


_HOST_TOTAL = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0


def _host_free(needed):
    """(bytes the host can still give this process, where that number comes from)."""
    free, where = float("inf"), "available"
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    unlimited = soft == resource.RLIM_INFINITY
    if unlimited and _HOST_TOTAL and needed <= _SKIP_FRACTION * _HOST_TOTAL:
        return free, where  # small next to the host's RAM: not worth reading /proc each step
    if not unlimited:  # (a `ulimit -v` can be far below the host's RAM: always checked)
        free, where = soft - _address_space_used(), "left under the address-space limit (ulimit -v)"
    available = _mem_available()
    if available is not None and available < free:
        free, where = available, "of host RAM available"
    return free, where


def _address_space_used() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _mem_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux: no cheap way to know; the program runs and may fail
        return None
    return None


def format_size(n) -> str:
    """Bytes as people read them. Example: ``format_size(3 * 2**30) == "3.0 GiB"``."""
    return _size(n)


def _size(n) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
