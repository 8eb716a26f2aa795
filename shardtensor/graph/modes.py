"""The user's controls of the engine: ``sync()`` (and its PyTorch/XLA name ``mark_step()``), ``step()`` and
``eager_mode()``."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Literal, ParamSpec, TypeVar

from shardtensor import metrics as counters
from shardtensor.graph import checks
from shardtensor.graph.execute import run_cells
from shardtensor.graph.state import STATE, check_execution_allowed, has_pending, pending_cells

_P = ParamSpec("_P")
_R = TypeVar("_R")


def sync(wait: bool = False) -> None:
    """Compile (or fetch from the cache) and run everything pending in this thread (each thread
    records its own graph).

    A failed on-device check (an index out of range, ...) raises here for the runs before this one,
    or, with ``wait=True``, for this one too.

    Example::

        loss = model(x).sum(); loss.backward(); opt.step()
        st.sync()        # one program runs the whole step
    """
    counters.increment("MarkStep")
    check_execution_allowed("sync()")
    run_cells(pending_cells(), wait=wait)
    if wait:
        checks.verify()


def mark_step(wait: bool = False) -> None:
    """PyTorch/XLA's ``xm.mark_step()``: the same as `sync` (compile and run everything pending);
    ``wait=True`` also waits for it to finish.

    Example::

        loss.backward(); opt.step()
        st.mark_step()   # = st.sync()
    """
    sync(wait=wait)


class eager_mode:
    """Run each op at once (``eager_mode(True)``) or record lazily (``eager_mode(False)``, default),
    in the calling thread (other threads keep their own mode).

    Works as a call and as a context manager that restores the previous mode::

        st.eager_mode(True)
        with st.eager_mode(False):
            ...
    """

    def __init__(self, enable: bool = True):
        self.previous = STATE.eager
        self.enable = bool(enable)
        _set_eager(self.enable)

    def __call__(self, func: Callable[_P, _R]) -> Callable[_P, _R]:
        """As a decorator: the mode applies while ``func`` runs, not from the moment it is decorated."""
        _set_eager(self.previous)
        enable = self.enable

        @functools.wraps(func)
        def run_in_mode(*args, **kwargs):
            with eager_mode(enable):
                return func(*args, **kwargs)

        return run_in_mode

    def __enter__(self) -> eager_mode:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        _set_eager(self.previous)
        return False


def _set_eager(enable: bool) -> None:
    if enable and not STATE.eager and has_pending():
        run_cells(pending_cells())
    STATE.eager = enable


def is_eager_mode() -> bool:
    """True when ops run at once."""
    return STATE.eager


@contextlib.contextmanager
def step() -> Iterator[None]:
    """A training step: everything recorded inside runs as one program when the block ends normally.

    Example::

        with st.step():
            loss = model(x).mean(); loss.backward(); opt.step(); opt.zero_grad()
    """
    yield
    sync()
