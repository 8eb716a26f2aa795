"""``dist.init_process_group("shardtensor")``: torch.distributed's process group of a multi-process job.

Importing shardtensor registers the backend name "shardtensor" (``Backend.register_backend``) for the
devices "cpu" and "shardtensor", and PyTorch/XLA's name "xla" as an alias of it (unless torch_xla registered
its own first); nothing else of torch.distributed changes. A group of this backend
has one rank per process of the job (rank ``st.process_index()``, world size ``st.process_count()``):

* device tensors (``st.device()``): torch.distributed's collectives on them are recorded as
  shardtensor collectives (``shardtensor/dispatch/c10d_ops.py``) before any backend sees them;
* CPU tensors: gloo, which this backend creates from the same store.

Start the processes with `st.launch` (which sets torchrun's variables) or torchrun; the default
``env://`` initialisation then works as it does under torchrun.

Example::

    def train(index):
        dist.init_process_group("shardtensor")
        x = torch.full((2,), float(dist.get_rank())).to(st.device())
        dist.all_reduce(x)            # on the device, in the step's program
        y = torch.ones(2)
        dist.all_reduce(y)            # on the CPU, through gloo

    st.launch(train, nprocs=2)
"""

from __future__ import annotations

import torch

import shardtensor.runtime as rt

BACKEND = "shardtensor"
DEVICES = ("cpu", "shardtensor")
ALIAS = "xla"  # PyTorch/XLA's backend name: dist.init_process_group("xla") gives the same group


def _check_rank_is_process(rank: int, world_size: int) -> None:
    if (rank, world_size) != (rt.process_index(), rt.process_count()):
        raise RuntimeError(
            f"init_process_group('shardtensor'): rank {rank} of world size {world_size}, but this process is "
            f"process {rt.process_index()} of {rt.process_count()} of shardtensor's job; each rank must be the "
            "process of the same index. Start the processes with st.launch, or with torchrun and "
            "SHARDTENSOR_AUTO_DISTRIBUTED=1 (or st.initialize_distributed() before anything runs), and keep "
            "torchrun's RANK and WORLD_SIZE."
        )


def _create_backend(options, backend_options):
    """The creator torch.distributed calls for each group of the "shardtensor" backend: checks that the
    ranks are the job's processes, and returns gloo (for CPU tensors; device tensors never reach a
    backend)."""
    import torch.distributed as dist
    from torch.distributed import ProcessGroupGloo

    if not dist.is_initialized():  # the default (world) group: its ranks must be the processes
        _check_rank_is_process(options.group_rank, options.group_size)
    return ProcessGroupGloo(options.store, options.group_rank, options.group_size, options.timeout)


def register() -> None:
    """Register the backend name "shardtensor" with torch.distributed (done on import; again is a no-op).

    Example::

        register()
        dist.init_process_group("shardtensor")
    """
    if not torch.distributed.is_available():
        return
    from torch.distributed import Backend

    if BACKEND.upper() in Backend._plugins:
        return
    Backend.register_backend(BACKEND, _create_backend, extended_api=True, devices=list(DEVICES))


register()


def register_alias() -> None:
    """Register "xla" (PyTorch/XLA's name) for the same backend, unless that name is taken (torch_xla
    imported first): torch's own backends and devices are left as they are.

    Example::

        register_alias()
        dist.init_process_group("xla")   # = dist.init_process_group("shardtensor")
    """
    if not torch.distributed.is_available():
        return
    from torch.distributed import Backend

    if ALIAS.upper() in Backend._plugins or hasattr(Backend, ALIAS.upper()):
        return
    Backend.register_backend(ALIAS, _create_backend, extended_api=True, devices=list(DEVICES))


register_alias()
