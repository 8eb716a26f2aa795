"""Lowerings of the fused inference ops of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``:
``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd`` and ``_masked_softmax``.

torch's modules take these "fast paths" in ``eval()`` without autograd (``torch.no_grad()`` or
parameters that do not require grad) with ``batch_first=True`` and an even number of heads; the
device check accepts the PrivateUse1 backend, so shardtensor tensors reach them.

Semantics of torch's CPU kernels (``aten/src/ATen/native/transformers``):
  * q, k, v come from one packed ``qkv_weight`` (3D, D) and ``qkv_bias``; q is scaled by
    ``1/sqrt(head_dim)`` after its bias is added;
  * a mask is boolean "masked out" — a float mask is turned into bool by ``!= 0`` (the modules pass
    additive 0/-inf masks, so -inf means masked) — shaped by ``mask_type``: 0 = (L, S) attention mask,
    1 = (B, S) key padding mask, 2 / None = broadcastable to (B, H, L, S);
  * a query row whose every key is masked gets NaN weights and output (as the decomposed path);
  * the second result is the attention weights when ``need_weights`` (averaged over heads when
    ``average_attn_weights``), otherwise nothing (the dispatch layer turns it into ``None``);
  * the encoder layer is ``LN1(x + MHA(x))`` then ``LN2(x + FFN(x))`` (or the pre-norm order with
    ``norm_first``), FFN = linear, ReLU or exact GELU, linear.

Example::

    out, weights = lookup(aten._native_multi_head_attention.default).fn(
        x, x, x, 16, 2, in_w, in_b, out_w, out_b, None, True, True, None)
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch

from shardtensor.ops._promote import acc_dtype
from shardtensor.ops.activation import gelu, relu
from shardtensor.ops.norm import native_layer_norm
from shardtensor.ops.precision import precision
from shardtensor.ops.registry import register

aten = torch.ops.aten


def _linear(x, weight, bias):
    """x @ weight.T + bias at full float32 precision, rounded once to x's dtype."""
    acc = acc_dtype(x.dtype)
    y = jnp.matmul(x, weight.T, precision=precision(), preferred_element_type=acc) + bias.astype(acc)
    return y.astype(x.dtype)


def _masked_out(mask, mask_type, scores_shape):
    """The boolean "masked out" array broadcast to the scores' (B, H, L, S) shape."""
    if mask.dtype != jnp.bool_:
        mask = mask != 0  # torch's kernel converts a float mask with .to(bool)
    if mask_type == 1:  # key padding mask (B, S)
        mask = mask[:, None, None, :]
    return jnp.broadcast_to(mask, scores_shape)


def masked_softmax_rows(scores, masked):
    """Softmax over the last axis leaving out ``masked`` entries; a row with every entry masked is NaN
    (torch's CPU kernel; its CUDA kernel gives 0)."""
    acc = acc_dtype(scores.dtype)
    s = scores.astype(acc)
    if masked is not None:
        s = jnp.where(masked, -jnp.inf, s)
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    return (e / jnp.sum(e, axis=-1, keepdims=True)).astype(scores.dtype)


@register(aten._masked_softmax.default)
def masked_softmax(x, mask, dim=None, mask_type=None):
    """``_masked_softmax``: softmax over ``dim`` where ``mask`` is True means left out."""
    dim = x.ndim - 1 if dim is None else dim % x.ndim
    if mask_type == 0:  # (L, L) source mask
        if mask.ndim != 2 or mask.shape[0] != mask.shape[1]:
            raise RuntimeError("For mask_type == 0 mask shape should be (L, L)")
        mask = jnp.broadcast_to(mask, x.shape)
    elif mask_type == 1:  # (B, L) padding mask for (B, H, L, L) scores
        if mask.ndim != 2 or x.ndim != 4 or mask.shape != (x.shape[0], x.shape[-1]):
            raise RuntimeError("For mask_type == 1 mask shape should be (B, L)")
        mask = jnp.broadcast_to(mask[:, None, None, :], x.shape)
    masked = jnp.moveaxis(jnp.broadcast_to(mask.astype(jnp.bool_), x.shape), dim, -1)
    return jnp.moveaxis(masked_softmax_rows(jnp.moveaxis(x, dim, -1), masked), -1, dim)


