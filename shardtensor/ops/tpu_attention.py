"""Attention through JAX's Pallas splash-attention kernel (``jax.experimental.pallas.ops.tpu``), the
path ``F.scaled_dot_product_attention`` takes on a TPU where the kernel applies (see
``kernel_applies``; the choice is made when the op is recorded, in ``dispatch/fused_attention.py``).

On one v5e chip, causal bf16 attention forward + backward at T=2048 (batch 4, 16 heads, head dim 64)
takes 4.0 ms in splash attention against 11.6 ms in XLA's attention (``bench/tpu_attention_kernels.py``).

Two torch ops, so that the choice is part of the recorded graph (and of its cache key):

- ``shardtensor::splash_attention(q, k, v, is_causal, scale) -> (out, logsumexp)``: the kernel's
  output; logsumexp (float32, what torch's op returns beside it) is computed by XLA from the scores
  and is dead code when only autograd holds it (the backward below does not read it);
- ``shardtensor::splash_attention_backward(grad, q, k, v, is_causal, scale) -> (dq, dk, dv)``: the
  kernel's own backward (``jax.vjp`` of the kernel: its forward runs again for its residuals).

Off a TPU the kernel runs in Pallas' interpret mode (tests only: slow). Plain CPU tensors compute
the same with torch's math (the ops' CPU bodies).

Example::

    out, lse = torch.ops.shardtensor.splash_attention(q, k, v, True, 0.125)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import torch

from shardtensor import runtime as rt
from shardtensor.ops.registry import register

BLOCKS = (1024, 512, 256, 128)  # the kernel's block sizes, largest first (measured: 1024 and 512 fastest)
MIN_SEQUENCE = 512  # measured faster than XLA's at T=2048; shorter sequences stay XLA's until measured


def kernel_applies(query, key, value, attn_bias, dropout_p) -> bool:
    """Whether the splash kernel computes this SDPA with torch's results and is faster than XLA's:
    bf16, (batch, heads, L, E) with as many key/value heads as query heads, no mask but ``is_causal``,
    no dropout, both sequences at least ``MIN_SEQUENCE`` and a multiple of 128.

    Example: ``kernel_applies(q, k, v, None, 0.0)``
    """
    return (
        attn_bias is None
        and not dropout_p
        and query.dim() == key.dim() == value.dim() == 4
        and query.dtype == key.dtype == value.dtype == torch.bfloat16
        and query.shape[:2] == key.shape[:2] == value.shape[:2]
        and key.shape[2] == value.shape[2]
        and query.shape[3] == key.shape[3] == value.shape[3]
        and min(query.shape[2], key.shape[2]) >= MIN_SEQUENCE
        and query.shape[2] % 128 == 0
        and key.shape[2] % 128 == 0
    )


def _masked_scores(q, k, is_causal, scale):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), float("-inf"))
    return s


@torch.library.custom_op("shardtensor::splash_attention", mutates_args=())
def _splash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    s = _masked_scores(q, k, is_causal, scale)
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype), torch.logsumexp(s, dim=-1)


@_splash.register_fake
def _splash_fake(q, k, v, is_causal, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("shardtensor::splash_attention_backward", mutates_args=())
def _splash_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = torch.softmax(_masked_scores(q, k, is_causal, scale), -1)
    g = grad.float()
    dv = p.transpose(-1, -2) @ g
    dp = g @ v.float().transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
    return (ds @ k.float()).to(q.dtype), (ds.transpose(-1, -2) @ q.float()).to(k.dtype), dv.to(v.dtype)


@_splash_backward.register_fake
def _splash_backward_fake(grad, q, k, v, is_causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@functools.cache
def _kernel(heads: int, q_len: int, k_len: int, is_causal: bool, interpret: bool, block: int | None = None):
    """The splash kernel for one head count and shape, vmapped over the batch (built once: its mask
    tables are numpy work); blocks of ``block``, by default the largest of ``BLOCKS`` that divides."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    one = masks.CausalMask((q_len, k_len)) if is_causal else masks.FullMask((q_len, k_len))
    bq = block or next(b for b in BLOCKS if q_len % b == 0)
    bk = block or next(b for b in BLOCKS if k_len % b == 0)
    sizes = splash.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    with jax.ensure_compile_time_eval():  # its mask tables are concrete arrays, though built inside a trace
        kernel = splash.make_splash_mha(
            masks.MultiHeadMask([one] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
        )
    return jax.vmap(kernel)


def _attend(q, k, v, is_causal, scale):
    kernel = _kernel(q.shape[1], q.shape[2], k.shape[2], bool(is_causal), rt.platform() != "tpu")
    return kernel(q * jnp.asarray(scale, q.dtype), k, v)  # the kernel takes the query scaled


@register(torch.ops.shardtensor.splash_attention.default, meta_from_lowering=True)
def splash_attention(q, k, v, is_causal, scale):
    with rt.x64_off_scope():  # Mosaic takes 32-bit index maps only
        out = _attend(q, k, v, is_causal, scale)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if is_causal:
        keep = jnp.tril(jnp.ones(s.shape[-2:], bool))
        s = jnp.where(keep, s, -0.7 * float(jnp.finfo(jnp.float32).max))
    return out, jax.nn.logsumexp(s, axis=-1)  # (logsumexp: dead unless a caller holds it)


@register(torch.ops.shardtensor.splash_attention_backward.default, meta_from_lowering=True)
def splash_attention_backward(grad, q, k, v, is_causal, scale):
    with rt.x64_off_scope():
        _, pullback = jax.vjp(lambda q, k, v: _attend(q, k, v, is_causal, scale), q, k, v)
        return tuple(pullback(grad.astype(q.dtype)))


def default_scale(query) -> float:
    """torch's SDPA scale when none is given: 1 / sqrt(E)."""
    return 1.0 / math.sqrt(query.shape[-1])
