"""The torch device: a renamed PrivateUse1 backend, so ``model.to(st.device())`` and
``torch.zeros(..., device=st.device())`` give ShardedTensors (replicated over the mesh; the factory
kernels are ``shardtensor.dispatch.factories``).

Also: ``torch.manual_seed`` reaches shardtensor's key through the backend module, and a C++ device
guard (``device_guard.cpp``) keeps autograd from calling Python while it unwinds an error raised
inside ``backward()`` (see ``backward_errors``).
"""
from __future__ import annotations

import os
import pathlib
import warnings

import torch
from torch.utils.backend_registration import _DummyPrivateUse1Hook, _setup_privateuseone_for_python_backend

from shardtensor.graph import rng
from shardtensor.tensor import backward_errors

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
        rng.manual_seed(seed)

    manual_seed = manual_seed_all

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        """The random key as a CPU uint8 tensor (for ``torch.random.fork_rng`` and friends)."""
        return torch.from_numpy(rng.get_state().view("uint8").copy())

    @staticmethod
    def set_rng_state(state: torch.Tensor, device=None) -> None:
        rng.set_state(state.numpy().view("uint32"))

    get_rng_state_all = staticmethod(lambda: [_BackendModule.get_rng_state()])
    set_rng_state_all = staticmethod(lambda states: _BackendModule.set_rng_state(states[0]))

    @staticmethod
    def get_amp_supported_dtype():
        return [torch.float16, torch.bfloat16]


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
    backward_errors.install()


_install()
