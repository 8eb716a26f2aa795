"""The PJRT runtime under shardtensor: platform, simulated CPU devices, device lists, processes.

This is the lowest layer and the only module that configures JAX. Importing it, before JAX is
imported if JAX is not imported yet:

* ``SHARDTENSOR_CPU_DEVICES=N`` asks for N simulated CPU devices (it adds
  ``--xla_force_host_platform_device_count=N`` to ``XLA_FLAGS``);
* ``SHARDTENSOR_PLATFORM`` (``cpu``, ``cuda`` or ``tpu``) chooses the platform; unset, JAX picks;
  PyTorch/XLA's ``PJRT_DEVICE`` (``CPU``, ``CUDA`` or ``GPU``, ``TPU``) is honoured the same way, and
  the two naming different platforms is an error; a platform JAX cannot start raises an error that
  names the variable and the install extra (``pip install 'shardtensor[tpu]'``);
* ``SHARDTENSOR_AUTO_DISTRIBUTED=1`` joins a torchrun job (`initialize_distributed` without arguments).

JAX's 64-bit types are not switched on for the process: shardtensor's own work runs under
`x64_scope` (int64 and float64 stay 64-bit as in torch), and the user's JAX keeps its own setting.

Both variables must be set before JAX starts its backend. Asking for something else after it has
started is an error, never a silent mismatch.

Example::

    # SHARDTENSOR_CPU_DEVICES=8 python train.py
    import shardtensor.runtime as rt
    rt.global_runtime_device_count()     # 8
    rt.global_runtime_device_attributes()[0]['name']   # 'CPU:0'
"""

from __future__ import annotations

import functools
import os
import re
import sys
import warnings

CPU_DEVICES_ENV = "SHARDTENSOR_CPU_DEVICES"
PLATFORM_ENV = "SHARDTENSOR_PLATFORM"
# Set by `shardtensor.launch` for its processes: "<devices per process> <processes>", so that a count
# set again in a process (a spawned process re-runs the main script's top) gets an error that says why.
LAUNCH_DEVICES_ENV = "SHARDTENSOR_LAUNCH_CPU_DEVICES"
PJRT_DEVICE_ENV = "PJRT_DEVICE"  # PyTorch/XLA's platform variable
SPMD_ENVS = ("SHARDTENSOR_USE_SPMD", "XLA_USE_SPMD")

# SHARDTENSOR_PLATFORM value -> (jax_platforms value, jax.default_backend() name).
_PLATFORMS = {"cpu": ("cpu", "cpu"), "cuda": ("cuda", "gpu"), "tpu": ("tpu", "tpu")}
# PJRT_DEVICE value (lower case) -> SHARDTENSOR_PLATFORM value ("GPU" is PyTorch/XLA's older name for CUDA).
_PJRT_DEVICES = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "tpu": "tpu"}
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_HOW_TO_FIX = (
    f"Set {CPU_DEVICES_ENV} / {PLATFORM_ENV} before importing jax or shardtensor "
    "(at the top of the script, in conftest.py, or in the shell), or unset them."
)


# --------------------------------------------------------------------------- start-up


