"""PyTorch/XLA code as written, on shardtensor: a ``torch_xla``-shaped face over shardtensor's public API.

Opt-in only. ``python -m shardtensor.xla script.py [args]`` runs a script with ``import torch_xla``
(and ``torch_xla.core.xla_model``, ``torch_xla.distributed.spmd``, ``torch_xla.runtime`` ...) resolving
to the face; ``shardtensor.xla.install()`` does the same inside a process (a notebook, a pytest
``conftest.py``). Under it, ``'xla'`` devices mean ``st.device()`` (``st.alias_device("xla")``),
``torch.compile(..., backend="openxla")`` means shardtensor's backend and ``torch.autocast("xla")``
shardtensor's device. Without either, nothing changes; if a real torch_xla is importable, both refuse.
What each name does, and which raise saying why: ``docs/xla.md``.

Example::

    import shardtensor.xla
    shardtensor.xla.install()
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    mesh = xs.Mesh(range(xr.global_runtime_device_count()), (8,), ("data",))
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import pkgutil
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

import shardtensor as st

__all__ = ["install", "uninstall", "installed", "TorchXlaPresentError"]

_FACE = "shardtensor.xla.face"
_NAME = "torch_xla"
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


class TorchXlaPresentError(RuntimeError):
    """A real torch_xla is importable: the face never shadows it."""


def installed() -> bool:
    """Whether the face is installed in this process (``import torch_xla`` gives it).

    Example: ``shardtensor.xla.installed()`` is False until ``install()``.
    """
    return bool(_STATE)


def _real_torch_xla() -> str | None:
    """Where a real torch_xla is (in sys.modules or on the path), or None."""
    present = sys.modules.get(_NAME)
    if present is not None and not getattr(present, "__name__", "").startswith(_FACE):
        return getattr(present, "__file__", None) or repr(present)
    try:
        spec = importlib.util.find_spec(_NAME)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return spec.origin or ", ".join(spec.submodule_search_locations or []) or _NAME


# modules of PyTorch/XLA the face leaves out on purpose, and what to use instead
_ABSENT_MODULES = {
    "torch_xla.experimental.scan": "use a Python loop over the layers (st.compile traces it into one program)",
    "torch_xla.experimental.scan_layers": "use a Python loop over the layers (st.compile traces it into one program)",
    "torch_xla.experimental.fori_loop": "use a Python loop (st.compile traces it into one program)",
    "torch_xla.test": "PyTorch/XLA's test harness; use print and torch.utils.tensorboard directly",
    "torch_xla.core.xla_builder": "PyTorch/XLA's HLO builder; write the computation with torch ops or st.call_jax",
    "torch_xla.stablehlo": "use st.export(fn, *args).mlir_text() for StableHLO",
    "torch_xla.core.dynamo_bridge": "torch.compile(backend='openxla') runs shardtensor's Dynamo backend",
}


class _MissingTorchXlaModules(importlib.abc.MetaPathFinder):
    """``import torch_xla.<name>`` for a module the face does not have: a ModuleNotFoundError that says so."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == _NAME or name.startswith(_NAME + "."):
            why = next((w for m, w in _ABSENT_MODULES.items() if name == m or name.startswith(m + ".")), None)
            raise ModuleNotFoundError(
                f"No module named {name!r}: shardtensor's torch_xla face does not provide it"
                + (
                    f": {why}."
                    if why
                    else " (see docs/xla.md for what it has, and shardtensor's own API for the rest)."
                ),
                name=name,
            )
        return None


