"""Lowerings of the fused attention ops ``F.scaled_dot_product_attention`` reaches on a CPU device:
``_scaled_dot_product_flash_attention_for_cpu`` and its backward (causal, additive/bool mask, scale,
grouped-query heads; dropout_p must be 0 — with dropout torch takes the decomposed math path).

On shardtensor's own device ``F.scaled_dot_product_attention`` becomes another op,
``_scaled_dot_product_fused_attention_overrideable`` (``fused_attention.py``); these lowerings serve
programs that call the CPU ops directly (an exported or traced CPU graph).

Semantics of torch's CPU kernel: ``is_causal`` masks key j > query i (top-left aligned); a row with
every key masked gives output 0 and logsumexp 0; logsumexp is float32 for half inputs.

Example::

    out, lse = lookup(aten._scaled_dot_product_flash_attention_for_cpu.default).fn(q, k, v, 0.0, True)
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch
from jax import lax

from shardtensor.ops._promote import acc_dtype
from shardtensor.ops.fused_attention import probabilities
from shardtensor.ops.precision import precision
from shardtensor.ops.registry import register

aten = torch.ops.aten


def _mm(a, b, dtype):
    return jnp.matmul(a, b, precision=precision(), preferred_element_type=dtype)


def _repeat_kv(k, hq):
    """Grouped-query attention: query head h uses key/value head h // (hq // hk)."""
    hk = k.shape[-3]
    if hk == hq:
        return k
    if hq % hk:
        raise RuntimeError(f"number of query heads ({hq}) must be a multiple of key/value heads ({hk})")
    return jnp.repeat(k, hq // hk, axis=-3)


def _sum_groups(g, hk):
    """Adjoint of _repeat_kv: sum the gradients of the query heads that share a key/value head."""
    hq = g.shape[-3]
    if hq == hk:
        return g
    return g.reshape(g.shape[:-3] + (hk, hq // hk) + g.shape[-2:]).sum(axis=-3)


def _scores(q, k, attn_mask, is_causal, scale):
    """Masked, scaled q @ k^T in float32 (for half inputs), with -inf where masked."""
    acc = acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _mm(q, jnp.swapaxes(k, -1, -2), acc) * jnp.asarray(scale, acc)
    neg = jnp.asarray(-jnp.inf, acc)
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            s = jnp.where(attn_mask, s, neg)
        else:
            s = s + attn_mask.astype(acc)
    if is_causal:
        L, S = s.shape[-2:]
        keep = lax.broadcasted_iota(jnp.int32, (L, S), 1) <= lax.broadcasted_iota(jnp.int32, (L, S), 0)
        s = jnp.where(keep, s, neg)
    return s, scale


def _check_dropout(dropout_p):
    if dropout_p:
        raise NotImplementedError(
            "shardtensor: fused CPU attention with dropout_p > 0 is not lowered "
            "(torch's SDPA uses the decomposed math path for dropout)"
        )


@register(aten._scaled_dot_product_flash_attention_for_cpu.default, products=True)
def sdpa_flash_cpu(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    _check_dropout(dropout_p)
    hq = q.shape[-3]
    k, v = _repeat_kv(k, hq), _repeat_kv(v, hq)
    s, _ = _scores(q, k, attn_mask, is_causal, scale)
    acc = s.dtype
    p, m, safe, empty = probabilities(s)
    out = _mm(p.astype(v.dtype) if v.dtype != acc else p, v, acc)
    out = jnp.where(empty, jnp.zeros((), acc), out).astype(q.dtype)
    lse = jnp.where(empty, jnp.zeros((), acc), m + jnp.log(safe))[..., 0]
    return out, lse.astype(acc_dtype(q.dtype))


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, products=True)
def sdpa_flash_cpu_backward(grad, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask=None, scale=None):
    _check_dropout(dropout_p)
    hq, hk = q.shape[-3], k.shape[-3]
    kr, vr = _repeat_kv(k, hq), _repeat_kv(v, hq)
    s, scale = _scores(q, kr, attn_mask, is_causal, scale)
    acc = s.dtype
    p = probabilities(s)[0]  # = exp(s - lse), as the forward computed it: XLA reuses the forward's
    g = grad.astype(acc)
    dv = _mm(jnp.swapaxes(p, -1, -2), g, acc)
    dp = _mm(g, jnp.swapaxes(vr.astype(acc), -1, -2), acc)
    delta = jnp.sum(g * out.astype(acc), axis=-1, keepdims=True)
    ds = p * (dp - delta) * jnp.asarray(scale, acc)
    dq = _mm(ds, kr.astype(acc), acc)
    dk = _mm(jnp.swapaxes(ds, -1, -2), q.astype(acc), acc)
    dk, dv = _sum_groups(dk, hk), _sum_groups(dv, hk)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
