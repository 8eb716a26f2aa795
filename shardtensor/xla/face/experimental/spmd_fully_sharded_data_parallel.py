"""``torch_xla.experimental.spmd_fully_sharded_data_parallel`` under the face: FSDPv2 is
``shardtensor.fsdp.FSDPv2`` (same signature and rules: each parameter sharded over ``'fsdp'`` on its
largest dimension, the output on its batch dimension)."""

from typing import Any

from shardtensor.fsdp import FSDPv2, largest_dim_spec

SpmdFullyShardedDataParallel = FSDPv2


def _prepare_spmd_partition_spec(param: Any, extra_data_axis: Any = None, shard_maximal: bool = False) -> tuple:
    """The spec FSDPv2 gives ``param``: ``'fsdp'`` on its largest dimension."""
    if extra_data_axis is not None or shard_maximal:
        raise NotImplementedError("_prepare_spmd_partition_spec: only the default (largest dimension on 'fsdp').")
    return largest_dim_spec(param.shape)
