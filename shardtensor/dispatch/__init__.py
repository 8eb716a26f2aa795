"""L5, what ``__torch_dispatch__`` does with one aten op: recording (``record``), output metadata
(``meta``), views (``view_ops``), in-place and ``out=`` (``mutation``), the declared special handlers
(``table``, filled by ``host``, ``nested``, ``reshape_inplace``, ``fused_attention``, and ``c10d_ops`` and
``functional_collectives`` for torch.distributed's collectives, with ``collectives``), and the factory kernels
(``factories``).
Importing it installs the handler into ``ShardedTensor``."""

from shardtensor.dispatch import (  # noqa: F401  (fill the tables)
    c10d_ops,
    factories,
    functional_collectives,
    fused_attention,
    host,
    nested,
    reshape_inplace,
)
from shardtensor.dispatch.entry import handle  # noqa: F401
from shardtensor.dispatch.record import record_and_wrap, zeros  # noqa: F401
from shardtensor.dispatch.table import SPECIAL, special  # noqa: F401