def _requested_cpu_device_count() -> int | None:
    raw = os.environ.get(CPU_DEVICES_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{CPU_DEVICES_ENV} must be a positive integer, got {raw!r}.")
    return int(raw)


def _platform_request() -> tuple[str, str] | None:
    """The platform the environment asks for and the setting that asks, as the user wrote it:
    ``("tpu", "PJRT_DEVICE=TPU")``; None when neither variable is set."""
    raw = os.environ.get(PLATFORM_ENV, "").strip()
    ours = raw.lower() or None
    if ours is not None and ours not in _PLATFORMS:
        raise ValueError(
            f"{PLATFORM_ENV}={ours!r} is not a known platform; use one of "
            f"{', '.join(_PLATFORMS)} (or leave it unset to let JAX pick)."
        )
    pjrt = os.environ.get(PJRT_DEVICE_ENV, "").strip()
    if not pjrt:
        return None if ours is None else (ours, f"{PLATFORM_ENV}={raw}")
    theirs = _PJRT_DEVICES.get(pjrt.lower())
    if theirs is None:
        raise ValueError(
            f"{PJRT_DEVICE_ENV}={pjrt!r} (PyTorch/XLA's platform variable) is not a platform shardtensor runs "
            f"on; use {PJRT_DEVICE_ENV}=TPU, CUDA or CPU, or unset it and set {PLATFORM_ENV}=cpu|cuda|tpu."
        )
    if ours is not None and ours != theirs:
        raise ValueError(
            f"{PLATFORM_ENV}={raw} and {PJRT_DEVICE_ENV}={pjrt} ask for different platforms ({ours} and "
            f"{theirs}); set only {PLATFORM_ENV} (shardtensor's own), or make them agree."
        )
    return (ours, f"{PLATFORM_ENV}={raw}") if ours is not None else (theirs, f"{PJRT_DEVICE_ENV}={pjrt}")


def _add_device_count_flag(count: int) -> None:
    """Put the count into XLA_FLAGS; a different count already there is a conflict."""
    flags = os.environ.get("XLA_FLAGS", "")
    named = re.findall(_DEVICE_COUNT_FLAG + r"=(\d+)", flags)
    if any(int(n) != count for n in named):
        launched = os.environ.get(LAUNCH_DEVICES_ENV, "").split()
        if len(launched) == 2 and launched[0] == named[-1]:
            raise ValueError(_launch_conflict(count, int(launched[0]), int(launched[1])))
        raise ValueError(
            f"{CPU_DEVICES_ENV}={count} conflicts with XLA_FLAGS, which asks for "
            f"{_DEVICE_COUNT_FLAG}={named[-1]}. Set only one of them, or make them agree."
        )
    if not named:
        os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_COUNT_FLAG}={count}".strip()


def _launch_conflict(count: int, per_process: int, nprocs: int) -> str:
    return (
        f"{CPU_DEVICES_ENV}={count} was set again in a process of shardtensor.launch, which gave each of its "
        f"{nprocs} processes {per_process} simulated CPU devices ({per_process * nprocs} in all, split over the "
        f"processes; it passes {_DEVICE_COUNT_FLAG}={per_process} in XLA_FLAGS). A process that launch starts "
        f"re-runs the top of the main script, where an assignment such as "
        f"os.environ[{CPU_DEVICES_ENV!r}] = '{count}' replaces launch's count. Write "
        f"os.environ.setdefault({CPU_DEVICES_ENV!r}, '{count}') instead (or set it inside "
        "`if __name__ == '__main__':`, or in the shell); to choose each process's count, pass "
        "launch(..., devices_per_process=N)."
    )


def _backends_started() -> bool:
    # Only meaningful once jax is imported; importing it here is what the caller wants anyway.
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _check_started_backend(cpu_count: int | None, platform: tuple[str, str] | None) -> None:
    """Raise if the running JAX backend is not what the environment asks for (``platform``: what
    `_platform_request` returns)."""
    import jax

    running = jax.default_backend()
    if platform is not None and _PLATFORMS[platform[0]][1] != running:
        raise RuntimeError(
            f"JAX already started on platform {running!r}, but {platform[1]}. The platform is fixed "
            f"when JAX starts. {_HOW_TO_FIX}"
        )
    if cpu_count is not None and running == "cpu" and jax.local_device_count() != cpu_count:
        launched = os.environ.get(LAUNCH_DEVICES_ENV, "").split()
        if len(launched) == 2 and int(launched[0]) == jax.local_device_count():
            raise RuntimeError(_launch_conflict(cpu_count, int(launched[0]), int(launched[1])))
        raise RuntimeError(
            f"JAX's CPU backend already started with {jax.local_device_count()} device(s), but "
            f"{CPU_DEVICES_ENV}={cpu_count}. The device count is fixed when JAX starts (something "
            f"imported and used jax before shardtensor, or XLA_FLAGS set another "
            f"{_DEVICE_COUNT_FLAG}). {_HOW_TO_FIX}"
        )


