"""``torch_xla.experimental`` under the face: eager mode (``st.eager_mode``), FSDPv2, Pallas kernels and
distributed checkpoints."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import shardtensor as st
from shardtensor.xla.face import _support


def eager_mode(enable: bool) -> None:
    """Run each op at once (``st.eager_mode``); ``torch_xla.compile`` functions are still compiled whole."""
    st.eager_mode(bool(enable))


def is_eager_mode() -> bool:
    return st.is_eager_mode()


@contextlib.contextmanager
def eager_mode_context(enable: bool) -> Iterator[bool]:
    """Eager mode on or off inside the block; yields the mode it had before."""
    before = st.is_eager_mode()
    st.eager_mode(bool(enable))
    try:
        yield before
    finally:
        st.eager_mode(before)


from shardtensor.xla.face.experimental import (  # noqa: E402,F401
    custom_kernel,
    distributed_checkpoint,
    spmd_fully_sharded_data_parallel,
)

__getattr__ = _support.module_getattr(
    "torch_xla.experimental",
    {
        "scan": "use a Python loop over the layers (st.compile traces it into one program)",
        "scan_layers": "use a Python loop over the layers (st.compile traces it into one program)",
        "fori_loop": "use a Python loop (st.compile traces it into one program)",
        "assume_pure": "st.compile already replays a traced function without its Python while that is sound",
    },
)
