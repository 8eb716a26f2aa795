"""On-device checks: where torch raises on a value (an index out of range, a class target past the
last class, an integer division by zero), a lowering declares it with ``fail_where``.

Checks are computed inside the program that runs the op: each declared check becomes one row
``[failed, position, value]`` of a small int64 output of that program (the graph layer collects
them while it traces and reads them after the run, then raises torch's exception with the user's
source line). Outside such a trace, or with checks turned off, ``fail_where`` does nothing, so the
programs are exactly those without checks.

Example (in a lowering)::

    fail_where((index < 0) | (index >= n), IndexError, "index out of range in self", value=index)
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import types

import jax.numpy as jnp
import torch


def enabled_by_environment(environ) -> bool:
    """Whether ``environ`` leaves checks on: anything but ``SHARDTENSOR_CHECKS=0`` (or false/no/off)."""
    return environ.get("SHARDTENSOR_CHECKS", "1").strip().lower() not in ("0", "false", "no", "off")


_enabled = enabled_by_environment(os.environ)


def set_checks(enabled: bool) -> None:
    """Turn shardtensor's on-device value checks on (the default) or off.

    With checks on, out-of-range indices, embedding ids and class targets, bad ``multinomial``
    probabilities and integer division by zero raise torch's exception, naming the line of your code
    that issued the op, at the latest when a value of that step is read or at the next ``sync()``
    (in eager mode at once). Off, none of this is even traced: the programs are those without
    checks, a little faster, and such inputs give unspecified values. ``SHARDTENSOR_CHECKS=0`` in the
    environment starts with checks off.

    Example::

        st.set_checks(False)    # a debugged training loop: skip the checks
        st.set_checks(True)
    """
    global _enabled
    _enabled = bool(enabled)


def checks_enabled() -> bool:
    """Whether on-device value checks are traced into new programs (see ``set_checks``)."""
    return _enabled


class Check:
    """A declared check's static part: which step of the program, which exception, which message
    (a ``str.format`` template that may use ``{value}`` and ``{position}``)."""

    __slots__ = ("error", "message", "step")

    def __init__(self, step, error, message):
        self.step, self.error, self.message = step, error, message


class Collector:
    """The checks declared while one program is traced: static ``checks`` and their device ``rows``."""

    def __init__(self):
        self.step = None  # the program step being traced (set by the program builder)
        self.checks: list[Check] = []
        self.rows: list = []

    def output(self):
        """One int64 (n, 3) array of ``[failed, position, value]`` rows, or None without checks."""
        return jnp.stack(self.rows) if self.rows else None


_local = threading.local()


@contextlib.contextmanager
def collecting(collector: Collector):
    """Lowerings traced inside the block declare their checks into ``collector``."""
    previous = getattr(_local, "collector", None)
    _local.collector = collector
    try:
        yield collector
    finally:
        _local.collector = previous


def fail_where(bad, error, message: str, value=None) -> None:
    """Declare that torch raises ``error(message)`` if any element of the bool array ``bad`` holds.

    ``value`` (broadcast like ``bad``): the offending value reported in the message as ``{value}``;
    ``{position}`` is the flat position of the first failing element.

    Example::

        fail_where(target >= n_classes, IndexError, "Target {value} is out of bounds.", value=target)
    """
    collector = getattr(_local, "collector", None)
    if collector is None:
        return
    flat = jnp.reshape(bad, (-1,))
    if flat.shape[0] == 0:
        return
    # plain min/sum reductions (no argmax, no dynamic index): one small all-reduce each on sharded data
    n = flat.shape[0]
    positions = jnp.arange(n, dtype=jnp.int64)
    pos = jnp.min(jnp.where(flat, positions, n))
    failed = pos < n
    if value is None:
        v = jnp.zeros((), jnp.int64)
    else:
        v = jnp.reshape(jnp.broadcast_to(value, jnp.shape(bad)), (-1,)).astype(jnp.int64)
        v = jnp.sum(jnp.where(positions == pos, v, 0))
    row = jnp.stack([failed.astype(jnp.int64), jnp.where(failed, pos, 0), v])
    collector.checks.append(Check(collector.step, error, message))
    collector.rows.append(row)


def out_of_range(index, size: int, *, negative_ok: bool):
    """Where ``index`` is outside ``[0, size)`` (``negative_ok``: outside ``[-size, size)``, torch's
    wrapped negatives)."""
    low = -size if negative_ok else 0
    return (index < low) | (index >= size)


_SKIPPED = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # shardtensor
    os.path.dirname(torch.__file__) + os.sep,
)


def user_site():
    """(file name, line number) of the innermost caller outside shardtensor and torch: the user's
    line that issued the op being recorded."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        # (torch.compile's FX graphs run as "<eval_with_key>.N": the user's call of the compiled function)
        if not name.startswith(_SKIPPED) and not name.startswith(("<frozen", "<eval_with_key>")):
            return name, frame.f_lineno
        frame = frame.f_back
    return None
