"""What several modules of the face share: the ``'xla'`` device as ``st.device()``, the step closures
that PyTorch/XLA runs at each sync, and the names the face cannot provide (they raise saying why).

Not a torch_xla module: ``torch_xla._support`` does not exist under the face.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, NoReturn

import torch

import shardtensor as st

UNSUPPORTED_ATTR = "__shardtensor_unsupported__"


def unsupported(name: str, why: str, *, error: type[Exception] = NotImplementedError) -> Callable[..., NoReturn]:
    """A stand-in for the torch_xla function ``name`` that shardtensor cannot provide: calling it
    raises ``error`` naming it and ``why`` (what to use instead); never a silent no-op.

    Example: ``get_master_ip = unsupported("torch_xla.runtime.get_master_ip", "...")``.
    """

    def stand_in(*args: Any, **kwargs: Any) -> NoReturn:
        raise error(f"{name} is not available under shardtensor's torch_xla face: {why}")

    stand_in.__name__ = stand_in.__qualname__ = name.rsplit(".", 1)[-1]
    stand_in.__doc__ = f"Not available under shardtensor: {why}"
    setattr(stand_in, UNSUPPORTED_ATTR, why)
    return stand_in


def unsupported_class(name: str, why: str) -> type:
    """A stand-in class for ``name``: constructing it raises NotImplementedError saying ``why``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{name} is not available under shardtensor's torch_xla face: {why}")

    cls = type(name.rsplit(".", 1)[-1], (), {"__init__": __init__, "__doc__": f"Not available: {why}"})
    setattr(cls, UNSUPPORTED_ATTR, why)
    return cls


def module_getattr(module: str, reasons: dict[str, str], default: str | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for names of PyTorch/XLA the face leaves out: an AttributeError that
    says why (``reasons[name]``, else ``default``), as Python would raise for a missing name."""

    def __getattr__(name: str) -> Any:
        why = reasons.get(name, default)
        if why is None or name.startswith("__"):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        raise AttributeError(f"{module}.{name} is not available under shardtensor's torch_xla face: {why}")

    return __getattr__


# --------------------------------------------------------------------------- the 'xla' device


def is_xla_device(device: Any) -> bool:
    """Whether ``device`` names PyTorch/XLA's device (``'xla'``, ``'xla:0'``, ``torch.device('xla')``)."""
    if isinstance(device, str):
        return device == "xla" or device.startswith("xla:")
    return isinstance(device, torch.device) and device.type == "xla"


def as_st_device(device: Any) -> torch.device:
    """``st.device()`` for ``None``, an ``'xla'`` device or st.device() itself; a ValueError for others."""
    if device is None or is_xla_device(device):
        return st.device()
    if isinstance(device, (str, torch.device)) and torch.device(device).type == st.device().type:
        return st.device()
    raise ValueError(f"expected an XLA device ('xla', 'xla:0', torch_xla.device()), got {device!r}.")


# --------------------------------------------------------------------------- step closures and sync


class _Closures(threading.local):
    def __init__(self) -> None:
        self.pending: list[Callable[[], Any]] = []
        self.pending_async: list[Callable[[], Any]] = []


_CLOSURES = _Closures()
_ASYNC: queue.Queue | None = None
_ASYNC_ERRORS: list[BaseException] = []
_ASYNC_LOCK = threading.Lock()


def add_step_closure(closure: Callable[..., Any], args: tuple = (), run_async: bool = False) -> None:
    """Queue ``closure(*args)`` for the end of the step (the next sync), in order."""
    target = _CLOSURES.pending_async if run_async else _CLOSURES.pending
    target.append(functools.partial(closure, *args))


def run_step_closures() -> None:
    """Run the closures queued in this thread (those with ``run_async`` on one background thread,
    whose errors are raised by the next sync)."""
    if _ASYNC_ERRORS:
        raise _ASYNC_ERRORS.pop(0)
    if _CLOSURES.pending_async:
        closures, _CLOSURES.pending_async = _CLOSURES.pending_async, []
        for c in closures:
            _async_queue().put(c)
    if _CLOSURES.pending:
        closures, _CLOSURES.pending = _CLOSURES.pending, []
        for c in closures:
            c()


def _async_queue() -> queue.Queue:
    global _ASYNC
    with _ASYNC_LOCK:
        if _ASYNC is None:
            _ASYNC = queue.Queue()
            threading.Thread(target=_run_async, args=(_ASYNC,), name="torch_xla step closures", daemon=True).start()
    return _ASYNC


def _run_async(q: queue.Queue) -> None:
    while True:
        closure = q.get()
        try:
            closure()
        except BaseException as e:  # raised again by the main thread's next sync
            _ASYNC_ERRORS.append(e)


def env_flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def sync(wait: bool = False) -> None:
    """PyTorch/XLA's sync: run everything pending (``XLA_SYNC_WAIT`` overrides ``wait``), then the
    step closures."""
    st.sync(wait=env_flag("XLA_SYNC_WAIT", wait))
    run_step_closures()
