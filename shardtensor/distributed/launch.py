"""`launch`: run ``fn(index, *args)`` in several processes that form one JAX job on this host.

The parent starts the processes (``spawn``), each joins the job through
`shardtensor.runtime.initialize_distributed` on a free local port and calls ``fn``; the parent
collects the return values, or raises the first failure with its process index and traceback
after stopping the other processes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax

import shardtensor.runtime as rt

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# Not passed on: the parent's job (torchrun's, a launch around this one) is not the children's.
_NOT_INHERITED = (
    rt.AUTO_DISTRIBUTED_ENV,
    rt.COORDINATOR_PORT_ENV,
    "JAX_COORDINATOR_ADDRESS",
    "JAX_LOCAL_DEVICE_IDS",
    "TORCHELASTIC_USE_AGENT_STORE",  # under torchrun: env:// would join the agent's store, not the children's
)


class LaunchError(RuntimeError):
    """A process of a `launch` failed: it raised (``traceback`` is its traceback text, and the
    exception, if it could be pickled, is the ``__cause__``), or it died (``exitcode`` < 0 is the
    signal). ``index`` is the process's index; ``others`` says how each other process ended, and
    ``exitcodes`` lists every process's exit code (-9 for one that `launch` stopped)."""

    def __init__(self, message: str, index: int, traceback: str | None, others: dict, exitcodes: list):
        super().__init__(message)
        self.index, self.traceback, self.others, self.exitcodes = index, traceback, others, exitcodes
        self.exitcode = exitcodes[index]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_devices_per_process(nprocs: int, devices_per_process: int | None) -> int:
    if devices_per_process is not None:
        if not isinstance(devices_per_process, int) or devices_per_process < 1:
            raise ValueError(f"devices_per_process must be a positive int, got {devices_per_process!r}.")
        return devices_per_process
    total = rt._requested_cpu_device_count()
    if total is None:
        named = re.findall(_DEVICE_COUNT_FLAG + r"=(\d+)", os.environ.get("XLA_FLAGS", ""))
        total = int(named[-1]) if named else nprocs  # JAX's default: one CPU device per process
    if total % nprocs:
        raise ValueError(
            f"launch(nprocs={nprocs}): the {total} simulated CPU devices ({rt.CPU_DEVICES_ENV}) do not split "
            f"evenly over {nprocs} processes. Choose nprocs dividing {total}, or pass devices_per_process."
        )
    return total // nprocs


@contextlib.contextmanager
def _child_environment(cpu_devices: int, nprocs: int, store_port: int):
    """os.environ as the children start with it (a spawned child inherits it), put back afterwards:
    torchrun's variables too (RANK and LOCAL_RANK are set per child), so that
    ``dist.init_process_group("shardtensor")`` (env://) works as under torchrun."""
    saved = dict(os.environ)
    try:
        for name in _NOT_INHERITED:
            os.environ.pop(name, None)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store_port),
            WORLD_SIZE=str(nprocs),
            LOCAL_WORLD_SIZE=str(nprocs),
        )
        os.environ[rt.CPU_DEVICES_ENV] = str(cpu_devices)
        os.environ[rt.LAUNCH_DEVICES_ENV] = f"{cpu_devices} {nprocs}"
        flags = re.sub(_DEVICE_COUNT_FLAG + r"=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_COUNT_FLAG}={cpu_devices}"])
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _run_child(index, nprocs, address, local_device_ids, connection, fn, args) -> None:
    """In a child: join the job, run fn, send ("ok", value) or ("error", (text, traceback, exception))."""
    try:
        rt.initialize_distributed(address, nprocs, index, local_device_ids, hosted_elsewhere=True)
        value = fn(index, *args)
        try:
            message = ("ok", pickle.dumps(value))
        except Exception as e:  # noqa: BLE001 — reported below as the process's error
            raise TypeError(
                f"launch: the return value of {getattr(fn, '__qualname__', fn)!r} in process {index} cannot be "
                f"pickled back to the parent ({type(e).__name__}: {e}). Return plain data (numbers, lists, "
                "CPU tensors)."
            ) from e
    except BaseException as e:  # noqa: BLE001 — every failure goes to the parent, then this process ends
        try:
            exception = pickle.dumps(e)
        except Exception:  # noqa: BLE001 — unpicklable: the text and traceback still go
            exception = None
        connection.send(("error", (f"{type(e).__name__}: {e}", traceback.format_exc(), exception)))
        connection.close()
        # leave the job now instead of waiting for the others at exit: the parent stops them
        with contextlib.suppress(Exception):
            jax.distributed.shutdown()
        sys.exit(1)
    connection.send(message)
    connection.close()


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "was still running and was stopped"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"died from {name}"
    return f"ended with exit code {exitcode} without a result"


