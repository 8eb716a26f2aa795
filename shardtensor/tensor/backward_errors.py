"""Errors raised inside ``backward()`` reach the user as themselves.

A Python-defined device turns an exception raised while autograd runs backward into a bare
``SystemError`` or an abort. Ops keep such an error (``remember``) and the wrapper installed
around torch's engine re-raises it on the user's thread once backward has unwound. The wrapper also
waits until autograd's device thread has let go of the backward pass, so a script that exits right
after ``backward()`` does not abort.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import sys
import time

import torch
import torch.autograd
import torch.autograd.graph

_last_error: dict[str, BaseException] = {}


def remember(e: BaseException) -> None:
    """Keep an exception raised while autograd runs backward, to re-raise it on the user's thread
    (the first one wins: later ones are consequences)."""
    _last_error.setdefault("error", e)


def _run_engine_then_wait(run):
    """torch's ``_engine_run_backward``, waiting at the end until autograd's device thread has let
    go of the backward pass (its "graph task").

    torch keeps a Python object (a ``contextvars`` context) in the thread-local state each graph task
    copies; the device thread that runs backward on st.device() often drops the task just after
    ``backward()`` returns, and dropping it takes the GIL. If the main thread is exiting the
    interpreter by then, taking the GIL ends the device thread and the process aborts ("terminate
    called without an active exception"). So the context is made here, and ``backward()`` returns
    once no graph task holds it any more (the GIL is released while waiting)."""
    stash = getattr(torch._C, "_stash_obj_in_tls", None)
    if stash is None:  # a torch that keeps no Python object in autograd's thread-local state
        return run

    graph = torch.autograd.graph

    @functools.wraps(run)
    def run_backward(t_outputs, *args, **kwargs):
        unhook = None
        if graph.log.getEffectiveLevel() <= logging.DEBUG:  # torch's own backward logging
            unhook = graph._register_logging_hooks_on_whole_graph(t_outputs)
        context = contextvars.copy_context()  # device threads see the caller's context variables
        stash("context", context)
        try:
            return graph.Variable._execution_engine.run_backward(t_outputs, *args, **kwargs)
        finally:
            if unhook is not None:
                unhook()
            torch._C._remove_obj_from_tls("context")
            deadline = time.monotonic() + 5.0
            while sys.getrefcount(context) > 2 and time.monotonic() < deadline:  # ours + the argument
                time.sleep(1e-5)

    return run_backward


def _engine_wrapper(run):
    @functools.wraps(run)
    def run_backward(*args, **kwargs):
        _last_error.pop("error", None)
        try:
            result = run(*args, **kwargs)
        except BaseException as e:
            original = _last_error.pop("error", None)
            if original is not None and original is not e:
                raise original.with_traceback(original.__traceback__) from None
            raise
        original = _last_error.pop("error", None)
        if original is not None:
            raise original.with_traceback(original.__traceback__)
        return result

    return run_backward


_CPU = torch.device("cpu")


def _on_calling_thread(run):
    """torch's ``_engine_run_backward``, running backward on the calling thread.

    torch's engine runs a non-CPU device's backward ops on its own device thread, shared by every
    thread's backward. shardtensor keeps its mode and pending graph per thread (graph/state.py), so
    the ops of a backward must be recorded by the thread that called it: multithreaded backward is
    turned off for the call (torch's own switch, a thread-local flag; CPU backward always runs on
    the calling thread anyway). Roots on another device (CUDA) keep torch's default."""

    @functools.wraps(run)
    def run_backward(t_outputs, *args, **kwargs):
        ours = ("cpu", torch._C._get_privateuse1_backend_name())  # the name st.device() was given
        if not all(getattr(t, "device", _CPU).type in ours for t in t_outputs):
            return run(t_outputs, *args, **kwargs)
        with torch.autograd.set_multithreading_enabled(False):
            return run(t_outputs, *args, **kwargs)

    return run_backward


def install():
    """Wrap torch's backward engine (once, when the device is installed)."""
    wrapped = _engine_wrapper(_on_calling_thread(_run_engine_then_wait(torch.autograd.graph._engine_run_backward)))
    torch.autograd.graph._engine_run_backward = wrapped
    torch.autograd._engine_run_backward = wrapped
