"""``torch_xla.distributed.fsdp.utils`` under the face: ``checkpoint_module`` (shardtensor.fsdp's) and
the einsum linear patch."""

from shardtensor.fsdp import checkpoint_module  # noqa: F401
from shardtensor.xla.face.distributed.spmd.xla_sharding import apply_xla_patch_to_nn_linear  # noqa: F401
