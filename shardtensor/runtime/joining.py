"""Joining a multi-process job: ``initialize_distributed`` (explicit arguments or torchrun's
environment), where JAX's coordination service runs (a process of its own that process 0 starts, or
``st.launch``'s parent), and how a job that cannot form or that loses a process fails (a Python
exception within a stated time, not an abort or a hang).

Example::

    import shardtensor.runtime as rt
    rt.initialize_distributed("10.0.0.1:1234", num_processes=2, process_id=0)
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
import warnings

import jax

from shardtensor.runtime.service_process import ServiceProcess, connect_watcher, wait_to_leave

# torchrun's variables; its own store (c10d) listens on MASTER_PORT, so JAX's coordinator takes another.
TORCHRUN_ENVS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
COORDINATOR_PORT_ENV = "SHARDTENSOR_COORDINATOR_PORT"
AUTO_DISTRIBUTED_ENV = "SHARDTENSOR_AUTO_DISTRIBUTED"
COLLECTIVE_TIMEOUT_ENV = "SHARDTENSOR_COLLECTIVE_TIMEOUT"
HEARTBEAT_TIMEOUT_ENV = "SHARDTENSOR_HEARTBEAT_TIMEOUT"
INIT_TIMEOUT_ENV = "SHARDTENSOR_INIT_TIMEOUT"
_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"
_DEFAULT_COLLECTIVE_TIMEOUT = 600  # seconds: torch's default for a process group's collectives
# seconds: a process silent for this long counts as dead (JAX's default, 100, keeps a survivor waiting at exit)
_DEFAULT_HEARTBEAT_TIMEOUT = 30
# seconds: how long joining waits for the coordinator and every process (JAX's default, 300, then aborts)
_DEFAULT_INIT_TIMEOUT = 60
# process 0 publishes here where its service process listens for the processes ('' when it started none)
_WATCH_KEY = "shardtensor/service_watch"
# process 0's service process, and this process's connection to it: both live as long as the process
_service_process: ServiceProcess | None = None
_watcher: socket.socket | None = None


def _positive_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}.")
    return int(raw)


def collective_timeout() -> int:
    """Seconds a process of a job waits for the others in a collective: ``SHARDTENSOR_COLLECTIVE_TIMEOUT``,
    by default 600 (torch's default for a process group).

    Example::

        rt.joining.collective_timeout()   # 600
    """
    return _positive_env(COLLECTIVE_TIMEOUT_ENV, _DEFAULT_COLLECTIVE_TIMEOUT)


def _torchrun_arguments() -> tuple[str, int, int, list[int] | None]:
    """(coordinator address, number of processes, process id, local device ids) from torchrun's
    variables; the coordinator listens on MASTER_PORT + 1 unless SHARDTENSOR_COORDINATOR_PORT says."""
    missing = [name for name in TORCHRUN_ENVS if not os.environ.get(name, "").strip()]
    if missing:
        raise RuntimeError(
            "initialize_distributed() without arguments reads torchrun's environment, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. Start the script with "
            "`torchrun --nproc-per-node N script.py` (or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE), "
            "or pass coordinator_address, num_processes and process_id."
        )
    try:
        port = int(os.environ.get(COORDINATOR_PORT_ENV, "").strip() or int(os.environ["MASTER_PORT"]) + 1)
        world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError as e:
        raise ValueError(
            f"torchrun's variables must be integers (MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, "
            f"{COORDINATOR_PORT_ENV}): {e}"
        ) from None
    # Several processes on one host: each drives one GPU (torchrun's convention); JAX ignores it on CPU.
    local_ids = [local_rank] if local_world_size > 1 else None
    return f"{os.environ['MASTER_ADDR'].strip()}:{port}", world_size, rank, local_ids


def _set_collective_timeout() -> None:
    """A CPU collective waiting for a dead peer fails after SHARDTENSOR_COLLECTIVE_TIMEOUT seconds (an
    XLA flag, read when the backend starts) instead of waiting forever; a value in XLA_FLAGS wins."""
    seconds = _positive_env(COLLECTIVE_TIMEOUT_ENV, _DEFAULT_COLLECTIVE_TIMEOUT)
    flags = os.environ.get("XLA_FLAGS", "")
    if _COLLECTIVE_TIMEOUT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_COLLECTIVE_TIMEOUT_FLAG}={seconds}".strip()


def _leave_together(seconds: float) -> None:
    """At exit: wait (up to ``seconds``) for the live processes, then leave the job, so that no
    process leaves while another still runs its last collectives with it. (The coordination service
    runs in another process: process 0's service process, or `launch`'s parent.)

    JAX's own shutdown barrier does this, but it is off for recoverable tasks (see
    `initialize_distributed`). A dead process is left out at once by process 0's service process
    (its connection closed), or, with the service hosted elsewhere, once the service misses its
    heartbeats.
    """
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:  # the user shut it down already
        return
    if _watcher is not None:
        wait_to_leave(_watcher, seconds)
    else:
        _wait_for_live_processes(client, jax_distributed.global_state.num_processes, seconds)
    _leave(jax_distributed.global_state)


def _wait_for_live_processes(client, num_processes: int, seconds: float) -> None:
    """GetAliveTasks returns once every live process asked (a dead one is left out once its
    heartbeats are missed); it has no timeout of its own, hence the thread."""

    def ask() -> None:
        # an error means the service went away: nobody left to wait for
        with contextlib.suppress(Exception):
            client.get_live_nodes(list(range(num_processes)))

    waiter = threading.Thread(target=ask, daemon=True)
    waiter.start()
    waiter.join(seconds)


def _leave(state) -> None:
    """``jax.distributed.shutdown()``, the client first. After a SIGTERM (torchrun sends one to the
    others when a process dies) JAX's preemption sync manager waits at a barrier of every process,
    a dead one included, for minutes, and its shutdown waits for that; leaving the job cancels the
    barrier."""
    client, state.client = state.client, None  # forgotten even if leaving fails
    if client is not None:
        client.shutdown()
    jax.distributed.shutdown()  # the preemption sync manager


def _report_join_failure(status) -> None:
    """Never called: jaxlib cannot hand its status to Python, so calling it raises (std::bad_cast).
    During ``connect`` that exception reaches Python instead of JAX's default, a fatal log (SIGABRT).
    After joining it changes only the message of an abort that comes either way (the coordination
    service gone): "terminate called after throwing ... std::bad_cast"."""


class _JaxlibForJoining:
    """jaxlib's module as ``jax.distributed.initialize`` sees it in `initialize_distributed`: its
    client reports a failed join as a Python exception, and process 0 starts the coordination
    service, with JAX's arguments, in a process of its own (`ServiceProcess`; it waits ``linger``
    seconds for a process that never comes), or, with ``hosted_elsewhere`` (`launch`'s parent hosts
    it), none. JAX has no option for either; to JAX, process 0 hosts no service."""

    def __init__(self, jaxlib_module, hosted_elsewhere: bool, linger: float):
        self._jaxlib, self._hosted_elsewhere, self._linger = jaxlib_module, hosted_elsewhere, linger

    def __getattr__(self, name):
        return getattr(self._jaxlib, name)

    def get_distributed_runtime_service(self, bind_address, num_processes, **options):
        global _service_process
        from jax._src import distributed as jax_distributed

        # joined already: JAX raises its own "only once" right after this
        if not self._hosted_elsewhere and jax_distributed.global_state.client is None:
            _service_process = ServiceProcess.start(bind_address, num_processes, options, self._linger)
        return None

    def get_distributed_runtime_client(self, *args, **kwargs):
        return self._jaxlib.get_distributed_runtime_client(
            *args, missed_heartbeat_callback=_report_join_failure, **kwargs
        )


def _forget_failed_join(state) -> None:
    """After a failed join: no client, no service, so the process can exit (or try again) cleanly."""
    global _service_process
    state.client = None
    if _service_process is not None:
        _service_process.stop()
        _service_process = None


def _watch_service(client, coordinator_address: str, process_id: int, seconds: int) -> None:
    """Connect to process 0's service process (process 0 says where), so that it knows when this
    process ends: it outlives every process of the job, and at exit does not wait for a dead one."""
    global _watcher
    if process_id == 0:
        where = "" if _service_process is None else _service_process.watch_address()
        client.key_value_set(_WATCH_KEY, where)
    else:
        where = client.blocking_key_value_get(_WATCH_KEY, seconds * 1000)
    if not where:
        return  # hosted elsewhere (`launch`'s parent)
    host = coordinator_address.rpartition(":")[0]
    try:
        _watcher = connect_watcher(host, where, process_id)
    except OSError as e:
        warnings.warn(
            f"initialize_distributed: process {process_id} cannot reach process 0's coordination service process "
            f"at {host}, port {where.split()[0]} ({e}): that process may end before this one, and JAX then aborts "
            "this one. Let the processes reach that port of process 0's host.",
            RuntimeWarning,
            stacklevel=3,
        )


def _listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


def _join_error(address: str, num_processes: int, process_id: int, seconds: int) -> TimeoutError:
    """What went wrong when joining failed: nobody listens at the address, or someone does and the
    job never became whole (a process missing, or the processes disagree on their number)."""
    head = (
        f"initialize_distributed: process {process_id} of {num_processes} could not join the job at "
        f"{address} within {seconds} s ({INIT_TIMEOUT_ENV} or initialization_timeout=). "
    )
    if not _listening(address):
        return TimeoutError(
            head + f"No coordinator answers at {address}: start process 0 (it hosts JAX's coordinator; "
            "with torchrun, MASTER_ADDR:MASTER_PORT+1), or fix the address and port."
        )
    return TimeoutError(
        head + f"The coordinator answers, but not all processes joined: one was not started, or the "
        f"processes were started with different numbers of processes (num_processes / WORLD_SIZE; this "
        f"one says {num_processes}). Start every process with the same number, or raise the timeout "
        "if they start slowly."
    )


def _check_same_num_processes(client, num_processes: int, process_id: int, seconds: int) -> None:
    """Every process that joined says how many processes it expects; a disagreement raises here, in
    each of them, instead of a job on fewer processes than asked that hangs at exit (JAX's
    coordinator only knows process 0's number, and lets in a process that expects more)."""
    key = "shardtensor/num_processes/"
    client.key_value_set(f"{key}{process_id}", str(num_processes))
    client.wait_at_barrier("shardtensor/num_processes", seconds * 1000)
    said = {int(k.rpartition("/")[2]): int(v) for k, v in client.key_value_dir_get(key)}
    if len(set(said.values())) > 1:
        raise ValueError(
            "initialize_distributed: the processes were started with different numbers of processes "
            f"(num_processes / WORLD_SIZE, by process id: {dict(sorted(said.items()))}). Start every process "
            "with the same number."
        )


def start_coordination_service(port: int, num_processes: int):
    """Host JAX's coordination service for a job of ``num_processes`` processes that join with
    `initialize_distributed` (``hosted_elsewhere=True``) at ``127.0.0.1:port``; call ``shutdown()``
    on the result once they ended. `launch` uses it so that the job survives the death of any of
    its processes, process 0 included.

    Example::

        service = rt.start_coordination_service(port, 2)
        ...   # start the 2 processes, wait for them
        service.shutdown()
    """
    from jax._src.lib import _jax

    return _jax.get_distributed_runtime_service(
        f"127.0.0.1:{port}",
        num_processes,
        heartbeat_timeout=_positive_env(HEARTBEAT_TIMEOUT_ENV, _DEFAULT_HEARTBEAT_TIMEOUT),
        recoverable=True,
    )


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: list[int] | None = None,
    *,
    initialization_timeout: int | None = None,
    hosted_elsewhere: bool = False,
) -> None:
    """Join a multi-process run through ``jax.distributed.initialize``.

    Call it in every process before anything touches a device. CPU processes talk through gloo.
    Without arguments it reads torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``): JAX's coordinator listens on ``MASTER_ADDR:MASTER_PORT+1``
    (torchrun's own store has ``MASTER_PORT``), or on ``SHARDTENSOR_COORDINATOR_PORT``; with several
    processes per host each gets the GPU of its ``LOCAL_RANK``. Importing shardtensor with
    ``SHARDTENSOR_AUTO_DISTRIBUTED=1`` calls it so.

    JAX's coordination service: by default process 0 starts it in a small process of its own
    (``shardtensor/runtime/service_process.py``, ~0.25 s, in its own session: torchrun's stop and a
    Ctrl-C do not reach it), which every process keeps a connection to and which ends by itself
    once every process of the job ended, normally or not (a process that never connected is
    waited for ``initialization_timeout`` + 10 s). ``hosted_elsewhere=True``: process 0 starts none,
    another process hosts it (`start_coordination_service`; `launch`'s parent).

    Joining waits up to ``initialization_timeout`` seconds (default ``SHARDTENSOR_INIT_TIMEOUT``, or
    60) for the coordinator and every process, then raises ``TimeoutError`` (jaxlib adds a fixed
    5 s: it comes at timeout + 5 s) saying whether no coordinator answers at the address or it
    answers but not every process came (one not started, or the processes disagree on
    ``num_processes``); the process may then exit or try again. Processes that all joined but were
    started with different ``num_processes`` / ``WORLD_SIZE`` each raise ``ValueError`` at once.
    (JAX alone ends the processes by SIGABRT after 300 s in the first case; in the second it runs
    on the processes its coordinator counted and hangs at exit.)

    A process that dies, process 0 included, does not take the others with it (JAX's recoverable
    tasks; the service outside process 0): a survivor's next collective raises a Python exception
    (on CPU "Gloo ... failed": at once when gloo sees the connection close, measured 0.04-0.3 s after
    a SIGKILL, at the latest after ``SHARDTENSOR_COLLECTIVE_TIMEOUT`` seconds, default 600), and the
    survivor can exit normally. Only the death of the service's process itself (killed by hand, or
    `launch`'s parent) still ends the others by SIGABRT ("std::bad_cast"; docs/multiprocess.md).
    At exit the processes wait for each other (up to that time), leaving out a dead one at once
    (its connection to the service process closed; with the service hosted elsewhere, once JAX
    missed its heartbeats for ``SHARDTENSOR_HEARTBEAT_TIMEOUT`` seconds, default 30).

    Example::

        rt.initialize_distributed('10.0.0.1:1234', num_processes=2, process_id=0)
        rt.process_count()   # 2
        # under `torchrun --nproc-per-node 2 train.py`:
        rt.initialize_distributed()
    """
    given = (coordinator_address, num_processes, process_id)
    if all(value is None for value in given):
        coordinator_address, num_processes, process_id, env_ids = _torchrun_arguments()
        local_device_ids = env_ids if local_device_ids is None else local_device_ids
    elif coordinator_address is None or num_processes is None or process_id is None:
        raise ValueError(
            "initialize_distributed needs coordinator_address, num_processes and process_id together "
            f"(got {coordinator_address!r}, {num_processes!r}, {process_id!r}), or none of them to read "
            "torchrun's environment."
        )
    from jax._src import distributed as jax_distributed
    from jax._src import xla_bridge

    if jax_distributed.global_state.client is None and xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "shardtensor.runtime.initialize_distributed() must be called before anything asks for the devices "
            "in this process, and something already did (st.global_runtime_device_count(), st.Mesh, a tensor "
            "moved to st.device(), or your own JAX code). Call it first, right after `import shardtensor`, "
            "or start the processes with st.launch, or under torchrun with SHARDTENSOR_AUTO_DISTRIBUTED=1 "
            "(it then joins at import)."
        )
    collective_timeout = _positive_env(COLLECTIVE_TIMEOUT_ENV, _DEFAULT_COLLECTIVE_TIMEOUT)
    heartbeat_timeout = _positive_env(HEARTBEAT_TIMEOUT_ENV, _DEFAULT_HEARTBEAT_TIMEOUT)
    if initialization_timeout is None:
        init_timeout = _positive_env(INIT_TIMEOUT_ENV, _DEFAULT_INIT_TIMEOUT)
    elif isinstance(initialization_timeout, int) and initialization_timeout >= 1:
        init_timeout = initialization_timeout
    else:
        raise ValueError(f"initialization_timeout must be a positive int of seconds, got {initialization_timeout!r}.")
    _set_collective_timeout()
    # CPU backends need a collectives implementation to see each other's devices; an explicit
    # user choice (e.g. mpi) wins.
    if jax.config.jax_cpu_collectives_implementation is None:  # type: ignore[attr-defined]  # (jax.config: dynamic attributes)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Recoverable tasks: the coordination service does not abort every process when one stops
    # sending heartbeats (scoped: it is read once, here).
    recoverable = getattr(jax_distributed, "_ENABLE_RECOVERABILITY", None)
    jaxlib_module = jax_distributed._jax
    # process 0's service process waits this long for a process that never connects to it (one
    # waits up to init_timeout to learn where it is)
    linger = init_timeout + 10
    jax_distributed._jax = _JaxlibForJoining(jaxlib_module, hosted_elsewhere, linger)  # for this call
    had_client = jax_distributed.global_state.client is not None
    try:
        with recoverable(True) if recoverable is not None else contextlib.nullcontext():
            jax.distributed.initialize(
                coordinator_address=coordinator_address,
                num_processes=num_processes,
                process_id=process_id,
                local_device_ids=local_device_ids,
                initialization_timeout=init_timeout,
                heartbeat_timeout_seconds=heartbeat_timeout,
            )
    except Exception as e:
        if had_client or jax_distributed.global_state.client is None:
            raise  # JAX refused the arguments, or was initialized already: its own message
        error = _join_error(coordinator_address, num_processes, process_id, init_timeout)
        _forget_failed_join(jax_distributed.global_state)  # after: process 0's own service answers above
        raise error from e
    finally:
        jax_distributed._jax = jaxlib_module
    client = jax_distributed.global_state.client
    _watch_service(client, coordinator_address, process_id, init_timeout)
    _check_same_num_processes(client, num_processes, process_id, init_timeout)
    if recoverable is not None:
        # after jax's own exit hook was registered (at its import), so it runs before it
        atexit.register(_leave_together, collective_timeout)
