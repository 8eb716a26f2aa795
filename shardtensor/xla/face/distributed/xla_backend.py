"""``torch_xla.distributed.xla_backend`` under the face: importing it makes ``init_method='xla://'``
work for ``dist.init_process_group`` (rank and world size from shardtensor's processes), and the
``'xla'`` backend is shardtensor's (registered by ``import shardtensor``), refused under SPMD as in
PyTorch/XLA (use a CPU process group such as gloo)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import shardtensor as st


def _xla_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any) -> Iterator[tuple]:
    rank, world = st.process_index(), st.process_count()
    if world == 1:
        yield dist.HashStore(), rank, world
        return
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "12355"))
    store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout)
    yield store, rank, world


def register() -> None:
    """Register ``xla://`` (``shardtensor.xla.install`` does; PyTorch/XLA does it at import)."""
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    if handlers.get("xla") is not _xla_rendezvous:
        handlers.pop("xla", None)
        dist.register_rendezvous_handler("xla", _xla_rendezvous)


def unregister() -> None:
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    if handlers.get("xla") is _xla_rendezvous:
        del handlers["xla"]
