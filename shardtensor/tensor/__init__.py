"""L4, the torch face of a value: the torch device and its C++ guard (``device``), ``torch.autocast`` on
it (``autocast``), errors raised in backward (``backward_errors``), ``ShardedTensor`` (``sharded``),
readback to the host (``readback``), uploads (``upload``) and torch geometry (``geometry``)."""

import warnings
from typing import Any

from shardtensor.tensor.sharded import LocalShard, ShardedTensor  # noqa: F401


def _register_foreach_type() -> None:
    """torch's optimizers take their multi-tensor (``foreach``) path only for tensor types on its list,
    as torch.distributed.tensor does for DTensor: with ShardedTensor there, a default Adam/AdamW/SGD
    records one ``_foreach_*`` op per step stage instead of one op per parameter per stage (less host
    time per lazy step); code without ShardedTensors is unaffected."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    lists: tuple[list, ...] = (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types)
    for types in lists:
        if ShardedTensor not in types:
            types.append(ShardedTensor)


_register_foreach_type()


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
