"""The torch device: a renamed PrivateUse1 backend, so ``model.to(st.device())`` and
``torch.zeros(..., device=st.device())`` give ShardedTensors (replicated over the mesh; the factory
kernels are ``shardtensor.dispatch.factories``).

Also: ``torch.manual_seed`` reaches shardtensor's key through the backend module, and a C++ device
guard (``device_guard.cpp``) keeps autograd from calling Python while it unwinds an error raised
inside ``backward()`` (see ``backward_errors``) and answers torch's choice of backend for
``F.scaled_dot_product_attention`` on the device ("overrideable": one op, ``ops/fused_attention.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import pathlib
import shutil
import sys
import time
import warnings

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from shardtensor import runtime
from shardtensor.graph import modes, rng
from shardtensor.tensor import backward_errors

BACKEND = "shardtensor"
_DEVICE: torch.device = None  # type: ignore[assignment]  # set by the install at import, below
CPP_GUARD = False  # True once the C++ device guard is loaded (the normal case)
EXT = None  # the C++ module (device_guard.cpp): set_geometry, share_storage, fresh_storage, forget_view_replay


def device(index: int | None = None) -> torch.device:
    """The one logical torch device that stands for the whole mesh (SPMD style).

    Example::

        model = torch.nn.Linear(4, 4).to(st.device())
    """
    return _DEVICE


def devices() -> list[torch.device]:
    """The devices of this process as torch sees them: ``[st.device()]`` in SPMD mode (PyTorch/XLA's
    ``torch_xla.devices()``). For the physical devices a mesh is built over, see `xla_devices`.

    Example::

        st.devices()   # [device(type='shardtensor', index=0)]
    """
    return [_DEVICE]


def xla_devices() -> list:
    """Every physical device of the job (all processes) in global order, as JAX devices: what a
    `Mesh` is built over, so ``st.Mesh(st.xla_devices(), (8,))`` spans them all (PyTorch/XLA's
    ``Mesh(xm.xla_devices(), ...)``). Tensors go to the one logical device, `device`.

    Example::

        mesh = st.Mesh(st.xla_devices(), (8,), ("data",))   # same as st.Mesh(range(8), ...)
    """
    return runtime.jax_devices()


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
        """True in a process forked after JAX started (a DataLoader worker): torch then skips seeding
        the device there, which would wait forever on JAX threads the fork did not copy."""
        return runtime.forked_after_start()

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

    # Streams: shardtensor runs programs in the order they are issued, on one logical stream. torch's
    # tools that overlap copies with streams (distributed checkpoint writers) only need it to exist.
    @staticmethod
    def current_stream(device=None) -> Stream:
        return Stream()

    default_stream = current_stream

    @staticmethod
    def stream(stream=None):
        return contextlib.nullcontext(stream)

    @staticmethod
    def synchronize(device=None) -> None:
        """Compute everything pending and wait for it (``st.sync(wait=True)``)."""
        modes.sync(wait=True)


class Stream:
    """shardtensor's one logical stream, as torch's stream-aware tools see it.

    Programs run in the order they are issued, so waiting on another stream is a no-op and
    ``synchronize`` waits for every pending value.

    Example::

        torch.shardtensor.current_stream().synchronize()   # like torch.cuda.current_stream().synchronize()
    """

    def __init__(self, device=None, priority: int = 0):
        self.device = _DEVICE
        self.device_type = BACKEND
        self.priority = priority

    def synchronize(self) -> None:
        modes.sync(wait=True)

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream)

    def __hash__(self) -> int:
        return hash(Stream)

    def __repr__(self) -> str:
        return f"<shardtensor Stream device={BACKEND}:0>"


_SOURCE = pathlib.Path(__file__).parent / "device_guard.cpp"
# what it includes (one unit): a change to any of them is a new module
_SOURCES = (
    _SOURCE,
    _SOURCE.with_name("replay_guard.h"),
    _SOURCE.with_name("replay_passes.h"),
    _SOURCE.with_name("replay_state.h"),
)


def _source_bytes() -> bytes:
    """The module's sources, device_guard.cpp and what it includes, as one (setup.py reads the same)."""
    return b"".join(path.read_bytes() for path in _SOURCES)


def _source_id(source: bytes) -> int:
    """What the module is built from, compiled into it as SOURCE_ID (setup.py computes the same)."""
    return int(hashlib.sha256(source).hexdigest()[:16], 16)


