"""Jobs of several processes: starting them (`launch`), host values across them (`rendezvous`,
`mesh_reduce`); torch.distributed support comes here too.

Example::

    import shardtensor as st
    results = st.launch(train, args=(config,), nprocs=2)   # train(index, config) in 2 processes
"""

from shardtensor.distributed.host_collectives import mesh_reduce, rendezvous
from shardtensor.distributed.launch import LaunchError, launch

__all__ = ["launch", "LaunchError", "rendezvous", "mesh_reduce"]
