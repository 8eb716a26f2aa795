"""A bounded cache of compiled programs: the least recently used one goes first.

A loop of identical steps needs a handful of executables, but a process that keeps meeting new
shapes (variable sequence lengths, a notebook, a server) would otherwise keep every program it ever
compiled. Each cache holds at most ``executable_cache_size()`` entries (``SHARDTENSOR_EXECUTABLE_CACHE_SIZE``,
default 1024 as PyTorch/XLA's ``XLA_COMPILATION_CACHE_SIZE``); every eviction counts in the counter
``ExecutableCacheEvictions``. An evicted program compiles again when it is needed (a persistent
compilation cache, ``st.initialize_cache``, makes that cheap). Evicting frees the memory: on CPU a
small program holds about 1.7 MB of host memory (100 distinct shapes: +166 MB unbounded, +13 MB
with a bound of 10), so 1024 of them stay within a couple of GB.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections import OrderedDict

from shardtensor import metrics as counters

ENV = "SHARDTENSOR_EXECUTABLE_CACHE_SIZE"
DEFAULT_SIZE = 1024
EVICTIONS = "ExecutableCacheEvictions"


def _size_from_env() -> int:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_SIZE
    try:
        size = int(raw)
    except ValueError:
        size = 0
    if size < 1:
        warnings.warn(
            f"{ENV}={raw!r} is not a positive integer; using the default, {DEFAULT_SIZE} executables.",
            RuntimeWarning,
            stacklevel=2,
        )
        return DEFAULT_SIZE
    return size


_LIMIT = [_size_from_env()]
_CACHES: weakref.WeakSet = weakref.WeakSet()


class ExecutableCache:
    """A dict of executables by key that keeps the ``executable_cache_size()`` most recently used."""

    def __init__(self):
        self._items: OrderedDict = OrderedDict()
        _CACHES.add(self)

    def get(self, key, default=None):
        item = self._items.get(key)
        if item is None:
            return default
        self._items.move_to_end(key)
        return item

    def __setitem__(self, key, value) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        self._shrink()

    def _shrink(self) -> None:
        while len(self._items) > _LIMIT[0]:
            self._items.popitem(last=False)
            counters.increment(EVICTIONS)

    def __contains__(self, key) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items))

    def clear(self) -> None:
        self._items.clear()


def executable_cache_size() -> int:
    """How many compiled programs each executable cache keeps (lazy graphs; eager single ops).

    Example::

        st.executable_cache_size()   # 1024 unless SHARDTENSOR_EXECUTABLE_CACHE_SIZE says otherwise
    """
    return _LIMIT[0]


def set_executable_cache_size(size: int) -> int:
    """Keep at most ``size`` compiled programs per cache (least recently used out first; evictions
    count in ``ExecutableCacheEvictions``); returns the previous size.

    Example::

        st.set_executable_cache_size(64)   # a server that sees many shapes: bound its memory
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"set_executable_cache_size takes a positive integer, got {size!r}.")
    previous, _LIMIT[0] = _LIMIT[0], size
    for cache in list(_CACHES):
        cache._shrink()
    return previous
