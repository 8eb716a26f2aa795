"""``torch_xla.distributed.xla_multiprocessing`` (``xmp``) under the face: ``spawn`` is ``st.launch``
(one process per device group, outside SPMD mode)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import shardtensor as st
from shardtensor.xla.face import _support


def spawn(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int | None = None,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> Any:
    """Run ``fn(index, *args)`` in ``nprocs`` processes (``st.launch``; ``nprocs=1`` calls ``fn(0, *args)``
    here). Not in SPMD mode, where one process drives every device."""
    if st.is_spmd():
        raise NotImplementedError(
            "xmp.spawn does not support SPMD: one SPMD process drives all its devices (run the function directly)."
        )
    if not join:
        raise NotImplementedError("xmp.spawn(join=False): shardtensor's launch waits for its processes.")
    if nprocs == 1:
        fn(0, *args)
        return None
    return st.launch(fn, args=tuple(args), nprocs=nprocs, start_method=start_method)


MpModelWrapper = _support.unsupported_class(
    "torch_xla.distributed.xla_multiprocessing.MpModelWrapper",
    "processes spawned by st.launch each build their own model (fork-shared CPU weights are not used)",
)
MpSerialExecutor = _support.unsupported_class(
    "torch_xla.distributed.xla_multiprocessing.MpSerialExecutor",
    "run the function in each process, then xm.rendezvous(tag)",
)
