"""``torch_xla._internal.tpu`` under the face: ``version()``, the TPU generation (4 for v4, 5 for v5e
and v5p, 6 for v6e), read from the device kind PJRT reports; EnvironmentError off a TPU, as PyTorch/XLA
raises when it finds no TPU metadata."""

from __future__ import annotations

import re

import shardtensor as st


def version() -> int:
    kind = str(st.global_runtime_device_attributes()[0]["device_kind"])
    match = re.search(r"TPU v?(\d+)", kind, re.IGNORECASE)
    if not match:
        raise OSError(f"Failed to get TPU metadata: the devices are {kind!r}, not TPUs")
    return int(match.group(1))
