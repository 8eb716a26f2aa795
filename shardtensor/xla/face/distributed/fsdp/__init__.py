"""``torch_xla.distributed.fsdp`` under the face: the wrap policies and ``checkpoint_module`` that FSDPv2
scripts import from here (shardtensor.fsdp's). PyTorch/XLA's older FSDP (``XlaFullyShardedDataParallel``,
collectives written by hand) is not provided: FSDPv2 is the SPMD form of the same sharding."""

from shardtensor.fsdp import checkpoint_module  # noqa: F401
from shardtensor.xla.face import _support
from shardtensor.xla.face.distributed.fsdp import utils, wrap  # noqa: F401

_FSDP_V2 = (
    "use FSDPv2, its SPMD form: from torch_xla.experimental.spmd_fully_sharded_data_parallel import "
    "SpmdFullyShardedDataParallel (shards each parameter over the mesh's 'fsdp' axis; XLA inserts the collectives)"
)
XlaFullyShardedDataParallel = _support.unsupported_class(
    "torch_xla.distributed.fsdp.XlaFullyShardedDataParallel", _FSDP_V2
)
consolidate_sharded_state_dicts = _support.unsupported(
    "torch_xla.distributed.fsdp.consolidate_sharded_state_dicts", "FSDPv2 state dicts are whole tensors already"
)
consolidate_sharded_model_checkpoints = _support.unsupported(
    "torch_xla.distributed.fsdp.consolidate_sharded_model_checkpoints", "FSDPv2 state dicts are whole tensors already"
)
