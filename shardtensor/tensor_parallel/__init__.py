"""L7, DTensor's vocabulary over shardtensor: placements (``Shard``, ``Replicate``, ``Partial``)
and their PartitionSpecs (``placements``), ``init_device_mesh`` and ``distribute_tensor``
(``distribute``); ``parallelize_module`` with the tensor/sequence-parallel styles (``style``,
``parallelize``). Importing it fills ShardedTensor's ``.placements``/``.redistribute`` slots."""

from shardtensor.tensor.sharded import set_placement_hooks
from shardtensor.tensor_parallel.distribute import distribute_tensor, init_device_mesh, redistribute
from shardtensor.tensor_parallel.layouts import is_tensor_parallel, mark_tensor_parallel
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

set_placement_hooks(spec_to_placements, redistribute)

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
    "init_device_mesh",
    "placements_to_spec",
    "spec_to_placements",
]
