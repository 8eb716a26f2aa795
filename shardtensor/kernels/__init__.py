"""L7, custom kernels written in Pallas (``jax.experimental.pallas``), as JAX functions and torch ops.

- ``silu_jax`` / ``flash_attention_jax``: the kernels at the JAX level, each a ``jax.custom_vjp``
  whose backward is Pallas kernels too;
- ``silu`` / ``flash_attention``: the same as torch functions on ShardedTensors, built with
  ``st.jax_op`` (lazy, eager, ``st.compile``, autograd; replicated or per shard).

On CPU the kernels run in Pallas' interpret mode (for tests; slow); on GPU/TPU the same code compiles
the real kernel. See docs/kernels.md, "Pallas kernels".

Example::

    import shardtensor as st
    o = st.kernels.flash_attention(q, k, v, causal=True)   # like F.scaled_dot_product_attention
"""

from shardtensor.kernels.flash_attention import flash_attention_jax
from shardtensor.kernels.mode import resolve_interpret
from shardtensor.kernels.silu import silu_jax
from shardtensor.kernels.torch_ops import flash_attention, silu

__all__ = ["flash_attention", "flash_attention_jax", "resolve_interpret", "silu", "silu_jax"]
