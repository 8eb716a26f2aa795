"""The Pallas kernels as torch functions on ShardedTensors (and plain CPU tensors), through ``st.jax_op``.

Each call is one torch op: it records into a lazy step, runs at once in eager mode, traces under
``st.compile``, and has autograd through the kernels' own ``jax.custom_vjp`` backward.

Partitioning. Without ``mesh``/``spec`` a Pallas call is opaque to the compiler, which runs it as
one replicated piece (each device gathers the inputs and computes everything). With them, the kernel
runs per shard under ``shard_map``: attention is independent per batch element and head, so
``spec=st.P("data", "model", None, None)`` runs it on each device's batch rows and heads.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

import shardtensor as st
from shardtensor.kernels.flash_attention import flash_attention_jax
from shardtensor.kernels.silu import DEFAULT_BLOCK_ROWS, silu_jax


@functools.cache
def _op(jax_fn, mesh, spec: tuple | None, n_inputs: int):
    """One ``st.jax_op`` per (function, mesh, spec), built on first use and kept (the bridge keys its
    programs by the op, so a new op per call would be a new program per call)."""
    if spec is None:
        return st.jax_op(jax_fn)
    return st.jax_op(jax_fn, mesh=mesh, in_specs=(st.P(*spec),) * n_inputs, out_specs=st.P(*spec))


def _partition(mesh, spec, ndim: int, what: str) -> tuple[Any, tuple | None]:
    if (mesh is None) != (spec is None):
        raise ValueError(f"{what}: give both mesh and spec to run the kernel per shard, or neither (replicated).")
    if spec is None:
        return None, None
    spec = tuple(spec)
    if len(spec) != ndim:
        raise ValueError(f"{what}: spec {spec!r} has {len(spec)} entries but the input has {ndim} dimensions.")
    return mesh, spec


def silu(
    x: torch.Tensor,
    *,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    interpret: bool | None = None,
    mesh: Any = None,
    spec: Any = None,
) -> torch.Tensor:
    """``F.silu(x)`` by a fused Pallas kernel (forward and backward), as one torch op.

    ``interpret=None`` interprets the kernel on CPU (slow, for testing) and compiles it on GPU/TPU.
    With ``mesh`` and ``spec`` (any partition spec of ``x``) it runs on each shard.

    Example::

        x = st.shard(torch.randn(64, 16), mesh, ("data", None)).requires_grad_()
        y = st.kernels.silu(x)                                   # == F.silu(x)
        y.sum().backward()
        y = st.kernels.silu(x, mesh=mesh, spec=("data", None))   # per shard
    """
    mesh, spec = _partition(mesh, spec, x.dim(), "st.kernels.silu")
    return _op(silu_jax, mesh, spec, 1)(x, block_rows=block_rows, interpret=interpret)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool | None = None,
    mesh: Any = None,
    spec: Any = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)`` by Pallas
    flash-attention kernels (forward and backward), as one torch op.

    Shapes (batch, heads, seq, head_dim). ``block_q``/``block_k`` as in
    :func:`~shardtensor.kernels.flash_attention_jax` (None: a default, with padding). With ``mesh``
    and ``spec`` (sharding batch and heads only, e.g. ``("data", "model", None, None)``; the same for
    q, k, v and the output) the kernel runs per shard.

    Example::

        q, k, v = (st.shard(torch.randn(2, 8, 64, 32), mesh, ("data", "model", None, None)) for _ in "qkv")
        o = st.kernels.flash_attention(q, k, v, causal=True)
        o = st.kernels.flash_attention(q, k, v, causal=True, mesh=mesh, spec=("data", "model", None, None))
    """
    mesh, spec = _partition(mesh, spec, q.dim(), "st.kernels.flash_attention")
    if spec is not None and (spec[2] is not None or spec[3] is not None):
        raise ValueError(
            f"st.kernels.flash_attention: spec {spec!r} shards the sequence or head_dim, but each shard's "
            "attention needs all keys and whole head vectors; shard only batch and heads (dims 0 and 1)."
        )
    return _op(flash_attention_jax, mesh, spec, 3)(
        q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k, interpret=interpret
    )
