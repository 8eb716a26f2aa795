"""Holding Ctrl-C back while a program runs and its results are committed, and while a module imports.

Between calling an executable with donated buffers and giving every output to its cell, the donated
inputs are gone and the outputs are not stored yet: a ``KeyboardInterrupt`` raised in that window
loses the parameters. ``deferred_interrupts()`` makes the window atomic: on the main thread, while
the user's SIGINT handler is a Python function (the default raises ``KeyboardInterrupt``), a
recording handler stands in for it and the user's handler is called, with the same signal, when the
block ends. Anywhere else (another thread, SIGINT ignored or left to the OS) nothing changes.

A Ctrl-C in the middle of an import leaves the module half imported: Python forgets the module whose
code was interrupted but keeps the submodules it had finished, so every later import of it fails
(``module 'sympy' has no attribute 'core'``, an operator "registered multiple times") and the
process can no longer step or save. ``import_whole`` imports what a first step or a first save
would import lazily (torch's DTensor and sympy, DCP, fsspec), all of it or none, before the work
that needs it.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading

# the C module: ``signal``'s wrappers turn every handler into an enum (5 us a call, twice a step)
from _signal import SIGINT, getsignal
from _signal import signal as set_handler
from _thread import get_ident


class deferred_interrupts:
    """A block that SIGINT cannot interrupt: a Ctrl-C arriving inside is delivered when it ends.

    Example::

        with deferred_interrupts():
            outs = executable(donated, kept)    # the donated buffers are consumed here
            store(outs)                         # ... and replaced here; Ctrl-C lands after this
    """

    __slots__ = ("_received", "_user_handler")
    _active = False  # a block is open (blocks nest: only the outermost one swaps handlers)

    def __init__(self):
        self._user_handler = None
        self._received = None

    def __enter__(self):
        if deferred_interrupts._active or get_ident() != threading.main_thread().ident:  # (no Thread looked up)
            return self
        handler = getsignal(SIGINT)
        if not callable(handler):  # SIG_IGN / SIG_DFL / set outside Python: the user's semantics stand
            return self
        set_handler(SIGINT, self._record)
        self._user_handler = handler
        deferred_interrupts._active = True
        return self

    def _record(self, signum, frame):
        self._received = (signum, frame)

    def __exit__(self, *exc):
        handler = self._user_handler
        if handler is None:
            return False
        self._user_handler = None
        deferred_interrupts._active = False
        set_handler(SIGINT, handler)
        received, self._received = self._received, None
        if received is not None:
            handler(*received)  # usually default_int_handler: raises KeyboardInterrupt here
        return False


def import_whole(*names: str) -> None:
    """Import the modules ``names`` that are not imported yet with SIGINT held back (a Ctrl-C that
    arrives meanwhile is delivered once they are all imported). A module this Python lacks is skipped.

    Example::

        import_whole("torch.distributed.checkpoint", "fsspec")   # then a Ctrl-C cannot split them
    """
    missing = [name for name in names if name not in sys.modules]
    if not missing:
        return
    with deferred_interrupts():
        for name in missing:
            with contextlib.suppress(ImportError):  # (an optional part: what needs it raises its own error)
                importlib.import_module(name)
