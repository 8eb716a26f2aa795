"""Where a Pallas kernel runs: compiled for the accelerator, or interpreted (CPU, tests only).

Pallas compiles a kernel to Mosaic (TPU) or Triton / Mosaic GPU (GPU); there is no CPU code
generator. ``interpret=True`` instead runs the kernel body as ordinary JAX operations over the grid,
which is how the kernels are tested on CPU (correct, but slow: every grid step is a loop iteration).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from shardtensor.runtime import x64_off_scope

_64_BIT = frozenset(map(jnp.dtype, ("int64", "uint64", "float64", "complex128")))


def resolve_interpret(interpret: bool | None) -> bool:
    """``interpret`` if the caller forced it, else True exactly when JAX's backend is the CPU.

    Example::

        resolve_interpret(None)   # True on CPU, False on GPU/TPU
        resolve_interpret(True)   # interpret even on an accelerator (debugging)
    """
    if interpret is None:
        return jax.default_backend() == "cpu"
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be True, False or None (choose by backend), got {interpret!r}.")
    return interpret


def compiler_params(interpret: bool):
    """Pallas compiler parameters for the backend: Triton's on GPU, None (the default) elsewhere.

    JAX 0.10 lowers a ``pallas_call`` on GPU to Mosaic GPU unless told otherwise, and Mosaic GPU wants
    kernels in its own warpgroup style (its ``pallas_call`` path is deprecated); these kernels are
    written in the block style Triton compiles, so they ask for Triton explicitly. TPU has one
    compiler (Mosaic) and interpretation needs none.

    Example::

        pl.pallas_call(kernel, ..., interpret=interpret, compiler_params=compiler_params(interpret))
    """
    if interpret or jax.default_backend() != "gpu":
        return None
    from jax.experimental.pallas import triton as pallas_triton  # the GPU backend's module, only there

    return pallas_triton.CompilerParams(num_warps=4, num_stages=2)


def accumulation_dtype(dtype) -> jnp.dtype:
    """The dtype a kernel computes in: float32 for half types and float32, float64 for float64.

    Example::

        accumulation_dtype(jnp.bfloat16)   # float32
    """
    return jnp.promote_types(dtype, jnp.float32)


def check_floating(name: str, x) -> None:
    """A clear error for a non-floating input (the kernels are for float16/bfloat16/float32/float64)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array (float16, bfloat16, float32), got dtype {x.dtype}.")


def mosaic_types(*dtypes):
    """A block in which a ``pallas_call`` is traced with JAX's 64-bit types off, unless one of
    ``dtypes`` (its inputs') is 64-bit: Mosaic (the TPU's kernel compiler) takes only 32-bit grid
    indices, index maps and loop counters, and shardtensor traces with 64-bit types on (torch's int64).

    Example::

        with mosaic_types(q.dtype):
            o = pl.pallas_call(kernel, ...)(q, k, v)
    """
    if any(jnp.dtype(d) in _64_BIT for d in dtypes):
        return contextlib.nullcontext()
    return x64_off_scope()