def _root_failure(failures: list, ended: dict) -> int:
    """The failure to report: the first process killed by a signal from outside (not SIGABRT, which
    a runtime raises itself, e.g. after a peer died), else the first failure seen. A killed process's
    peers fail in their next collective, and that error can reach the parent before the death does.

    Example: ``_root_failure([1, 0], {0: -9})`` is 0 (process 1's error came first, from the kill).
    """
    for index in failures:
        code = ended.get(index)
        if code is not None and code < 0 and -code != signal.SIGABRT:
            return index
    return failures[0]


def _stop(processes: Sequence) -> None:
    """SIGKILL to those still running. (Not SIGTERM: in a process of a JAX job it only tells JAX's
    preemption notifier, which keeps running.)"""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join()


def launch(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int | None = None,
    start_method: str = "spawn",
    devices_per_process: int | None = None,
    grace_period: float = 1.0,
) -> list:
    """Run ``fn(index, *args)`` in ``nprocs`` processes of one multi-process job on this host and
    return the list of their return values, by index (torch_xla.launch's use, with the results).

    Each process joins the job (`shardtensor.runtime.initialize_distributed`, on a free local port)
    before ``fn`` runs, so ``fn`` sees ``st.process_count() == nprocs`` and every process's devices
    (a ``Mesh`` over ``range(global_runtime_device_count())`` spans them all), and torchrun's variables
    (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) are
    set, so ``torch.distributed.init_process_group("shardtensor")`` works there. ``fn`` and ``args``
    are pickled (``fn`` must be importable: a module-level function), and so are the return values.

    Devices: ``nprocs=None`` is one process (shardtensor is SPMD: one process drives all devices of
    a host; more processes simulate more hosts). On CPU each process gets ``devices_per_process``
    simulated devices, by default ``SHARDTENSOR_CPU_DEVICES // nprocs`` (8 devices, 2 processes:
    4 each). On GPU, ``devices_per_process`` (default 1) GPUs each, process ``i`` getting GPUs
    ``i*k .. i*k+k-1``. On TPU run one process per host (``nprocs=None``): libtpu gives it the
    host's chips.

    Failures: when a process raises, ``launch`` raises `LaunchError` with that process's index and
    traceback (the exception, if picklable, is its ``__cause__``); when one dies (a signal, an exit
    without a result), `LaunchError` says how. The other processes get ``grace_period`` seconds to
    end by themselves, then SIGKILL: ``launch`` returns within ``grace_period`` s of the first
    failure (and the time to reap the processes). A process blocked in a collective on a dead peer
    raises once ``SHARDTENSOR_COLLECTIVE_TIMEOUT`` expires (see `initialize_distributed`).

    Example::

        def work(index, n):
            mesh = st.Mesh(range(st.global_runtime_device_count()), (st.global_runtime_device_count(),))
            x = st.shard(torch.arange(n * 1.0), mesh, (0,))
            return (x * 2).sum().item()

        if __name__ == "__main__":
            st.launch(work, args=(8,), nprocs=2)   # [56.0, 56.0]
    """
    if start_method != "spawn":
        raise ValueError(
            f"launch(start_method={start_method!r}): only 'spawn' is supported. Each process needs its own "
            "device set-up before JAX starts, and a forked (or forkserver) process inherits its parent's."
        )
    nprocs = 1 if nprocs is None else nprocs
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"launch: nprocs must be a positive int or None, got {nprocs!r}.")
    if not isinstance(args, tuple):
        raise TypeError(f"launch: args must be a tuple (fn is called as fn(index, *args)), got {type(args).__name__}.")
    cpu_devices = _cpu_devices_per_process(nprocs, devices_per_process)
    gpus = devices_per_process or 1
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    # The parent hosts JAX's coordination service: the job then outlives any of its processes,
    # process 0 included (hosted there, its death would abort the others).
    service = rt.start_coordination_service(port, nprocs)
    address = f"127.0.0.1:{port}"
    store_port = _free_port()  # torch.distributed's store (MASTER_PORT), taken while JAX's service listens
    processes, connections = [], []
    try:
        with _child_environment(cpu_devices, nprocs, store_port):
            for index in range(nprocs):
                os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(index)
                receiver, sender = context.Pipe(duplex=False)
                local_ids = list(range(index * gpus, (index + 1) * gpus))
                process = context.Process(
                    target=_run_child,
                    args=(index, nprocs, address, local_ids, sender, fn, args),
                    name=f"shardtensor-launch-{index}",
                )
                process.start()
                sender.close()
                processes.append(process)
                connections.append(receiver)
        return _collect(processes, connections, grace_period)
    finally:
        _stop(processes)
        service.shutdown()


