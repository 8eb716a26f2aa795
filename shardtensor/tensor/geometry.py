"""A tensor's torch geometry (shape, strides, storage offset) apart from its values."""

from __future__ import annotations

import torch

from shardtensor.graph.views import contiguous_strides  # noqa: F401  (re-exported: a tensor's geometry)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with the shape, dtype, strides and storage offset of ``t``.

    Example: ``meta_like(x.t()).stride() == x.t().stride()``.
    """
    shape, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
    size = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if all(shape) else offset
    storage = torch.empty(max(size, 0), dtype=t.dtype, device="meta")
    return storage.as_strided(shape, stride, offset)
