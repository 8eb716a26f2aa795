"""A fused SiLU (``x * sigmoid(x)``) as a Pallas kernel, forward and backward, at the JAX level.

The array is flattened and laid out as rows of 128 lanes (the TPU vector width; a power of two for
Triton), padded to whole blocks, and each grid step handles ``block_rows`` rows. The backward is a
second Pallas kernel, tied to the forward with ``jax.custom_vjp`` so that ``jax.vjp`` (and so
``st.jax_op``'s autograd) runs the kernel rather than differentiating through ``pallas_call``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from shardtensor.kernels.mode import (
    accumulation_dtype,
    check_floating,
    compiler_params,
    mosaic_types,
    resolve_interpret,
)

LANES = 128
DEFAULT_BLOCK_ROWS = 8


def _silu_kernel(x_ref, o_ref):
    x = x_ref[...].astype(accumulation_dtype(x_ref.dtype))
    o_ref[...] = (x * jax.nn.sigmoid(x)).astype(o_ref.dtype)


def _silu_grad_kernel(x_ref, g_ref, dx_ref):
    acc = accumulation_dtype(x_ref.dtype)
    x = x_ref[...].astype(acc)
    s = jax.nn.sigmoid(x)
    # d/dx x*s(x) = s + x*s*(1-s) = s * (1 + x*(1-s))
    dx_ref[...] = (g_ref[...].astype(acc) * s * (1 + x * (1 - s))).astype(dx_ref.dtype)


def _elementwise_call(kernel, arrays, block_rows: int, interpret: bool):
    """Run an elementwise ``kernel`` over same-shaped ``arrays``; one output like ``arrays[0]``."""
    shape, dtype = arrays[0].shape, arrays[0].dtype
    n = math.prod(shape)
    per_block = block_rows * LANES
    padded = max(1, -(-n // per_block)) * per_block  # whole blocks; at least one for an empty array
    rows = padded // LANES
    # Padding is zeros: silu(0) and its gradient are finite, and the padding is sliced off below.
    tiles = [jnp.pad(a.reshape(-1), (0, padded - n)).reshape(rows, LANES) for a in arrays]
    spec = pl.BlockSpec((block_rows, LANES), lambda i: (i, 0))
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, LANES), dtype),
        grid=(rows // block_rows,),
        in_specs=[spec] * len(tiles),
        out_specs=spec,
        interpret=interpret,
        compiler_params=compiler_params(interpret),
        name=kernel.__name__.strip("_"),
    )
    with mosaic_types(dtype):
        out = call(*tiles)
    return out.reshape(-1)[:n].reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _silu(x, block_rows: int, interpret: bool):
    return _elementwise_call(_silu_kernel, [x], block_rows, interpret)


def _silu_fwd(x, block_rows, interpret):
    return _elementwise_call(_silu_kernel, [x], block_rows, interpret), x


def _silu_bwd(block_rows, interpret, x, g):
    return (_elementwise_call(_silu_grad_kernel, [x, g], block_rows, interpret),)


_silu.defvjp(_silu_fwd, _silu_bwd)


def silu_jax(x: jax.Array, *, block_rows: int = DEFAULT_BLOCK_ROWS, interpret: bool | None = None) -> jax.Array:
    """SiLU, ``x * sigmoid(x)``, as one Pallas kernel (and one for its gradient), any shape.

    ``block_rows`` rows of 128 elements make one grid step (a multiple of 8 suits TPU and GPU).
    ``interpret=None`` interprets on CPU and compiles the real kernel on GPU/TPU; pass True to force
    interpretation (debugging), False to force compilation.

    Example::

        y = silu_jax(jnp.linspace(-3, 3, 1000))                  # same as jax.nn.silu
        g = jax.grad(lambda x: silu_jax(x).sum())(x)             # the backward kernel
    """
    check_floating("silu_jax's input", x)
    if not isinstance(block_rows, int) or block_rows <= 0:
        raise ValueError(f"block_rows must be a positive int (a multiple of 8 suits TPU/GPU), got {block_rows!r}.")
    return _silu(x, block_rows, resolve_interpret(interpret))
