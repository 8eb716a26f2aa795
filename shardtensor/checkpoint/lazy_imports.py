"""What a process's first checkpoint save or load imports lazily, imported whole first.

DCP (``torch.distributed.checkpoint``, ~0.8 s), fsspec and torch's serialization helpers are imported
by the first save or load, not by ``import shardtensor``. A Ctrl-C in the middle of those imports
would leave them half imported and every later save and load of the process failing
(``graph.interrupts``): each entry (``save``, ``load``, ``CheckpointManager``) imports them first, with
SIGINT held back until they are all there.

Example::

    import_dcp()   # then dcp.save / dcp.load import nothing more
"""

from __future__ import annotations

from shardtensor.graph.interrupts import import_whole

# the roots of what a first save, load and CheckpointManager call import (the rest comes with them)
DCP_IMPORTS = (
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint._fsspec_filesystem",  # (fsspec: DCP's storage lookup, the checksums)
    "fsspec.implementations.local",
    "fsspec.implementations.chained",
    "torch.utils.serialization",
    "jax.experimental.multihost_utils",
    "shardtensor.checkpoint.planner",
)


def import_dcp() -> None:
    """Import ``DCP_IMPORTS`` whole (nothing to do once they are imported).

    Example::

        import_dcp()
    """
    import_whole(*DCP_IMPORTS)
