"""Named event counters (compiles, cache hits, executions, transfers).

The full metrics report builds on these; the tests and `SHARDTENSOR_DEBUG` read them directly.

Example::

    clear_counters()
    ...  # run a training step
    counter_value("UncachedCompile")   # -> 1
"""
from __future__ import annotations

import collections

_COUNTS: collections.Counter = collections.Counter()


def increment(name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name`` (creating it)."""
    _COUNTS[name] += n


def counter_value(name: str) -> int | None:
    """The value of counter ``name``, or None if it never counted (PyTorch/XLA's convention).

    Example::

        counter_value("CachedCompile")
    """
    return _COUNTS[name] if name in _COUNTS else None


def counter_names() -> list[str]:
    """Names of the counters that have counted something."""
    return sorted(_COUNTS)


def counters() -> dict[str, int]:
    """A snapshot of every counter.

    Example::

        before = counters(); step(); after = counters()
    """
    return dict(_COUNTS)


def clear_counters() -> None:
    """Reset every counter."""
    _COUNTS.clear()
