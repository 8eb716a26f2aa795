"""L4, the torch face of a value: the torch device and its C++ guard (``device``), errors raised in
backward (``backward_errors``), ``ShardedTensor`` (``sharded``), readback to the host (``readback``),
uploads (``upload``) and torch geometry (``geometry``)."""

from shardtensor.tensor.sharded import Shard, ShardedTensor  # noqa: F401
