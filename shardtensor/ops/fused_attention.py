"""Lowerings of ``_scaled_dot_product_fused_attention_overrideable`` and its backward: the one op
``F.scaled_dot_product_attention`` reaches on shardtensor's device (the C++ extension answers torch's
backend choice with "overrideable", see ``tensor/device_guard.cpp``), instead of torch's math path
(matmul → reshape to (batch*heads, L, E) → bmm) that loses a heads split over a mesh axis.

Attention without a mask (``is_causal`` or none) is JAX's own ``jax.nn.dot_product_attention`` (XLA's
implementation) at torch's product precision, and its backward JAX's autodiff of it: the program
``jax.jit`` builds, which XLA's TPU compiler fuses best (see ``_jax_attention``). Otherwise every
product is one ``jnp.einsum`` whose batch dims are (batch..., heads), so XLA keeps a batch or heads
sharding through attention, forward and backward. Supported: a float (additive) or bool (keep)
``attn_bias`` broadcastable to (..., heads, L, S) — with its gradient —, ``is_causal`` (key j > query
i masked, top-left aligned), ``scale`` (default 1/sqrt(E)), grouped-query heads (fewer key/value heads
than query heads: query head h reads key/value head h // (hq // hk), without repeating k and v).
``dropout_p`` must be 0: torch's SDPA keeps its math path (and shardtensor's random ops) for dropout.

As torch's CPU kernel: a row with every key masked gives output 0 and logsumexp 0; logsumexp is
float32 for half inputs (the accumulation dtype) and has the shape of the query without its last dim. The schema's other
results (cumulative lengths, philox seed and offset, debug mask) are None; max_q and max_k are filled
in by the dispatch handler (``dispatch/fused_attention.py``), as a lowering gives tensors only.

Example::

    out, lse, *_ = lookup(aten._scaled_dot_product_fused_attention_overrideable.default).fn(q, k, v)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from jax import lax

from shardtensor import runtime
from shardtensor.ops._promote import acc_dtype
from shardtensor.ops.precision import as_jax_default, precision
from shardtensor.ops.registry import register
from shardtensor.runtime import x64_off_scope

aten = torch.ops.aten


def _einsum(spec, a, b, dtype):
    return jnp.einsum(spec, a, b, precision=precision(), preferred_element_type=dtype)


def _check(q, k, v, dropout_p):
    if dropout_p:
        raise NotImplementedError(
            "shardtensor: _scaled_dot_product_fused_attention_overrideable with dropout_p > 0 is not "
            "lowered; F.scaled_dot_product_attention takes torch's math path for dropout on shardtensor"
        )
    if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise RuntimeError(
            f"scaled_dot_product_attention on shardtensor: query, key and value need the same rank >= 3 "
            f"(..., heads, seq, dim); got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    hq, hk = q.shape[-3], k.shape[-3]
    if hq % hk or v.shape[-3] != hk:
        raise RuntimeError(
            f"scaled_dot_product_attention: {hq} query heads need a whole number of query heads per "
            f"key/value head (key has {hk}, value {v.shape[-3]}); pass enable_gqa=True with hq % hk == 0"
        )


def _grouped(x, hk):
    """(..., hq, L, E) as (..., hk, hq // hk, L, E): query heads grouped by the key/value head they read."""
    return x.reshape(x.shape[:-3] + (hk, x.shape[-3] // hk) + x.shape[-2:])


def _flat(x):
    """The inverse of ``_grouped``: (..., hk, g, L, X) as (..., hk * g, L, X)."""
    return x.reshape(x.shape[:-4] + (x.shape[-4] * x.shape[-3],) + x.shape[-2:])


def _scores(q, k, attn_bias, is_causal, scale):
    """(scaled, masked scores (..., hq, L, S) in the accumulation dtype with -inf where masked, scale)."""
    acc = acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    hk = k.shape[-3]
    s = _flat(_einsum("...hgqd,...hkd->...hgqk", _grouped(q, hk), k, acc)) * jnp.asarray(scale, acc)
    neg = jnp.asarray(-jnp.inf, acc)
    if attn_bias is not None:
        s = jnp.where(attn_bias, s, neg) if attn_bias.dtype == jnp.bool_ else s + attn_bias.astype(acc)
    if is_causal:
        L, S = s.shape[-2:]
        keep = lax.broadcasted_iota(jnp.int32, (L, S), 1) <= lax.broadcasted_iota(jnp.int32, (L, S), 0)
        s = jnp.where(keep, s, neg)
    return s, scale


@register(aten._scaled_dot_product_fused_attention_overrideable.default, meta_from_lowering=True, products=True)
def sdpa_overrideable(
    query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None
):
    _check(query, key, value, dropout_p)
    if _jax_attention_applies(query, key, value, attn_bias):
        out = _jax_attention(query, key, value, is_causal, scale)
        # logsumexp: computed only if something holds it (the backward does not read it)
        s, _ = _scores(query, key, attn_bias, is_causal, scale)
        lse = jnp.log(jnp.sum(jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), axis=-1)) + jnp.max(s, axis=-1)
        return out, lse, None, None, None, None, None, None, None
    hk = key.shape[-3]
    s, _ = _scores(query, key, attn_bias, is_causal, scale)
    p, m, total, empty = probabilities(s)
    acc = s.dtype
    p = p.astype(value.dtype) if value.dtype != acc else p  # as torch's CPU kernel: p in v's dtype
    out = _flat(_einsum("...hgqk,...hkd->...hgqd", _grouped(p, hk), value, acc))
    out = jnp.where(empty, jnp.zeros((), acc), out).astype(query.dtype)
    lse = jnp.where(empty, jnp.zeros((), acc), m + jnp.log(total))[..., 0]
    return out, lse, None, None, None, None, None, None, None


def _jax_attention_applies(query, key, value, attn_bias) -> bool:
    """Whether the attention is one ``jax.nn.dot_product_attention`` computes with torch's results: no
    mask but ``is_causal`` (no row loses every key), keys present, one float dtype, value's head dim
    the query's."""
    return (
        attn_bias is None
        and query.shape[-2] > 0
        and key.shape[-2] > 0
        and query.dtype == key.dtype == value.dtype
        and query.dtype in (jnp.bfloat16, jnp.float16, jnp.float32)
        and value.shape[-1] == query.shape[-1]
        # (its float16 products ask for an F16_F16_F32 dot algorithm, which XLA:CPU does not have)
        and not (query.dtype == jnp.float16 and runtime.platform() == "cpu")
    )


def _jax_attention(query, key, value, is_causal, scale):
    """JAX's own XLA attention on torch's (..., heads, L, E) layout, at torch's product precision: the
    very program ``jax.jit`` builds for ``jax.nn.dot_product_attention``, whose softmax XLA's TPU
    compiler fuses into the scores' product (a hand-written one was fused differently: one more pass
    over the scores per attention), and whose backward is JAX's autodiff of it."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale

    def bthd(x):  # (..., h, t, d) -> (batch, t, h, d), JAX's layout
        return jnp.swapaxes(x.reshape((-1,) + x.shape[-3:]), 1, 2)

    # 32-bit types inside, as under jax.jit: the causal mask's iota is int32, not an int64 that a TPU
    # emulates for each score of the fused softmax (the inputs are float16/32, nothing else changes)
    with as_jax_default(), x64_off_scope():
        out = jax.nn.dot_product_attention(
            bthd(query), bthd(key), bthd(value), scale=scale, is_causal=is_causal, implementation="xla"
        )
    return jnp.swapaxes(out, 1, 2).reshape(query.shape).astype(query.dtype)


def probabilities(s):
    """(softmax of the masked scores ``s`` with 0 for masked keys, row max, row sum, rows with every
    key masked). The backward calls this on the same scores, so that XLA's common-subexpression pass
    finds the forward's probabilities and keeps them, as autodiff does, instead of computing a second
    exponential of every score from the log-sum-exp."""
    acc = s.dtype
    m = jnp.max(s, axis=-1, keepdims=True)
    empty = m == -jnp.inf  # rows with every key masked
    m = jnp.where(empty, jnp.zeros((), acc), m)
    p = jnp.exp(s - m)
    total = jnp.where(empty, jnp.ones((), acc), jnp.sum(p, axis=-1, keepdims=True))
    return p / total, m, total, empty


@register(
    aten._scaled_dot_product_fused_attention_overrideable_backward.default, meta_from_lowering=True, products=True
)
def sdpa_overrideable_backward(
    grad_out,
    query,
    key,
    value,
    attn_bias,
    grad_input_mask,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    *,
    scale=None,
):
    _check(query, key, value, dropout_p)
    if _jax_attention_applies(query, key, value, attn_bias):
        # autodiff of the forward: its recomputation is the forward's ops on the same inputs, which XLA
        # merges with the forward's when both are in one program
        _, pullback = jax.vjp(lambda q, k, v: _jax_attention(q, k, v, is_causal, scale), query, key, value)
        with as_jax_default():
            dq, dk, dv = pullback(grad_out.astype(query.dtype))
        return dq, dk, dv, None
    hk = key.shape[-3]
    s, scale = _scores(query, key, attn_bias, is_causal, scale)
    acc = s.dtype
    p = probabilities(s)[0]  # = exp(s - logsumexp), as the forward computed it (see probabilities)
    g = grad_out.astype(acc)
    pg, gg = _grouped(p, hk), _grouped(g, hk)
    dv = _einsum("...hgqk,...hgqd->...hkd", pg, gg, acc)
    dp = _einsum("...hgqd,...hkd->...hgqk", gg, value.astype(acc), acc)
    delta = jnp.sum(gg * _grouped(out.astype(acc), hk), axis=-1, keepdims=True)
    dscores = pg * (dp - delta)  # the gradient of the scaled, biased scores
    dq = _flat(_einsum("...hgqk,...hkd->...hgqd", dscores, key.astype(acc), acc)) * jnp.asarray(scale, acc)
    dk = _einsum("...hgqk,...hgqd->...hkd", dscores, _grouped(query.astype(acc), hk), acc) * jnp.asarray(scale, acc)
    dbias = None
    if attn_bias is not None and attn_bias.dtype != jnp.bool_ and grad_input_mask[3]:
        dbias = _sum_to(_flat(dscores), attn_bias.shape).astype(attn_bias.dtype)
    return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype), dbias


def _sum_to(x, shape):
    """``x`` summed over the dims a tensor of ``shape`` was broadcast along to reach x's shape."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and x.shape[lead + i] != 1)
    return jnp.sum(x, axis=axes, keepdims=True).reshape(shape)
