"""``torch_xla.debug.profiler`` (``xp``) under the face, on JAX's profiler (``jax.profiler``): a
profiler server, traces written for TensorBoard / XProf, and named regions. shardtensor's programs are
JAX programs, so a JAX trace shows their compilation and execution on the devices."""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

import shardtensor as st
from shardtensor.xla.face import _support

_MARKED_STEP = threading.local()


def set_tracer_marked_step(value: bool) -> None:
    _MARKED_STEP.value = bool(value)


def get_tracer_marked_step() -> bool:
    return getattr(_MARKED_STEP, "value", False)


def start_server(port: int, only_on_master: bool = True) -> Any:
    """Start JAX's profiler server on ``port`` (for TensorBoard's profile plugin, XProf, or
    ``trace``); returns the server."""
    if only_on_master and st.process_index() != 0:
        return None
    return jax.profiler.start_server(port)


def _is_local(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "127.0.0.1", "::1", "", socket.gethostname(), socket.getfqdn())


def trace(
    service_addr: str,
    logdir: str,
    duration_ms: int = 1000,
    num_tracing_attempts: int = 3,
    host_tracer_level: int = 2,
    device_tracer_level: int = 1,
    delay_ms: int = 0,
    timeout_s: int = 120,
    interval_s: int = 5,
) -> None:
    """Capture ``duration_ms`` of this process's activity into ``logdir`` (after ``delay_ms``), blocking.
    The server must be this process's own (``localhost:<port>`` of ``start_server``): JAX captures
    in-process; a remote server raises NotImplementedError."""
    addresses = [a.strip() for a in service_addr.split(",") if a.strip()]
    remote = [a for a in addresses if not _is_local(a)]
    if remote:
        raise NotImplementedError(
            f"xp.trace({service_addr!r}): capturing from another host's server is not available under "
            "shardtensor's face (JAX's profiler traces its own process); run trace in that process, or "
            "point TensorBoard's profile plugin / XProf at the server."
        )
    if delay_ms:
        time.sleep(delay_ms / 1000)
    options = jax.profiler.ProfileOptions()
    options.host_tracer_level = host_tracer_level
    options.device_tracer_level = device_tracer_level
    jax.profiler.start_trace(logdir, profiler_options=options)
    try:
        time.sleep(duration_ms / 1000)
    finally:
        jax.profiler.stop_trace()


def trace_detached(*args: Any, **kwargs: Any) -> threading.Thread:
    """``trace`` on a background thread."""
    thread = threading.Thread(target=trace, args=args, kwargs=kwargs, daemon=True)
    thread.start()
    return thread


class Trace:
    """``with xp.Trace('fwd'):`` a named region in the trace (``jax.profiler.TraceAnnotation``)."""

    def __init__(self, name: str, **kwargs: Any) -> None:
        self.name = name
        self._annotation = jax.profiler.TraceAnnotation(name, **kwargs)

    def __enter__(self) -> Trace:
        self._annotation.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._annotation.__exit__(*exc)


class StepTrace(Trace):
    """``with xp.StepTrace('train_step', step_num=step):`` a step region (per-step statistics in the
    trace viewer); the step's pending work runs at its end (``torch_xla.sync()``)."""

    def __init__(self, name: str, **kwargs: Any) -> None:
        self.name = name
        self._annotation = jax.profiler.StepTraceAnnotation(name, **kwargs)

    def __enter__(self) -> StepTrace:
        set_tracer_marked_step(True)
        self._annotation.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None:
                _support.sync()
        finally:
            self._annotation.__exit__(*exc)


def trace_me(scope: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: each call of the function is a ``Trace(scope)`` region."""

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with Trace(scope):
                return func(*args, **kwargs)

        return wrapper

    return decorator


def start_trace(log_dir: str) -> None:
    """Start tracing this process into ``log_dir`` (``jax.profiler.start_trace``)."""
    jax.profiler.start_trace(str(log_dir))


def stop_trace() -> None:
    """Stop the trace and write it (``jax.profiler.stop_trace``)."""
    jax.profiler.stop_trace()
