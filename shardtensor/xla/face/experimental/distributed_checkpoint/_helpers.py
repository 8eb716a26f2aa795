"""``torch_xla.experimental.distributed_checkpoint._helpers`` under the face: PyTorch/XLA's private
helpers of its planners; none is needed, since ShardedTensors speak DCP's tensor protocol."""

from shardtensor.xla.face import _support

__getattr__ = _support.module_getattr(
    "torch_xla.experimental.distributed_checkpoint._helpers",
    {
        "_sharded_cpu_state_dict": "st.checkpoint.HostStager() copies each shard to the host for async saves",
        "_CpuShards": "st.checkpoint.HostStager() copies each shard to the host for async saves",
        "_is_sharded_tensor": "test isinstance(t, st.ShardedTensor) and t.sharding_type",
    },
)
