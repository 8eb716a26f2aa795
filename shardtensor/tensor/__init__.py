"""L4, the torch face of a value: the torch device and its C++ guard (``device``), errors raised in
backward (``backward_errors``), ``ShardedTensor`` (``sharded``), readback to the host (``readback``),
uploads (``upload``) and torch geometry (``geometry``)."""

import warnings
from typing import Any

from shardtensor.tensor.sharded import LocalShard, ShardedTensor  # noqa: F401


def __getattr__(name: str) -> Any:
    # the old name of LocalShard, kept for a while: st.Shard is now DTensor's placement
    if name == "Shard":
        warnings.warn(
            "shardtensor.tensor.Shard was renamed LocalShard (st.Shard is now DTensor's placement)",
            DeprecationWarning,
            stacklevel=2,
        )
        return LocalShard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
