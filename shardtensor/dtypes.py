"""torch dtype <-> jax dtype, exact both ways (jax runs with x64 on, so int64/float64 stay 64-bit).

Example::

    to_jax(torch.int64)      # dtype('int64')
    to_torch(jnp.bfloat16)   # torch.bfloat16
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

_TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int64: jnp.int64,
    torch.int32: jnp.int32,
    torch.int16: jnp.int16,
    torch.int8: jnp.int8,
    torch.uint8: jnp.uint8,
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    torch.bool: jnp.bool_,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
}
_JAX_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_JAX.items()}


def to_jax(dtype: torch.dtype) -> np.dtype:
    """The jax (numpy) dtype for a torch dtype; a clear TypeError for dtypes jax cannot hold."""
    try:
        return np.dtype(_TORCH_TO_JAX[dtype])
    except KeyError:
        raise TypeError(f"shardtensor cannot hold {dtype} tensors (jax has no such dtype)") from None


def to_torch(dtype) -> torch.dtype:
    """The torch dtype for a jax/numpy dtype."""
    try:
        return _JAX_TO_TORCH[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"no torch dtype for jax dtype {dtype}") from None
