"""``torch_xla.amp`` under the face: ``autocast`` on shardtensor's device (see ``autocast_device_type``)."""

from __future__ import annotations

from typing import Any

import torch

import shardtensor as st
from shardtensor.xla.face import _support


def autocast_device_type() -> str:
    """The device type ``torch.autocast('xla', ...)`` means under the face: st.device()'s.

    Example: ``torch.autocast(autocast_device_type(), dtype=torch.bfloat16)``.
    """
    return st.device().type


def autocast(
    device: Any = None, enabled: bool = True, dtype: torch.dtype | None = None, cache_enabled: bool | None = None
) -> torch.autocast:
    """PyTorch/XLA's ``autocast(device, enabled=True, dtype=None, cache_enabled=None)``: torch's autocast on
    shardtensor's device (bfloat16 by default, as PyTorch/XLA on TPU)."""
    _support.as_st_device(device)
    return torch.autocast(
        autocast_device_type(), dtype=dtype or torch.bfloat16, enabled=enabled, cache_enabled=cache_enabled
    )


__getattr__ = _support.module_getattr(
    "torch_xla.amp",
    {
        "syncfree": "use torch.optim's optimizers (shardtensor reads no found-inf flag on the host)",
        "GradScaler": "use torch.amp.GradScaler, or train in bfloat16, which needs no loss scaling",
    },
)
