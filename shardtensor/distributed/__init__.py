"""Jobs of several processes: starting them (`launch`); torch.distributed support comes here too.

Example::

    import shardtensor as st
    results = st.launch(train, args=(config,), nprocs=2)   # train(index, config) in 2 processes
"""

from shardtensor.distributed.launch import LaunchError, launch

__all__ = ["launch", "LaunchError"]
