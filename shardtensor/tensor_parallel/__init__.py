"""L7, DTensor's vocabulary over shardtensor: placements (``Shard``, ``Replicate``, ``Partial``)
and their PartitionSpecs (``placements``), ``init_device_mesh`` and ``distribute_tensor``
(``distribute``), partial values (``partial``), a process's local data (``local``: ``to_local``,
``from_local``). Importing it fills ShardedTensor's ``.placements``/``.redistribute``/``.to_local``/
``from_local`` slots; ``parallelize_module`` with the tensor/sequence-parallel styles (``style``,
``parallelize``), DTensor's ``local_map`` (``local_map``)."""

from shardtensor.tensor.sharded import set_placement_hooks
from shardtensor.tensor_parallel.distribute import distribute_tensor, init_device_mesh, redistribute
from shardtensor.tensor_parallel.layouts import is_tensor_parallel, mark_tensor_parallel
from shardtensor.tensor_parallel.local import from_local, to_local
from shardtensor.tensor_parallel.local_map import local_map
from shardtensor.tensor_parallel.parallelize import loss_parallel, parallelize_module
from shardtensor.tensor_parallel.placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    placements_to_spec,
    spec_to_placements,
)
from shardtensor.tensor_parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

set_placement_hooks(spec_to_placements, redistribute, to_local, from_local)

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "is_tensor_parallel",
    "mark_tensor_parallel",
    "loss_parallel",
    "parallelize_module",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute_tensor",
    "from_local",
    "init_device_mesh",
    "local_map",
    "placements_to_spec",
    "spec_to_placements",
]
