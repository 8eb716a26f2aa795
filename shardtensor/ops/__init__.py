"""Lowerings of aten ops to jax, one module per op family; importing this package fills the table."""
from shardtensor.ops.registry import Lowering, lookup, register, registered_ops  # noqa: F401
from shardtensor.ops import (  # noqa: F401  (each module registers its lowerings on import)
    elementwise,
    activation,
    reduction,
    sorting,
    creation,
    random,
    foreach,
    matmul,
    shape,
    indexing,
    nn,
    conv,
    pooling,
    norm,
    loss,
    attention,
    resize,
    linalg,
    fft,
)
