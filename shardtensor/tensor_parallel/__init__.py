"""L7, DTensor's vocabulary over shardtensor: placements (``Shard``, ``Replicate``, ``Partial``)
and their PartitionSpecs (``placements``), ``init_device_mesh`` and ``distribute_tensor``
(``distribute``). Importing it fills ShardedTensor's ``.placements``/``.redistribute`` slots."""

from shardtensor.tensor.sharded import set_placement_hooks
from shardtensor.tensor_parallel.distribute import distribute_tensor, init_device_mesh, redistribute
from shardtensor.tensor_parallel.local_map import local_map
from shardtensor.tensor_parallel.placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    placements_to_spec,
    spec_to_placements,
)

set_placement_hooks(spec_to_placements, redistribute)

__all__ = [
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute_tensor",
    "init_device_mesh",
    "local_map",
    "placements_to_spec",
    "spec_to_placements",
]
