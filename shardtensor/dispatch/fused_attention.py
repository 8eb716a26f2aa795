"""The special handlers of ``_scaled_dot_product_fused_attention_overrideable`` (the one op
``F.scaled_dot_product_attention`` becomes on shardtensor's device) and of its backward.

Each is recorded as its lowering (``ops/fused_attention.py``), or, on a TPU where JAX's Pallas splash
kernel applies and torch's flash backend is enabled (torch's default), as the kernel's ops
(``ops/tpu_attention.py``): the choice is read when the op is recorded, so it is part of the recorded
graph and of the executable cache key. ``with torch.nn.attention.sdpa_kernel(SDPBackend.OVERRIDEABLE)``
(flash not among the backends) keeps XLA's attention (add SDPBackend.MATH for CPU tensors). The
forward's results are tensors only; the schema's two SymInt results (max_q, max_k: the query and key
lengths) are filled in here.
"""

from __future__ import annotations

import torch

from shardtensor import runtime
from shardtensor.dispatch.record import record_and_wrap
from shardtensor.dispatch.table import special
from shardtensor.ops import tpu_attention

aten = torch.ops.aten
shardtensor_ops = torch.ops.shardtensor


def splash_chosen(query, key, value, attn_bias, dropout_p) -> bool:
    """Whether this SDPA runs through the splash kernel: on a single TPU chip, torch's flash backend
    enabled, and the kernel applies (``tpu_attention.kernel_applies``).

    Example: ``splash_chosen(q, k, v, None, 0.0)``   # False on a CPU
    """
    return (
        torch.backends.cuda.flash_sdp_enabled()
        and tpu_attention.kernel_applies(query, key, value, attn_bias, dropout_p)
        and _on_tpu()
    )


def _on_tpu() -> bool:
    # one chip: the kernel is opaque to XLA's partitioner, which would run it whole on every device of
    # a larger mesh (gathering a batch-sharded q, k, v); there XLA's attention stays partitioned
    return runtime.platform() == "tpu" and runtime.global_runtime_device_count() == 1


def _scale(query, kwargs) -> float:
    scale = kwargs.get("scale")
    return tpu_attention.default_scale(query) if scale is None else float(scale)


def _arg(args, kwargs, index, name, default):
    return args[index] if len(args) > index else kwargs.get(name, default)


@special(aten._scaled_dot_product_fused_attention_overrideable.default)
def _fused_attention(func, args, kwargs):
    """(out, logsumexp, None, None, max_q, max_k, None, None, None), as the op's schema orders them."""
    query, key, value = args[:3]
    attn_bias, dropout_p = _arg(args, kwargs, 3, "attn_bias", None), _arg(args, kwargs, 4, "dropout_p", 0.0)
    if splash_chosen(query, key, value, attn_bias, dropout_p):
        is_causal = bool(_arg(args, kwargs, 5, "is_causal", False))
        scale = _scale(query, kwargs)
        out, lse = record_and_wrap(shardtensor_ops.splash_attention.default, (query, key, value, is_causal, scale), {})
        results = [out, lse, None, None, None, None, None, None, None]
    else:
        results = list(record_and_wrap(func, args, kwargs))
    results[4], results[5] = query.shape[-2], key.shape[-2]
    return tuple(results)


@special(aten._scaled_dot_product_fused_attention_overrideable_backward.default)
def _fused_attention_backward(func, args, kwargs):
    """(grad_query, grad_key, grad_value, grad_attn_bias)."""
    grad_out, query, key, value, attn_bias = args[:5]
    dropout_p, is_causal = _arg(args, kwargs, 12, "dropout_p", 0.0), _arg(args, kwargs, 13, "is_causal", False)
    if splash_chosen(query, key, value, attn_bias, dropout_p):
        scale = _scale(query, kwargs)
        op = shardtensor_ops.splash_attention_backward.default
        return (*record_and_wrap(op, (grad_out, query, key, value, bool(is_causal), scale), {}), None)
    return record_and_wrap(func, args, kwargs)