def _extension_name(source: str) -> str:
    """The build's name: one per source, torch and Python version, so two environments (or two
    checkouts) on one machine each keep their own build in torch's extension cache instead of
    rebuilding each other's."""
    key = f"{source}\0{torch.__version__}\0{sys.version}"
    return f"shardtensor_device_ext_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _ninja_dir():
    """Where ninja is when it is not on PATH: the venv's python run by absolute path (venv not
    activated) still finds the ``ninja`` package's binary, or the one beside the interpreter."""
    if shutil.which("ninja"):
        return None
    candidates = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the PyPI package, a declared dependency

        candidates.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    return next((d for d in candidates if os.access(os.path.join(d, "ninja"), os.X_OK)), None)


@contextlib.contextmanager
def _ninja_on_path():
    extra = _ninja_dir()
    if extra is None:
        yield
        return
    old = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([extra] + ([old] if old else []))
    try:
        yield
    finally:  # (the build's subprocesses read PATH; the process keeps the user's)
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


def _prebuilt_extension():
    """The C++ module built with the package (``setup.py``), and why it cannot be used if it cannot:
    ``(module, None)`` or ``(None, reason)``."""
    try:  # (through sys.modules, so a test can stand in another module)
        _device_ext = importlib.import_module("shardtensor.tensor._device_ext")
    except ModuleNotFoundError:  # not built: a source checkout, or no compiler when it was installed
        return None, "no prebuilt module"
    except ImportError as e:  # built against another torch's libraries (undefined symbol ...)
        first_line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        return None, f"the prebuilt module does not load: {first_line[:120]}"
    # (loading it registered nothing, register_backend does: a module that does not fit is simply unused)
    built_for, running = _device_ext.TORCH_VERSION, torch.__version__.split("+")[0]
    if built_for != running:
        return None, f"the prebuilt module is for torch {built_for}, this is torch {running}"
    built_from, source = _device_ext.SOURCE_ID, _source_id(_source_bytes())
    if built_from != source:  # an editable install, then a new device_guard.cpp
        return None, "the prebuilt module is older than device_guard.cpp"
    return _device_ext, None


def _load_cpp_extension():
    """The C++ device guard and metadata setters: the module built with the package, else one built
    here the first time in this environment (10-30 s, said on stderr); None when it cannot be built
    (one-line warning) or SHARDTENSOR_PYTHON_DEVICE_GUARD is set."""
    if os.environ.get("SHARDTENSOR_PYTHON_DEVICE_GUARD"):  # for testing the fallback
        return None
    ext, why_not = _prebuilt_extension()
    return ext if ext is not None else _build_cpp_extension(why_not)


def _build_cpp_extension(why_not_prebuilt: str):
    """Build (or load from torch's extension cache) the module from ``device_guard.cpp``."""
    from torch.utils import cpp_extension

    name = _extension_name(_source_bytes().decode())
    try:
        build_dir = cpp_extension._get_build_directory(name, verbose=False)
        building = not os.path.exists(os.path.join(build_dir, f"{name}.so"))
        if building:
            print(
                f"shardtensor: building its C++ device extension ({why_not_prebuilt}), once per environment "
                "(10-30 s) ...",
                file=sys.stderr,
                flush=True,
            )
        start = time.monotonic()
        with _ninja_on_path():
            ext = cpp_extension.load(
                name,
                sources=[str(_SOURCE)],
                extra_cflags=[f"-DSHARDTENSOR_SOURCE_ID={_source_id(_source_bytes()):#x}ULL"],
            )
        if building:
            print(
                f"shardtensor: built in {time.monotonic() - start:.0f} s (kept in {build_dir})",
                file=sys.stderr,
                flush=True,
            )
        return ext
    except Exception as e:  # noqa: BLE001  (no compiler or ninja, a failed build: torch's Python guard)
        first_line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        warnings.warn(
            f"shardtensor could not build its C++ extension ({first_line[:160]}); using torch's Python "
            "device guard: an error raised by a grad_fn or module backward hook aborts the process, "
            "in-place ops that change a tensor's shape (squeeze_, t_, resize_, set_ ...) and pinned-memory "
            "DataLoaders are not available. Install a C++ compiler and `pip install ninja` to fix this "
            "(or reinstall shardtensor with one).",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _install():
    global _DEVICE, CPP_GUARD, EXT
    EXT = _load_cpp_extension()
    CPP_GUARD = EXT is not None
    if CPP_GUARD:
        EXT.register_backend()  # the C++ device guard and torch's hooks for PrivateUse1
        torch.utils.rename_privateuse1_backend(BACKEND)
        torch.utils.generate_methods_for_privateuse1_backend()
        torch._register_device_module(BACKEND, _BackendModule())
    else:
        _setup_privateuseone_for_python_backend(rename=BACKEND, backend_module=_BackendModule())
    _DEVICE = torch.device(BACKEND, 0)
    backward_errors.install()


_install()
