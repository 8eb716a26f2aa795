"""``torch_xla.utils.utils`` (``xu``) under the face: ``SampleGenerator`` (synthetic data for the
examples), environment helpers and small utilities."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any


class SampleGenerator:
    """An iterable that yields ``data`` ``sample_count`` times (a stand-in for a DataLoader)."""

    def __init__(self, data: Any, sample_count: int) -> None:
        self._data = data
        self._sample_count = sample_count
        self._count = 0

    def __iter__(self) -> SampleGenerator:
        return SampleGenerator(self._data, self._sample_count)

    def __len__(self) -> int:
        return self._sample_count

    def __next__(self) -> Any:
        if self._count >= self._sample_count:
            raise StopIteration
        self._count += 1
        return self._data

    next = __next__


class LazyProperty:
    """A value computed by ``gen_fn`` on first read of ``.value``."""

    def __init__(self, gen_fn: Callable[[], Any]) -> None:
        self._gen_fn = gen_fn
        self._computed = False
        self._value: Any = None

    @property
    def value(self) -> Any:
        if not self._computed:
            self._value, self._computed = self._gen_fn(), True
        return self._value


def as_list(t: Any) -> list:
    return list(t) if isinstance(t, (tuple, list)) else [t]


def getenv_as(name: str, type: Callable[[Any], Any], defval: Any = None) -> Any:
    """The environment variable ``name`` converted by ``type`` (``bool`` reads an integer), or ``defval``."""
    value = os.environ.get(name)
    if value is None:
        return defval
    return bool(int(value)) if type is bool else type(value)


def check_env_flag(name: str, default: str = "") -> bool:
    """Whether the variable is ``'true'`` or a positive integer."""
    flag = os.getenv(name, default)
    return flag == "true" or (flag.isdigit() and int(flag) > 0)


def get_free_tcp_ports(n: int = 1) -> list[int]:
    """``n`` TCP ports free on this host now."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def shape(inputs: Any) -> Any:
    """The shapes of a nest of tensors, in the same nest."""
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(shape(x) for x in inputs)
    return list(inputs.shape) if hasattr(inputs, "shape") else inputs


def flatten_nested_tuple(inputs: Any) -> tuple:
    if not isinstance(inputs, tuple):
        return (inputs,)
    return tuple(x for item in inputs for x in flatten_nested_tuple(item))