def _check_mha(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias):
    if query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
        raise RuntimeError(f"expected 3-D `query`, `key` and `value`, got {query.ndim}-D, {key.ndim}-D, {value.ndim}-D")
    if query.shape[2] != embed_dim:
        raise RuntimeError(f"passed-in embed_dim {embed_dim} didn't match last dim of query {query.shape[2]}")
    if not (query.shape == key.shape == value.shape):
        raise RuntimeError("expected `query`/`key`/`value` shapes to match")
    if tuple(qkv_weight.shape) != (3 * embed_dim, embed_dim) or tuple(qkv_bias.shape) != (3 * embed_dim,):
        raise RuntimeError(
            f"expected `qkv_weight` of shape [{3 * embed_dim}, {embed_dim}] and `qkv_bias` of shape "
            f"[{3 * embed_dim}], got {list(qkv_weight.shape)} and {list(qkv_bias.shape)}"
        )
    if embed_dim % num_head:
        raise RuntimeError("`embed_dim` must divide evenly by `num_heads`")


@register(aten._native_multi_head_attention.default, products=True)
def native_multi_head_attention(
    query,
    key,
    value,
    embed_dim,
    num_head,
    qkv_weight,
    qkv_bias,
    proj_weight,
    proj_bias,
    mask=None,
    need_weights=True,
    average_attn_weights=True,
    mask_type=None,
):
    _check_mha(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias)
    B, T, D = query.shape
    head_dim = D // num_head
    w_q, w_k, w_v = jnp.split(qkv_weight, 3)
    b_q, b_k, b_v = jnp.split(qkv_bias, 3)

    def heads(x):  # (B, T, D) -> (B, H, T, head_dim)
        return x.reshape(B, T, num_head, head_dim).transpose(0, 2, 1, 3)

    q = heads(_linear(query, w_q, b_q) * jnp.asarray(1.0 / math.sqrt(head_dim), query.dtype))
    k, v = heads(_linear(key, w_k, b_k)), heads(_linear(value, w_v, b_v))
    acc = acc_dtype(query.dtype)
    scores = jnp.matmul(q, jnp.swapaxes(k, -1, -2), precision=precision(), preferred_element_type=acc)
    scores = scores.astype(query.dtype)
    masked = None if mask is None else _masked_out(mask, mask_type, scores.shape)
    weights = masked_softmax_rows(scores, masked)
    ctx = jnp.matmul(weights, v, precision=precision(), preferred_element_type=acc).astype(query.dtype)
    out = _linear(ctx.transpose(0, 2, 1, 3).reshape(B, T, D), proj_weight, proj_bias)
    if not need_weights:
        return out, jnp.zeros((0,), query.dtype)
    if average_attn_weights:
        weights = (weights.astype(acc).sum(axis=1) / num_head).astype(query.dtype)
    return out, weights


def _layer_norm(x, weight, bias, eps):
    return native_layer_norm(x, (x.shape[-1],), weight, bias, eps)[0]


@register(aten._transformer_encoder_layer_fwd.default, products=True)
def transformer_encoder_layer_fwd(
    src,
    embed_dim,
    num_heads,
    qkv_weight,
    qkv_bias,
    proj_weight,
    proj_bias,
    use_gelu,
    norm_first,
    eps,
    norm_weight_1,
    norm_bias_1,
    norm_weight_2,
    norm_bias_2,
    ffn_weight_1,
    ffn_bias_1,
    ffn_weight_2,
    ffn_bias_2,
    mask=None,
    mask_type=None,
):
    def attention(x):
        return native_multi_head_attention(
            x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, False, True, mask_type
        )[0]

    def feed_forward(x):
        h = _linear(x, ffn_weight_1, ffn_bias_1)
        h = gelu(h) if use_gelu else relu(h)
        return _linear(h, ffn_weight_2, ffn_bias_2)

    if norm_first:
        x = src + attention(_layer_norm(src, norm_weight_1, norm_bias_1, eps))
        return x + feed_forward(_layer_norm(x, norm_weight_2, norm_bias_2, eps))
    x = _layer_norm(src + attention(src), norm_weight_1, norm_bias_1, eps)
    return _layer_norm(x + feed_forward(x), norm_weight_2, norm_bias_2, eps)
