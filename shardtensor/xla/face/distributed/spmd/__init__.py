"""``torch_xla.distributed.spmd`` (``xs``) under the face: ``Mesh``, ``HybridMesh``, ``ShardingSpec``,
``mark_sharding`` and friends with PyTorch/XLA's signatures, on shardtensor (see ``xla_sharding``)."""

from shardtensor.xla.face.distributed.spmd import api, debugging, xla_sharded_tensor, xla_sharding  # noqa: F401
from shardtensor.xla.face.distributed.spmd.api import (  # noqa: F401
    auto_policy,
    convert_to_xla_mesh,
    xla_distribute_module,
    xla_distribute_tensor,
)
from shardtensor.xla.face.distributed.spmd.xla_sharded_tensor import XLAShard, XLAShardedTensor  # noqa: F401
from shardtensor.xla.face.distributed.spmd.xla_sharding import (  # noqa: F401
    HybridMesh,
    MarkShardingFunction,
    Mesh,
    PartitionSpec,
    ShardingSpec,
    ShardingType,
    XLAPatchedLinear,
    _mark_manual_sharding,
    annotate_custom_sharding,
    apply_backward_optimization_barrier,
    apply_xla_patch_to_nn_linear,
    clear_sharding,
    disable_manual_sharding,
    enable_manual_sharding,
    get_1d_mesh,
    get_global_mesh,
    mark_sharding,
    mark_sharding_with_gradients,
    set_global_mesh,
    shard_as,
    unwrap_sharded_tensor,
    wrap_as_sharded_tensor,
    wrap_if_sharded,
    xla_patched_nn_linear_forward,
)
