"""torch dtype <-> jax dtype, exact both ways (shardtensor works with JAX's 64-bit types on, in
runtime.x64_scope, so int64 / float64 stay 64-bit).

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


# --- torch <-> numpy for every dtype (numpy lacks bfloat16 and float8: go through same-width ints) ---
_BITCAST = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.int8,
    torch.float8_e5m2: torch.int8,
    torch.uint16: torch.int16,
    torch.uint32: torch.int32,
    torch.uint64: torch.int64,
}


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy array with the exact dtype of a CPU tensor (ml_dtypes for bfloat16/float8).

    Example: ``torch_to_numpy(torch.ones(2, dtype=torch.bfloat16)).dtype == jnp.bfloat16``.
    """
    t = t.detach().contiguous()
    if t.dtype in _BITCAST:
        return t.view(_BITCAST[t.dtype]).numpy().view(to_jax(t.dtype))
    return t.numpy()


def numpy_to_torch(a) -> torch.Tensor:
    """A torch CPU tensor (a copy) from a numpy or jax array, exact dtype.

    Example: ``numpy_to_torch(np.zeros(2, np.float32))`` is ``tensor([0., 0.])``.
    """
    a = np.asarray(a)
    dtype = to_torch(a.dtype)
    if dtype in _BITCAST:
        return torch.from_numpy(np.array(a, copy=True).view(to_jax(_BITCAST[dtype]))).view(dtype)
    return torch.from_numpy(np.array(a, copy=True))
