"""Another torch device type as a name for ``st.device()``: after ``st.alias_device("xla")``,
``torch.zeros(..., device="xla")``, ``t.to("xla")``, ``torch.tensor(data, device="xla")`` and
``model.to("xla")`` give tensors on ``st.device()`` (what ``python -m shardtensor.xla`` uses).

torch reserves some device types for backends that are not installed (``xla`` for torch_xla): torch
knows the name, but has no kernels and no device guard for it. shardtensor's own device is torch's
PrivateUse1 type, renamed, so a reserved type cannot become it; the alias works at the two places
where torch lets such a device in:

- factories (``torch.zeros``, ``ones``, ``randn``, ``empty``, ``full``, ``arange``, ``eye``,
  ``new_zeros``, ``*_like(..., device=)``): shardtensor's factory kernels, registered for the type's
  dispatch key, make the tensor on ``st.device()``. Only calls that name the type run them: no other op
  pays anything;
- conversions, whose C++ needs the type's device guard (``Tensor.to``, ``torch.tensor``,
  ``torch.as_tensor``, ``torch.asarray``, ``Tensor.new_tensor``): wrapped in Python so that a device of
  the type becomes ``st.device()`` before torch sees it. They are still torch's functions, so autograd,
  ``nn.Module.to`` and optimizers behave as with ``st.device()``; the check costs well under a
  microsecond per call (``bench/xla_device_alias.py``).

The tensors are on ``st.device()`` and say so (``t.device``): compare devices with the device a
script got from the same place (``torch_xla.device()`` under the face gives ``st.device()``), not with
the literal ``torch.device("xla")``. Inside ``torch.compile``, Dynamo traces ``Tensor.to`` itself, so
move tensors to the device outside the compiled function.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from shardtensor.dispatch.factories import register_factory_kernels
from shardtensor.tensor.device import device as st_device

# the conversions whose C++ needs a device guard of the target type: (owner, name, positional index
# of `device` when it may be positional, else None)
_CONVERSIONS: tuple[tuple[Any, str, int | None], ...] = (
    (torch.Tensor, "to", 0),
    (torch.Tensor, "new_tensor", None),
    (torch, "tensor", None),
    (torch, "as_tensor", None),
    (torch, "asarray", None),
)
_ALIASES: dict[str, DeviceAlias] = {}
_LOCK = threading.Lock()


class DeviceAlias:
    """An active alias (``st.alias_device``): ``remove()`` undoes it.

    Example::

        alias = st.alias_device("xla")
        torch.ones(2, device="xla").device   # st.device()
        alias.remove()
    """

    def __init__(self, device_type: str, library: torch.library.Library, originals: list) -> None:
        self.device_type = device_type
        self._library: torch.library.Library | None = library
        self._originals = originals

    def remove(self) -> None:
        """Give torch its own functions and kernels back (a second call does nothing).

        Example: ``alias.remove()``.
        """
        with _LOCK:
            if self._library is None:
                return
            for owner, name, original in reversed(self._originals):
                setattr(owner, name, original)
            self._library._destroy()
            self._library = None
            _ALIASES.pop(self.device_type, None)

    @property
    def active(self) -> bool:
        """Whether the alias is in effect.

        Example: ``st.alias_device("xla").active`` is True.
        """
        return self._library is not None

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<DeviceAlias {self.device_type!r} -> {st_device()} ({state})>"


def alias_device(device_type: str) -> DeviceAlias:
    """Make torch's device type ``device_type`` (a reserved type whose backend is not installed, such
    as ``"xla"``) mean ``st.device()`` in this process, until ``.remove()`` of the returned handle.

    Factories given such a device (``torch.zeros(..., device="xla")``, ``"xla:0"`` or
    ``torch.device("xla")``) make ShardedTensors, and ``Tensor.to``, ``torch.tensor``,
    ``torch.as_tensor``, ``torch.asarray`` and ``Tensor.new_tensor`` move data to ``st.device()``; so
    does ``nn.Module.to("xla")``. The tensors report ``st.device()`` as their device. Refuses a type
    torch can already run (``cpu``, shardtensor's own, or one with a guard installed) and a second
    alias of the same type.

    Example::

        alias = st.alias_device("xla")
        model = torch.nn.Linear(4, 2).to("xla")      # parameters on st.device()
        x = torch.randn(8, 4).to("xla")
        alias.remove()
    """
    if not isinstance(device_type, str) or ":" in device_type:
        raise ValueError(f"alias_device takes a device type such as 'xla', got {device_type!r}.")
    own = st_device().type
    if device_type in ("cpu", "meta", own):
        raise ValueError(f"alias_device({device_type!r}): {device_type!r} is a device torch runs itself.")
    try:
        key = torch._C._dispatch_key_for_device(device_type)
    except RuntimeError as e:
        raise ValueError(f"alias_device({device_type!r}): not a torch device type ({e}).") from None
    with _LOCK:
        if device_type in _ALIASES:
            raise ValueError(f"alias_device({device_type!r}): already aliased (remove() that alias first).")
        if _has_guard(device_type):
            raise ValueError(
                f"alias_device({device_type!r}): torch already has a backend for {device_type!r} devices in this "
                "process (its device guard is installed), so its name cannot mean st.device()."
            )
        library = register_factory_kernels(key)
        originals = []
        for owner, name, position in _CONVERSIONS:
            original = getattr(owner, name)
            originals.append((owner, name, original))
            setattr(owner, name, _mapping_device(original, device_type, position))
        alias = _ALIASES[device_type] = DeviceAlias(device_type, library, originals)
    return alias


def _has_guard(device_type: str) -> bool:
    """Whether torch has a device guard for this type (its backend is loaded): a device query of
    the type then answers instead of raising "PyTorch is not linked with support for ... devices"."""
    try:
        torch.empty(0).to(device_type)
    except RuntimeError as e:
        return "not linked with support" not in str(e)
    return True


def _is_aliased(value: Any, device_type: str) -> bool:
    if isinstance(value, str):
        return value == device_type or value.startswith(device_type + ":")
    return isinstance(value, torch.device) and value.type == device_type


def _mapping_device(original: Callable, device_type: str, position: int | None) -> Callable:
    """``original`` with a ``device`` of ``device_type`` (keyword, or positional at ``position``
    after ``self``) replaced by st.device()."""

    @functools.wraps(original)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        if position is not None and len(args) > position + 1 and _is_aliased(args[position + 1], device_type):
            args = (*args[: position + 1], st_device(), *args[position + 2 :])
        if "device" in kwargs and _is_aliased(kwargs["device"], device_type):
            kwargs["device"] = st_device()
        return original(*args, **kwargs)

    mapped.__wrapped_by_alias__ = device_type  # type: ignore[attr-defined]
    return mapped
