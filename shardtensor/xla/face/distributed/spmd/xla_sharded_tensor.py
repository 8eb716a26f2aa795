"""``torch_xla.distributed.spmd.xla_sharded_tensor`` under the face: PyTorch/XLA's ``XLAShardedTensor``
is shardtensor's ``ShardedTensor`` (``global_tensor``, ``sharding_spec``, ``sharding_type``,
``local_shards``, DTensor's ``placements``), and ``XLAShard`` is ``st.LocalShard`` (``data``,
``indices``, ``unpadded_data``, ``replica_id``; its device is ``.device``, PyTorch/XLA's ``shard_device``)."""

import shardtensor as st

XLAShardedTensor = st.ShardedTensor
XLAShard = st.LocalShard
