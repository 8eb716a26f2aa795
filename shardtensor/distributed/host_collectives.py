"""Host values across the processes of a job (PyTorch/XLA's ``xm.rendezvous`` and ``xm.mesh_reduce``):
`rendezvous` waits until every process reached a tag and returns each one's bytes; `mesh_reduce`
reduces a value of plain data (numbers, strings, lists, dicts, tensors, numpy arrays) over the
processes, read back with ``torch.load(weights_only=True)``: the coordination store may be reachable
by others, so what is read from it never runs code. They travel through JAX's coordination service (its
key-value store), not through the devices: for small values (a loss, a flag, a config), not tensors
of a model.

Example::

    import shardtensor as st
    st.rendezvous("checkpoint_saved")                        # [b'', b''] in each of 2 processes
    st.mesh_reduce("loss", loss.item(), lambda xs: sum(xs) / len(xs))
"""

from __future__ import annotations

import functools
import io
import pickle
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree

from shardtensor.runtime.joining import COLLECTIVE_TIMEOUT_ENV, collective_timeout

T = TypeVar("T")

_KEY_ROOT = "shardtensor/host_collectives"
_calls: dict[tuple[int, str, str, tuple[int, ...]], int] = {}  # (client, kind, tag, replicas) -> calls so far
_calls_lock = threading.Lock()


def _job() -> tuple[Any, int, int]:
    """(coordination client or None, this process's id, number of processes)."""
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    if state.client is None:
        return None, 0, 1
    return state.client, state.process_id, state.num_processes


def _members(replicas: Sequence[int] | None, process_id: int, num_processes: int) -> tuple[int, ...]:
    """The processes taking part, in process order (None or empty: all of them)."""
    if replicas is None or len(replicas) == 0:
        return tuple(range(num_processes))
    members = sorted(replicas)
    bad = [r for r in members if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < num_processes]
    if bad or len(set(members)) != len(members):
        raise ValueError(
            f"replicas must be distinct process indices in 0..{num_processes - 1} (this job has "
            f"{num_processes} process{'es' if num_processes > 1 else ''}), got {list(replicas)!r}."
        )
    if process_id not in members:
        raise ValueError(
            f"process {process_id} called rendezvous with replicas={list(replicas)!r}, which leaves it out: "
            "only the processes listed call it."
        )
    return tuple(members)


def _resolve_timeout(timeout: float | None) -> float:
    if timeout is None:
        return float(collective_timeout())
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    return float(timeout)


def _check_tag(kind: str, tag: str) -> None:
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"{kind} needs a non-empty str tag, got {tag!r}.")


def _missing(client: Any, prefix: str, members: tuple[int, ...]) -> list[int]:
    present = {int(key.rpartition("/")[2]) for key, _ in client.key_value_dir_get_bytes(prefix)}
    return [p for p in members if p not in present]


def rendezvous(
    tag: str,
    payload: bytes = b"",
    replicas: Sequence[int] | None = None,
    *,
    timeout: float | None = None,
) -> list[bytes]:
    """Wait until every process (or those in ``replicas``) reached ``tag``; return each one's
    ``payload``, in process order (PyTorch/XLA's ``xm.rendezvous``).

    Every process taking part calls it with the same ``tag`` and ``replicas``; calling it again with
    the same tag is a new rendezvous. A process waits up to ``timeout`` seconds (default
    ``SHARDTENSOR_COLLECTIVE_TIMEOUT``, or 600), then raises ``TimeoutError`` naming the processes
    that did not arrive. Outside a multi-process job it returns ``[payload]`` at once.

    Example::

        st.rendezvous("init", str(st.process_index()).encode())   # [b'0', b'1'] in each of 2 processes
    """
    return _exchange("rendezvous", tag, payload, replicas, timeout)