def _configure_jax():
    cpu_count = _requested_cpu_device_count()
    platform = _platform_request()
    started = "jax" in sys.modules and _backends_started()
    if cpu_count is not None and not started:
        _add_device_count_flag(cpu_count)  # must precede `import jax` to take effect
    import jax

    if started:
        _check_started_backend(cpu_count, platform)
        return
    # jax may have been imported (not started) before us: its config still takes effect.
    if cpu_count is not None:
        jax.config.update("jax_num_cpu_devices", cpu_count)
    if platform is not None:
        jax.config.update("jax_platforms", _PLATFORMS[platform[0]][0])


_configure_jax()

import jax  # noqa: E402  (configured above)

# --------------------------------------------------------------------------- 64-bit types

# JAX's x64 flag: a process-wide value the user owns, and a per-thread override that shardtensor sets
# around its own work (torch's int64 / float64 need it) and puts back on the way out.
_X64 = jax.enable_x64
_KEEP = object()  # __exit__: the thread already had 64-bit types on, nothing to put back


class x64_scope:
    """JAX's 64-bit types on in the calling thread while shardtensor works, as they were afterwards.

    Every entry where shardtensor creates, traces, compiles, uploads, runs or reads JAX values runs
    under it (a ``with`` block, or `with_x64` as a decorator). The user's own setting
    (``jax.config.update('jax_enable_x64', ...)`` or ``with jax.enable_x64(...)``) is left as it
    was, also when the block raises. Nesting costs one flag read; the setting is per thread, so
    a thread shardtensor starts enters its own scope.

    Example::

        with rt.x64_scope():
            jnp.array(1).dtype   # int64
        jnp.array(1).dtype       # int32 unless the user turned x64 on
    """

    __slots__ = ("_previous",)

    def __enter__(self):
        self._previous = _KEEP if _X64.value else _X64.swap_local(True)
        return self

    def __exit__(self, *exc):
        if self._previous is not _KEEP:
            _X64.set_local(self._previous)
        return False


class x64_off_scope:
    """JAX's 64-bit types off in the calling thread for a block, as they were afterwards: for tracing
    a Pallas kernel inside shardtensor's `x64_scope` (Mosaic, the TPU's kernel compiler, takes only
    32-bit grid indices, index maps and loop counters; under 64-bit types a literal ``0`` in an index
    map is an int64).

    Example::

        with rt.x64_scope():
            with rt.x64_off_scope():
                jnp.array(1).dtype   # int32
    """

    __slots__ = ("_previous",)

    def __enter__(self):
        self._previous = _X64.swap_local(False)
        return self

    def __exit__(self, *exc):
        _X64.set_local(self._previous)
        return False


