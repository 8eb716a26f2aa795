"""``torch_xla.utils.serialization`` (``xser``) under the face: ``st.serialization``'s ``save`` / ``load``
(each tensor copied to the host on its own, one file per tensor beside the structure)."""

from __future__ import annotations

import os
from typing import Any

import shardtensor as st

TensorReference = st.serialization.TensorReference


def save(data: Any, path: str | os.PathLike, master_only: bool = True, global_master: bool = False) -> None:
    """Save ``data`` (tensors on the device or the host, nested in lists, tuples and dicts) at ``path``,
    streaming the tensors to the host one at a time; only the master process writes unless
    ``master_only=False``."""
    st.serialization.save(data, path, master_only=master_only or global_master)


def load(path: str | os.PathLike) -> Any:
    """What ``save`` wrote, with CPU tensors."""
    return st.serialization.load(path)
