"""L5, what ``__torch_dispatch__`` does with one aten op: recording (``record``), output metadata
(``meta``), views (``view_ops``), in-place and ``out=`` (``mutation``), the declared special handlers
(``table``, filled by ``host``, ``nested``, ``reshape_inplace`` and ``collectives``, torch.distributed's), and
the factory kernels (``factories``).
Importing it installs the handler into ``ShardedTensor``."""

from shardtensor.dispatch import collectives, factories, host, nested, reshape_inplace  # noqa: F401  (fill the tables)
from shardtensor.dispatch.entry import handle  # noqa: F401
from shardtensor.dispatch.record import record_and_wrap, zeros  # noqa: F401
from shardtensor.dispatch.table import SPECIAL, special  # noqa: F401