def with_x64(fn, lock=None):
    """``fn`` running under `x64_scope` (the decorator form, one flag read when already inside).

    With ``lock``, ``fn`` also runs holding it, taken only after checking that this process was not
    forked from one running JAX (`check_not_forked`; the lock may be held by a thread that is gone):
    one wrapper for an engine entry, which runs for every op on a shardtensor tensor.

    Example::

        @with_x64
        def upload(host, sharding): return jax.device_put(host, sharding)
    """
    if lock is not None:
        what = f"use {getattr(fn, '__name__', fn)}()"

        @functools.wraps(fn)
        def run_locked_with_x64(*args, **kwargs):
            if _FORKED_AFTER_START[0]:
                check_not_forked(what)
            with lock:
                if _X64.value:
                    return fn(*args, **kwargs)
                previous = _X64.swap_local(True)
                try:
                    return fn(*args, **kwargs)
                finally:
                    _X64.set_local(previous)

        return run_locked_with_x64

    @functools.wraps(fn)
    def run_with_x64(*args, **kwargs):
        if _X64.value:
            return fn(*args, **kwargs)
        previous = _X64.swap_local(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _X64.set_local(previous)

    return run_with_x64


def environ_reader(*names: str):
    """A function giving the values of the environment variables ``names`` as ``os.environ`` has them
    now (None when unset), in a form meant only to be compared with an earlier answer: equal answers
    mean the same values. For settings read before every run (a frozen replay's): on CPython it reads
    ``os.environ``'s own store, about 20x faster than ``os.environ.get``.

    Example::

        read = environ_reader("XLA_ENABLE_PARAM_ALIASING")
        before = read()
        ...
        if read() != before: ...   # set, changed or unset since
    """
    data = getattr(os.environ, "_data", None)  # (os._Environ: the encoded keys and values it sets)
    encode = getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        environ = os.environ
        return lambda: tuple(map(environ.get, names))
    keys = tuple(map(encode, names))
    return lambda: tuple(map(data.get, keys))


def environ_setting(parse, *names: str):
    """A function giving ``parse(*values)`` of the environment variables ``names`` (None when unset)
    as ``os.environ`` has them now, parsed again only when one of them changed (`environ_reader`):
    for settings read before every run. An error of ``parse`` is raised at each call until fixed.

    Example::

        limit = environ_setting(lambda text: int(text) if text else None, "MY_LIMIT")
        limit()   # None while MY_LIMIT is unset
    """
    read = environ_reader(*names)
    memo: list = [object(), None]  # (the variables as last read, what they meant)

    def current():
        stored = read()
        if stored != memo[0]:
            memo[:] = [stored, parse(*map(os.environ.get, names))]
        return memo[1]

    return current


# --------------------------------------------------------------------------- SPMD mode


def use_spmd(auto: bool = False) -> None:
    """Turn on SPMD mode (one process drives all its devices as one logical device).

    shardtensor always runs SPMD; this call exists for PyTorch/XLA code and makes `is_spmd()`
    true by setting ``SHARDTENSOR_USE_SPMD=1`` and, as PyTorch/XLA's ``use_spmd`` does,
    ``XLA_USE_SPMD=1`` (which scripts and test bases read). XLA auto-sharding (``auto=True``) is not
    supported.

    Example::

        rt.use_spmd()
        rt.is_spmd()   # True
    """
    if auto:
        raise NotImplementedError(
            "use_spmd(auto=True): XLA auto-sharding is not supported by shardtensor; "
            "call use_spmd() and give shardings with mark_sharding / shard."
        )
    for name in SPMD_ENVS:
        os.environ[name] = "1"


def is_spmd() -> bool:
    """Whether SPMD mode was asked for: by `use_spmd()` or ``SHARDTENSOR_USE_SPMD`` / ``XLA_USE_SPMD``.

    Example::

        rt.is_spmd()   # False in a fresh process without the variables
    """
    return any(os.environ.get(name, "").strip().lower() not in ("", "0", "false") for name in SPMD_ENVS)


# --------------------------------------------------------------------------- forked processes

_STARTED_AT_FORK = [False]  # in the parent: whether JAX's backend ran when it last forked
_FORKED_AFTER_START = [False]  # in a child: forked (at any depth) from a process running JAX


def _before_fork() -> None:
    # JAX's backend check takes a lock, so it is read in the parent, before the fork, never in the child.
    _STARTED_AT_FORK[0] = _backends_started()


def _after_fork_in_child() -> None:
    _FORKED_AFTER_START[0] = _FORKED_AFTER_START[0] or _STARTED_AT_FORK[0]


if hasattr(os, "register_at_fork"):  # (Unix) silent: they only note a flag
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def forked_after_start() -> bool:
    """Whether this process was forked from one whose JAX backend had started. JAX's threads do not
    survive a fork, so such a process (a DataLoader worker forked from a training process) cannot
    run JAX: waiting for them would hang. torch asks ``torch.shardtensor._is_in_bad_fork()``, which
    answers this, before seeding the device in such a worker (as for CUDA).

    Example::

        rt.forked_after_start()   # False in the training process; True in its forked workers
    """
    return _FORKED_AFTER_START[0]


def check_not_forked(what: str) -> None:
    """Raise instead of hanging when a process forked after JAX started tries to use it."""
    if _FORKED_AFTER_START[0]:
        raise RuntimeError(
            f"shardtensor cannot {what} in this process: it was forked from a process that was running "
            "JAX (a DataLoader worker, say), and JAX does not survive a fork - it would wait forever. Keep "
            "shardtensor tensors out of worker processes (datasets return CPU tensors; MpDeviceLoader "
            "moves the batches), or start the workers with multiprocessing_context='spawn' "
            "(or 'forkserver')."
        )


# --------------------------------------------------------------------------- devices


@functools.cache
def _global_devices() -> tuple:
    if not _backends_started():
        _configure_jax()  # the variables may have been set after `import shardtensor` (python -m ...)
    try:
        devices = tuple(sorted(jax.devices(), key=lambda d: d.id))
    except (RuntimeError, AssertionError) as e:  # JAX's words name JAX_PLATFORMS, or nothing (cuda)
        request = _platform_request()
        if request is None:
            raise
        raise RuntimeError(_platform_start_failure(request, e)) from e
    # The backend may have been started by someone else after our import: check once.
    _check_started_backend(_requested_cpu_device_count(), _platform_request())
    return devices


def _platform_start_failure(request: tuple[str, str], error: BaseException) -> str:
    """Why the platform the user asked for did not start, in the words of the variable they set."""
    name, setting = request
    variable = setting.split("=")[0]
    why = re.sub(r"\s*\(set JAX_PLATFORMS=[^)]*\)", "", str(error)).strip()
    why = why.splitlines()[0] if why else f"JAX found no backend for {name!r}"
    install = f"pip install 'shardtensor[{name}]'" if name != "cpu" else "pip install --force-reinstall jaxlib"
    return (
        f"{setting} asks for the {name} platform, but it cannot start: {why}. If JAX's runtime for it is "
        f"missing, install it ({install}); or set {variable} to another platform, or unset it to let JAX pick."
    )


@functools.cache
def _ids() -> dict:
    return {d.id: i for i, d in enumerate(_global_devices())}


def device_id(device) -> int:
    """A JAX device's global id in shardtensor (and PyTorch/XLA): its position among all devices of
    every process ordered by JAX's id. It equals JAX's ``device.id`` wherever those run 0..N-1 (one
    process, TPU); multi-process CPU numbers each process's devices from ``2048 * process_index``.

    Example::

        rt.device_id(rt.jax_devices()[3])   # 3
    """
    return _ids()[device.id]


def jax_devices() -> list:
    """All global JAX devices (every process), ordered by device id.

    Example::

        rt.jax_devices()[:2]   # [CpuDevice(id=0), CpuDevice(id=1)]
    """
    return list(_global_devices())


def global_runtime_device_count() -> int:
    """The number of physical devices over all processes.

    Example::

        rt.global_runtime_device_count()   # 8 with SHARDTENSOR_CPU_DEVICES=8
    """
    return len(_global_devices())


def addressable_runtime_device_count() -> int:
    """The number of physical devices attached to this process.

    Example::

        rt.addressable_runtime_device_count()   # 8 on a single host
    """
    _global_devices()
    return jax.local_device_count()


def platform() -> str:
    """The platform JAX runs on: ``'cpu'``, ``'gpu'`` or ``'tpu'``.

    Example::

        rt.platform()   # 'cpu'
    """
    _global_devices()
    return jax.default_backend()


class Float64OnTPUWarning(UserWarning):
    """float64 / complex128 values computed on a TPU, which has no 64-bit float units."""


_WIDE_FLOATS = frozenset({"float64", "complex128"})
_FLOAT64_WARNED = [False]


def _on_tpu() -> bool:
    return platform() == "tpu"


def warn_float64_on_tpu(dtype) -> None:
    """Warn once per process when a float64 or complex128 value (``dtype``: a torch, numpy or jax
    dtype) is made on a TPU: XLA emulates 64-bit floats there with pairs of float32s, so values keep
    float32's exponent range (below about 1e-38 they become 0, above 3e38 inf, and NaN follows)
    where torch's float64 goes to 1e-308 and 1e308.

    Example::

        rt.warn_float64_on_tpu(torch.float64)   # a Float64OnTPUWarning on a TPU, the first time
    """
    name = str(dtype).removeprefix("torch.")
    if name not in _WIDE_FLOATS or _FLOAT64_WARNED[0] or not _on_tpu():
        return
    _FLOAT64_WARNED[0] = True
    warnings.warn(
        f"a {name} value is computed on the TPU, which has no 64-bit float units: XLA emulates {name} "
        "with pairs of float32s, which keep float32's exponent range (values beyond about 1e-38..3e38 "
        "become 0, inf or NaN where torch's float64 reaches 1e-308..1e308). Keep float64 work on the "
        "CPU (.cpu()), or use float32 on the TPU (t.float(), model.float()). (Shown once per process.)",
        Float64OnTPUWarning,
        stacklevel=3,
    )


def device_type() -> str:
    """The platform in PyTorch/XLA's spelling: ``'CPU'``, ``'GPU'`` or ``'TPU'``.

    Example::

        rt.device_type()   # 'CPU'
    """
    return platform().upper()


def _device_attributes(device) -> dict:
    attributes = {
        "name": f"{device.platform.upper()}:{device_id(device)}",
        "id": device_id(device),
        "platform": device.platform,
        "device_kind": device.device_kind,
        "process_index": device.process_index,
    }
    # Only some platforms (TPU) know where a device sits; add what is there.
    for optional in ("slice_index", "coords", "core_on_chip"):
        value = getattr(device, optional, None)
        if value is not None:
            attributes[optional] = list(value) if optional == "coords" else value
    return attributes


def global_runtime_device_attributes() -> list[dict]:
    """One dict per global device, in global order (a fresh list each call).

    Keys: ``name`` (``'CPU:0'``), ``id``, ``platform``, ``device_kind``, ``process_index``, and
    ``slice_index`` / ``coords`` / ``core_on_chip`` where the platform has them.

    Example::

        rt.global_runtime_device_attributes()[3]
        # {'name': 'CPU:3', 'id': 3, 'platform': 'cpu', 'device_kind': 'cpu', 'process_index': 0}
    """
    return [_device_attributes(d) for d in _global_devices()]


def runtime_device_attributes(name: str) -> dict:
    """The attributes of one device, by name (``'CPU:3'``, case-insensitive).

    Example::

        rt.runtime_device_attributes('CPU:3')['id']   # 3
    """
    for attributes in global_runtime_device_attributes():
        if attributes["name"].lower() == str(name).lower():
            return attributes
    known = [d["name"] for d in global_runtime_device_attributes()]
    raise ValueError(f"No device named {name!r}; the devices are {known}.")


# --------------------------------------------------------------------------- processes


def process_index() -> int:
    """This process's index among the processes of a multi-host run (0 on one host).

    Example::

        rt.process_index()   # 0
    """
    return jax.process_index()


def process_count() -> int:
    """How many processes (hosts) take part in the run (1 on one host).

    Example::

        rt.process_count()   # 1
    """
    return jax.process_count()


def devices_by_process() -> list[list]:
    """Every process's devices, one row per process in process order (each row in device-id order):
    the grid that collectives across processes run over.

    Example::

        rt.devices_by_process()   # [[CpuDevice(id=0), CpuDevice(id=1)], [CpuDevice(id=2048), ...]]
    """
    rows: list[list] = [[] for _ in range(process_count())]
    for device in _global_devices():
        rows[device.process_index].append(device)
    return rows


# the persistent compilation cache (its own module; rt.initialize_cache stays)
from shardtensor.runtime.compilation_cache import initialize_cache  # noqa: E402, F401
from shardtensor.runtime.joining import (  # noqa: E402, F401  (after JAX is configured; rt.* names stay)
    AUTO_DISTRIBUTED_ENV,
    COLLECTIVE_TIMEOUT_ENV,
    COORDINATOR_PORT_ENV,
    HEARTBEAT_TIMEOUT_ENV,
    INIT_TIMEOUT_ENV,
    TORCHRUN_ENVS,
    initialize_distributed,
    start_coordination_service,
)

# --------------------------------------------------------------------------- torchrun

# Importing shardtensor under torchrun with SHARDTENSOR_AUTO_DISTRIBUTED=1 joins the job; nothing otherwise.
_AUTO = os.environ.get(AUTO_DISTRIBUTED_ENV, "").strip().lower() not in ("", "0", "false")
if _AUTO and not jax.distributed.is_initialized():
    initialize_distributed()
