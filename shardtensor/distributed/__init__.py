"""Jobs of several processes: starting them (`launch`), host values across them (`rendezvous`,
`mesh_reduce`), device values across them (`all_reduce`, `all_gather`, ...: PyTorch/XLA's
collectives), data parallelism (`optimizer_step`), and torch.distributed's process group of such a
job (backend "shardtensor").

Example::

    import shardtensor as st
    results = st.launch(train, args=(config,), nprocs=2)   # train(index, config) in 2 processes
"""

from shardtensor.distributed.collectives import (
    REDUCE_AND,
    REDUCE_MAX,
    REDUCE_MIN,
    REDUCE_MUL,
    REDUCE_OR,
    REDUCE_SUM,
    all_gather,
    all_reduce,
    all_to_all,
    collective_permute,
    reduce_scatter,
)
from shardtensor.distributed.data_parallel import optimizer_step, reduce_gradients
from shardtensor.distributed.host_collectives import mesh_reduce, rendezvous
from shardtensor.distributed.launch import LaunchError, launch
from shardtensor.distributed.process_group import BACKEND as _BACKEND  # noqa: F401  (registers the backend)

__all__ = [
    "launch",
    "LaunchError",
    "rendezvous",
    "mesh_reduce",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
    "REDUCE_SUM",
    "REDUCE_MUL",
    "REDUCE_AND",
    "REDUCE_OR",
    "REDUCE_MIN",
    "REDUCE_MAX",
    "optimizer_step",
    "reduce_gradients",
]
