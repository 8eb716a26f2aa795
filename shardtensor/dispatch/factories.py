"""Factory kernels for ``device=st.device()``: ``torch.zeros``, ``arange``, ``randn``, ``empty`` ...
registered for the PrivateUse1 key, so they make ShardedTensors lazily (no host transfer), and
``torch.tensor(data, device=st.device())`` copies host data in."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardtensor.dispatch.entry import handle
from shardtensor.dispatch.record import record_and_wrap, zeros
from shardtensor.dispatch.table import special
from shardtensor.dispatch.view_ops import alias
from shardtensor.graph.state import locked
from shardtensor.ops import lookup
from shardtensor.tensor import ShardedTensor

aten = torch.ops.aten
_FACTORIES = (
    "_copy_from",
    "empty.memory_format",
    "empty_strided",
    "arange",
    "arange.start",
    "arange.start_step",
    "_efficientzerotensor",  # autograd's zero gradients (sgn, complex ops): plain zeros here
    "full",
    "scalar_tensor",
    "linspace",
    "eye",
    "eye.m",
    "randn",
    "rand",
    "randint",
    "randint.low",
    "randperm",
    "zeros",
    "ones",
    "tril_indices",
    "triu_indices",
    "logspace",
    "normal.float_float",
)
# torch's composite one_hot skips its class checks on PrivateUse1 (it relies on a device assert):
# a kernel of our own keeps it one op, whose lowering checks on the device
_CHECKED_COMPOSITES = ("one_hot",)


def _copy_from_kernel(src, dst, non_blocking=False):
    """``torch.tensor(data, device=st.device())`` copies a CPU tensor into a new device tensor."""
    # called with Python dispatch excluded (inside torch.tensor()), so go to our handler directly
    return handle(aten.copy_.default, (dst, src), {})


# what a fresh device tensor becomes while Dynamo traces, or None; set by the torch.compile backend
_TRACED_FRESH: Callable[[ShardedTensor], torch.Tensor | None] | None = None


def set_traced_fresh(hook: Callable[[ShardedTensor], torch.Tensor | None] | None) -> None:
    """Install ``hook(t)``: the value ``torch.tensor(data, device=st.device())`` gives instead of the
    real ``t`` while Dynamo traces (None: ``t`` itself). torch makes that tensor with Python dispatch
    excluded, so its device kernels run for real even under Dynamo's fake mode; the tensor passes
    through ``aten.lift_fresh`` just after, with dispatch back on.

    Example: ``set_traced_fresh(lambda t: None)`` (the torch.compile backend installs its own).
    """
    global _TRACED_FRESH
    _TRACED_FRESH = hook


@special(aten.lift_fresh.default)
def _lift_fresh(func, args, kwargs):
    t = args[0]
    if _TRACED_FRESH is not None:
        traced = _TRACED_FRESH(t)
        if traced is not None:
            return traced
    return alias(func, args, kwargs)


@locked  # an engine entry like the dispatch entry: torch calls these kernels directly
def _empty_kernel(size, *args, dtype=None, memory_format=None, **kwargs):
    """``torch.empty``/``empty_strided`` on st.device(): zeros, recorded lazily (no transfer), with the
    strides torch gives (``as_strided`` on the result addresses its storage as torch's would)."""
    out = zeros(tuple(size), dtype or torch.get_default_dtype())
    if args:  # empty_strided(size, stride)
        strides = tuple(args[0])
    elif memory_format not in (None, torch.contiguous_format, torch.preserve_format):
        strides = torch.empty(tuple(size), memory_format=memory_format, device="meta").stride()
    else:
        return out
    return ShardedTensor(out._cell, strides=strides)


def _factory_kernel(op):
    @locked
    def kernel(*args, **kwargs):
        return record_and_wrap(op, args, kwargs)

    return kernel


def register_factory_kernels(dispatch_key: str = "PrivateUse1") -> torch.library.Library:
    """Register the factory kernels for ``dispatch_key`` and return the ``Library`` holding them
    (the registrations last until its ``_destroy()``). ``"PrivateUse1"`` is st.device()'s own key,
    registered at import; another backend's key (``"XLA"``) makes ``torch.zeros(..., device='xla')``
    give a ShardedTensor on st.device() (``shardtensor.device_alias``).

    Example: ``lib = register_factory_kernels("XLA"); ...; lib._destroy()``.
    """
    lib = torch.library.Library("aten", "IMPL")
    for name in _FACTORIES:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet), overload or "default")
        if name == "_copy_from":
            lib.impl(name, _copy_from_kernel, dispatch_key)
        elif name in ("empty.memory_format", "empty_strided"):
            lib.impl(name, _empty_kernel, dispatch_key)
        elif lookup(op) is not None:
            lib.impl(name, _factory_kernel(op), dispatch_key)
    for name in _CHECKED_COMPOSITES:
        lib.impl(name, _factory_kernel(getattr(aten, name).default), dispatch_key)
    return lib


_LIB = register_factory_kernels()  # kept: the registrations last as long as the Library object
