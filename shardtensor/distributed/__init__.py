"""Jobs of several processes: starting them (`launch`), host values across them (`rendezvous`,
`mesh_reduce`), and torch.distributed's process group of such a job (backend "shardtensor",
`process_group`).

Example::

    import shardtensor as st
    results = st.launch(train, args=(config,), nprocs=2)   # train(index, config) in 2 processes
"""

from shardtensor.distributed.host_collectives import mesh_reduce, rendezvous
from shardtensor.distributed.launch import LaunchError, launch
from shardtensor.distributed.process_group import BACKEND as _BACKEND  # noqa: F401  (registers the backend)

__all__ = ["launch", "LaunchError", "rendezvous", "mesh_reduce"]
