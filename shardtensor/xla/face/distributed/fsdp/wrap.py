"""``torch_xla.distributed.fsdp.wrap`` under the face: the auto-wrap policies (shardtensor.fsdp's)."""

from shardtensor.fsdp import (  # noqa: F401
    always_wrap_policy,
    lambda_auto_wrap_policy,
    recursive_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
