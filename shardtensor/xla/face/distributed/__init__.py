"""``torch_xla.distributed`` under the face."""

from shardtensor.xla.face.distributed import (  # noqa: F401
    fsdp,
    parallel_loader,
    spmd,
    xla_backend,
    xla_multiprocessing,
)