def _exchange(
    kind: str, tag: str, payload: bytes, replicas: Sequence[int] | None, timeout: float | None
) -> list[bytes]:
    """`rendezvous` for ``kind`` (a function's name): each kind has its own keys and call counts."""
    _check_tag(kind, tag)
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise TypeError(
            f"{kind} sends bytes, got {type(payload).__name__}: encode it (str.encode(), json.dumps(...).encode()), "
            "or use st.mesh_reduce for plain data (numbers, lists, dicts, tensors)."
        )
    payload = bytes(payload)
    seconds = _resolve_timeout(timeout)
    client, process_id, num_processes = _job()
    members = _members(replicas, process_id, num_processes)
    if client is None:
        return [payload]
    with _calls_lock:
        call_key = (id(client), kind, tag, members)
        call = _calls.get(call_key, 0)
        _calls[call_key] = call + 1
    # The tag is quoted so that a '/' in it cannot reach into another tag's keys.
    group = "all" if len(members) == num_processes else ",".join(map(str, members))
    base = f"{_KEY_ROOT}/{kind}/{urllib.parse.quote(tag, safe='')}/{group}"
    prefix = f"{base}/{call}/"
    client.key_value_set_bytes(f"{prefix}{process_id}", payload)
    deadline = time.monotonic() + seconds
    out = []
    for member in members:
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            out.append(client.blocking_key_value_get_bytes(f"{prefix}{member}", left_ms))
        except Exception as e:
            if time.monotonic() < deadline - 0.01:
                raise  # not a timeout: the coordination service's own error
            missing = _missing(client, prefix, members) or [member]  # (or it came just too late)
            raise TimeoutError(
                f"{kind}({tag!r}) in process {process_id}: process{'es' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} did not arrive within {seconds:g} s (timeout= or "
                f"{COLLECTIVE_TIMEOUT_ENV}). A process died or is slow, or the processes did not all call "
                f"{kind}({tag!r}) the same number of times."
            ) from e
    if call > 0:
        # Everyone read the previous call's keys before setting this call's: this process's old key can go.
        client.key_value_delete(f"{base}/{call - 1}/{process_id}")
    return out


def _to_host(value: Any) -> Any:
    return pytree.tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, value)


@functools.cache
def _numpy_globals() -> list:
    """What ``torch.load(weights_only=True)`` needs to rebuild numpy arrays and scalars (plain data)."""
    import numpy as np

    dtypes = {type(np.dtype(code)) for code in "?bhilqBHILQefdgFDGSUmM"}
    return [np.dtype, np.ndarray, np.ndarray(0).__reduce__()[0], np.float64(0).__reduce__()[0], *dtypes]


def _encode(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _decode(tag: str, process: int, data: bytes) -> Any:
    """A value another process sent, rebuilt without running code (plain data only)."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        detail = f"it holds {found.group(1)}" if found else str(error)
        raise TypeError(
            f"mesh_reduce({tag!r}): the value of process {process} is not plain data ({detail}); send "
            "numbers, strings, lists, tuples, dicts, tensors or numpy arrays (what the other processes "
            "read is never unpickled as code)"
        ) from error


def mesh_reduce(tag: str, data: T, reduce_fn: Callable[[list[T]], Any], *, timeout: float | None = None) -> Any:
    """Gather ``data`` (plain data: numbers, strings, lists, tuples, dicts, tensors, numpy arrays;
    tensors are moved to the CPU) from every process and return ``reduce_fn(list of them, in process
    order)`` in every process (PyTorch/XLA's ``xm.mesh_reduce``). Values are read back with
    ``torch.load(weights_only=True)``, so another type (an object of your own class) raises
    ``TypeError`` naming it, in every process. Every process calls it with the same ``tag``;
    ``timeout`` as in `rendezvous`. Outside a multi-process job it returns ``reduce_fn([data])``
    (after the same check).

    Example::

        mean_loss = st.mesh_reduce("loss", loss.item(), lambda xs: sum(xs) / len(xs))
        total = st.mesh_reduce("counts", torch.tensor([3, 4]), lambda ts: torch.stack(ts).sum(0))
    """
    host = _to_host(data)
    if _job()[0] is None:
        _check_tag("mesh_reduce", tag)
        return reduce_fn([_decode(tag, 0, _encode(host))])  # (the same values and errors as with several)
    gathered = _exchange("mesh_reduce", tag, _encode(host), None, timeout)
    return reduce_fn([_decode(tag, process, b) for process, b in enumerate(gathered)])