def _collect(processes: list, connections: list, grace_period: float) -> list:
    """The return values, by index; or, at the first failure, the others' grace period, then a
    LaunchError for the root failure (``_root_failure``)."""
    results: dict[int, Any] = {}
    errors: dict[int, tuple] = {}  # index -> (text, traceback, pickled exception)
    ended: dict[int, int | None] = {}  # index -> exit code, once it ended
    failures: list[int] = []  # indices, in the order the failures were seen
    waiting = {c: i for i, c in enumerate(connections)} | {p.sentinel: i for i, p in enumerate(processes)}
    deadline = None
    while waiting and (deadline is None or time.monotonic() < deadline):
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait(list(waiting), timeout)
        # messages before deaths: a process sends its result, then ends
        for handle in sorted(ready, key=lambda h: not isinstance(h, multiprocessing.connection.Connection)):
            index = waiting.pop(handle)
            if isinstance(handle, multiprocessing.connection.Connection):
                try:
                    kind, payload = handle.recv()
                except EOFError:  # ended without a word: the sentinel tells how
                    continue
                if kind == "ok":
                    results[index] = pickle.loads(payload)
                else:
                    errors[index] = payload
                    failures.append(index)
            else:
                processes[index].join()
                ended[index] = processes[index].exitcode
                if index not in results and index not in errors:
                    failures.append(index)
        if failures and deadline is None:
            deadline = time.monotonic() + grace_period
    if not failures:
        return [results[i] for i in range(len(processes))]
    _stop(processes)
    first = _root_failure(failures, ended)
    others = {}
    for i in range(len(processes)):
        if i == first:
            continue
        if i in errors:
            others[i] = f"raised {errors[i][0]}"
        elif i in results:
            others[i] = "returned"
        else:
            others[i] = _how_it_ended(ended.get(i))
    summary = "; ".join(f"process {i} {what}" for i, what in others.items())
    if first in errors:
        text, remote_traceback, exception = errors[first]
        message = f"process {first} of {len(processes)} raised {text}\n\n{remote_traceback}"
        cause = _unpickled(exception)
    else:
        message = f"process {first} of {len(processes)} {_how_it_ended(ended[first])}"
        remote_traceback, cause = None, None
    if summary:
        message += f"\n(the others: {summary}.)"
    exitcodes = [p.exitcode for p in processes]
    raise LaunchError(message, first, remote_traceback, others, exitcodes) from cause


def _unpickled(data: bytes | None) -> BaseException | None:
    if data is None:
        return None
    try:
        exception = pickle.loads(data)
    except Exception:  # noqa: BLE001 — an exception class the parent cannot import: the text is enough
        return None
    return exception if isinstance(exception, BaseException) else None