def install() -> None:
    """Make ``import torch_xla`` (and its submodules) give shardtensor's face, ``'xla'`` devices mean
    ``st.device()``, ``torch.compile(backend="openxla")`` shardtensor's backend and
    ``torch.autocast("xla")`` shardtensor's device, in this process. A second call does nothing.
    Raises ``TorchXlaPresentError`` if a real torch_xla is importable (the face never shadows it).

    Example::

        shardtensor.xla.install()
        import torch_xla
        torch_xla.device()   # st.device()
    """
    with _LOCK:
        if _STATE:
            return
        real = _real_torch_xla()
        if real is not None:
            raise TorchXlaPresentError(
                f"a real torch_xla is importable here ({real}); shardtensor's torch_xla face never shadows it. "
                "Run the script with torch_xla itself, or in an environment without it to run it on shardtensor."
            )
        undo: list[Callable[[], None]] = []
        try:
            _install(undo)
        except BaseException:
            for step in reversed(undo):
                step()
            raise
        _STATE["undo"] = undo


def _install(undo: list[Callable[[], None]]) -> None:
    alias = st.alias_device("xla")
    undo.append(alias.remove)

    face = importlib.import_module(_FACE)
    names = [_FACE] + [
        m.name for m in pkgutil.walk_packages(face.__path__, _FACE + ".") if m.name.rsplit(".", 1)[-1] != "_support"
    ]
    aliased = []
    for module_name in names:
        module = importlib.import_module(module_name)
        public = _NAME + module_name[len(_FACE) :]
        sys.modules[public] = module
        aliased.append(public)
    undo.append(lambda: _forget_modules(aliased))

    finder = _MissingTorchXlaModules()
    sys.meta_path.insert(0, finder)
    undo.append(lambda: sys.meta_path.remove(finder) if finder in sys.meta_path else None)

    from shardtensor.xla.face.distributed import xla_backend

    xla_backend.register()
    undo.append(xla_backend.unregister)

    original_compile = torch.compile
    torch.compile = _openxla_compile(original_compile)
    undo.append(lambda: setattr(torch, "compile", original_compile))

    autocast = torch.amp.autocast_mode.autocast
    original_init = autocast.__init__
    autocast.__init__ = _xla_autocast_init(original_init)  # type: ignore[method-assign]
    undo.append(lambda: setattr(autocast, "__init__", original_init))

    from shardtensor.xla.face import _support

    if _support.env_flag("XLA_USE_EAGER_DEBUG_MODE"):  # PyTorch/XLA turns eager mode on at import
        st.eager_mode(True)


def _forget_modules(names: list[str]) -> None:
    for name in names:
        sys.modules.pop(name, None)


def uninstall() -> None:
    """Undo ``install()``: ``torch_xla`` is no longer importable, ``'xla'`` devices are torch's again,
    torch.compile and autocast are torch's own (for tests and notebooks; tensors made under the face
    stay valid on ``st.device()``).

    Example: ``shardtensor.xla.uninstall()``.
    """
    with _LOCK:
        undo = _STATE.pop("undo", None)
        if undo is None:
            return
        for step in reversed(undo):
            step()


_OPENXLA = ("openxla", "openxla_eval")


def _openxla_compile(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch.compile with ``backend="openxla"`` (PyTorch/XLA's Dynamo backend) meaning shardtensor's."""

    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") in _OPENXLA:
            kwargs["backend"] = "shardtensor"
        return original(*args, **kwargs)

    return compile


def _xla_autocast_init(original: Callable[..., None]) -> Callable[..., None]:
    """torch.autocast's ``__init__`` with device type ``'xla'`` meaning shardtensor's device (bfloat16
    unless told: torch's default autocast dtype for 'xla', not for shardtensor's device type)."""

    @functools.wraps(original)
    def __init__(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        if device_type == "xla":
            from shardtensor.xla.face.amp import autocast_device_type

            device_type = autocast_device_type()
            if not args and kwargs.get("dtype") is None:
                kwargs["dtype"] = torch.bfloat16
        original(self, device_type, *args, **kwargs)

    return __init__


def _main_module_spec() -> importlib.machinery.ModuleSpec:
    """The spec a script's main module gets under ``python -m shardtensor.xla``: processes spawned from
    it (``torch_xla.launch``) then run ``shardtensor.xla._mp_main``, which installs the face before the
    script's top level runs there."""
    return importlib.machinery.ModuleSpec("shardtensor.xla._mp_main", None)
