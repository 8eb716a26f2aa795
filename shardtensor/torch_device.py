"""The torch device: a renamed PrivateUse1 backend, so ``model.to(st.device())`` and
``torch.zeros(..., device=st.device())`` give ShardedTensors (replicated over the mesh).

Also: ``torch.manual_seed`` reaches shardtensor's key through the backend module, and errors raised
inside ``backward()`` reach the user as themselves: a C++ device guard (``device_guard.cpp``) keeps
autograd from calling Python while it unwinds, and the engine wrapper below re-raises what an op
kept (a Python backend otherwise turns such errors into a bare ``SystemError`` or an abort).
"""
from __future__ import annotations

import contextvars
import functools
import logging
import os
import pathlib
import sys
import time
import warnings

import torch
from torch.utils.backend_registration import _DummyPrivateUse1Hook, _setup_privateuseone_for_python_backend

BACKEND = "shardtensor"
_DEVICE = None
CPP_GUARD = False  # True once the C++ device guard is loaded (the normal case)
EXT = None  # the C++ module: set_geometry, share_storage, fresh_storage, forget_view_replay (or None)


def device(index=None) -> torch.device:
    """The one logical torch device that stands for the whole mesh (SPMD style).

    Example::

        model = torch.nn.Linear(4, 4).to(st.device())
    """
    return _DEVICE


def devices() -> list:
    """The devices of this process as torch sees them: ``[st.device()]`` in SPMD mode."""
    return [_DEVICE]


@functools.lru_cache(maxsize=None)
def _all_devices_mesh():
    from shardtensor.mesh import get_1d_mesh

    return get_1d_mesh()


def default_mesh():
    """The mesh replicated tensors live on: the global mesh if set, else a 1-D mesh of all devices."""
    from shardtensor.mesh import get_global_mesh

    return get_global_mesh() or _all_devices_mesh()


class _BackendModule:
    """What torch asks of a device module (``torch.shardtensor``)."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        from shardtensor import rng

        rng.manual_seed(seed)

    manual_seed = manual_seed_all

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        """The random key as a CPU uint8 tensor (for ``torch.random.fork_rng`` and friends)."""
        from shardtensor import rng

        return torch.from_numpy(rng.get_state().view("uint8").copy())

    @staticmethod
    def set_rng_state(state: torch.Tensor, device=None) -> None:
        from shardtensor import rng

        rng.set_state(state.numpy().view("uint32"))

    get_rng_state_all = staticmethod(lambda: [_BackendModule.get_rng_state()])
    set_rng_state_all = staticmethod(lambda states: _BackendModule.set_rng_state(states[0]))

    @staticmethod
    def get_amp_supported_dtype():
        return [torch.float16, torch.bfloat16]


# --- errors inside backward() ---------------------------------------------------------------------
_last_error = {}


def remember_backward_error(e: BaseException) -> None:
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

    from torch.autograd import graph

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


def _install_backward_error_fix():
    import torch.autograd
    import torch.autograd.graph

    wrapped = _engine_wrapper(_run_engine_then_wait(torch.autograd.graph._engine_run_backward))
    torch.autograd.graph._engine_run_backward = wrapped
    torch.autograd._engine_run_backward = wrapped


# --- factories with device=st.device() ------------------------------------------------------------
_LIB = None
_FACTORIES = ("_copy_from", "empty.memory_format", "empty_strided", "arange", "arange.start", "arange.start_step",
              "_efficientzerotensor",  # autograd's zero gradients (sgn, complex ops): plain zeros here
              "full", "scalar_tensor", "linspace", "eye", "eye.m", "randn", "rand", "randint",
              "randint.low", "randperm", "zeros", "ones", "tril_indices", "triu_indices", "logspace",
              "normal.float_float")


def _register_factories():
    global _LIB
    from shardtensor import dispatch
    from shardtensor.ops import lookup

    aten = torch.ops.aten
    _LIB = torch.library.Library("aten", "IMPL")
    for name in _FACTORIES:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet), overload or "default")
        if name == "_copy_from":
            _LIB.impl(name, _copy_from_kernel, "PrivateUse1")
        elif name in ("empty.memory_format", "empty_strided"):
            _LIB.impl(name, _empty_kernel, "PrivateUse1")
        elif lookup(op) is not None:
            _LIB.impl(name, _factory_kernel(op, dispatch), "PrivateUse1")


def _copy_from_kernel(src, dst, non_blocking=False):
    """``torch.tensor(data, device=st.device())`` copies a CPU tensor into a new device tensor."""
    from shardtensor import dispatch

    # called with Python dispatch excluded (inside torch.tensor()), so go to our handler directly
    return dispatch.handle(torch.ops.aten.copy_.default, (dst, src), {})


def _empty_kernel(size, *args, dtype=None, memory_format=None, **kwargs):
    """``torch.empty``/``empty_strided`` on st.device(): zeros, recorded lazily (no transfer), with the
    strides torch gives (``as_strided`` on the result addresses its storage as torch's would)."""
    from shardtensor import dispatch
    from shardtensor.tensor import ShardedTensor

    out = dispatch.zeros(tuple(size), dtype or torch.get_default_dtype())
    if args:  # empty_strided(size, stride)
        strides = tuple(args[0])
    elif memory_format not in (None, torch.contiguous_format, torch.preserve_format):
        strides = torch.empty(tuple(size), memory_format=memory_format, device="meta").stride()
    else:
        return out
    return ShardedTensor(out._cell, strides=strides)


def _factory_kernel(op, dispatch):
    def kernel(*args, **kwargs):
        return dispatch._record_and_wrap(op, args, kwargs)

    return kernel


def _load_cpp_extension():
    """Build (once per machine, ~1 min, cached by torch) and load the C++ device guard and metadata
    setters; None when it cannot be built (or SHARDTENSOR_PYTHON_DEVICE_GUARD is set)."""
    from torch.utils.cpp_extension import load_inline

    if os.environ.get("SHARDTENSOR_PYTHON_DEVICE_GUARD"):  # for testing the fallback
        return None
    source = (pathlib.Path(__file__).parent / "device_guard.cpp").read_text()
    try:
        return load_inline("shardtensor_device_ext", cpp_sources=[source],
                           functions=["set_geometry", "share_storage", "fresh_storage", "forget_view_replay"])
    except Exception as e:  # no compiler or ninja: fall back to torch's Python guard
        warnings.warn(
            f"shardtensor could not build its C++ extension ({e}); using torch's Python device guard. "
            "Errors raised inside backward() still reach you from ops and tensor hooks, but one "
            "raised by a grad_fn or module backward hook aborts the process (and exit after such an "
            "error may too), and in-place ops that change a tensor's shape (squeeze_, t_, resize_, "
            "set_ ...) are not available. Install a C++ compiler and `pip install ninja` to fix this.",
            RuntimeWarning, stacklevel=2)
        return None


def _install():
    global _DEVICE, CPP_GUARD, EXT
    EXT = _load_cpp_extension()
    CPP_GUARD = EXT is not None
    if CPP_GUARD:
        torch.utils.rename_privateuse1_backend(BACKEND)
        torch.utils.generate_methods_for_privateuse1_backend()
        torch._register_device_module(BACKEND, _BackendModule())
        torch._C._acc.register_python_privateuseone_hook(_DummyPrivateUse1Hook())
    else:
        _setup_privateuseone_for_python_backend(rename=BACKEND, backend_module=_BackendModule())
    _DEVICE = torch.device(BACKEND, 0)
    _install_backward_error_fix()
    _register_factories()


_install()
