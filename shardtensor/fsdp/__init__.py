"""FSDPv2 for shardtensor: fully sharded data parallel as sharding annotations (PyTorch/XLA's FSDPv2).

A layer on top of shardtensor that uses only its public API.

Example::

    import functools, shardtensor as st
    from shardtensor.fsdp import FSDPv2, transformer_auto_wrap_policy

    mesh = st.Mesh(range(8), (8, 1), ("fsdp", "model"))
    st.set_global_mesh(mesh)
    model = FSDPv2(model, auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block}))
    loss = loss_fn(model(st.shard(x, mesh, ("fsdp", None))), y)
"""

from shardtensor.fsdp.checkpoint import checkpoint_module  # noqa: F401
from shardtensor.fsdp.outputs import batch_output_sharder, shard_batch  # noqa: F401
from shardtensor.fsdp.wrap import (  # noqa: F401
    always_wrap_policy,
    lambda_auto_wrap_policy,
    recursive_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from shardtensor.fsdp.wrapper import FSDPv2, largest_dim_spec  # noqa: F401
from shardtensor.ops.barrier import optimization_barrier  # noqa: F401

SpmdFullyShardedDataParallel = FSDPv2  # PyTorch/XLA's name
