"""``torch_xla.experimental.custom_kernel`` under the face: ``flash_attention`` with PyTorch/XLA's
signature and defaults on shardtensor's Pallas kernel (``st.kernels.flash_attention``).

Mind PyTorch/XLA's default ``sm_scale=1.0``: the scores are ``q @ k^T`` unscaled, so scripts divide ``q``
by ``sqrt(head_dim)`` themselves (shardtensor's own ``st.kernels.flash_attention(scale=None)`` scales by
``1/sqrt(head_dim)`` as ``F.scaled_dot_product_attention`` does).
"""

from __future__ import annotations

from typing import Any

import torch

import shardtensor as st
from shardtensor.xla.face import _support


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    q_segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    sm_scale: float = 1.0,
    *,
    ab: torch.Tensor | None = None,
    partition_spec: Any = None,
    mesh: Any = None,
) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) tensors by a Pallas flash-attention kernel, forward
    and backward: ``softmax(sm_scale * q @ k^T) @ v`` (``sm_scale`` defaults to 1.0, as in PyTorch/XLA).
    With ``partition_spec`` (batch and heads only, e.g. ``('fsdp', None, None, None)``) the kernel runs
    on each device's shard of ``mesh`` (default: the global mesh)."""
    if q_segment_ids is not None or kv_segment_ids is not None:
        raise NotImplementedError(
            "flash_attention(q_segment_ids=, kv_segment_ids=): segment ids are not supported by shardtensor's "
            "kernel; use F.scaled_dot_product_attention with a mask built from the segment ids."
        )
    if ab is not None:
        raise NotImplementedError(
            "flash_attention(ab=...): an attention bias is not supported by shardtensor's kernel; use "
            "F.scaled_dot_product_attention(q, k, v, attn_mask=ab, scale=sm_scale)."
        )
    if partition_spec is None:
        return st.kernels.flash_attention(q, k, v, causal=causal, scale=sm_scale)
    if isinstance(mesh, str):
        mesh = st.Mesh.from_str(mesh)
    mesh = mesh if mesh is not None else st.get_global_mesh()
    if mesh is None:
        raise ValueError(
            "flash_attention(partition_spec=...) needs a mesh: pass mesh= or set one with xs.set_global_mesh(mesh)."
        )
    return st.kernels.flash_attention(q, k, v, causal=causal, scale=sm_scale, mesh=mesh, spec=tuple(partition_spec))


_NOT_PORTED = "this Pallas kernel of PyTorch/XLA is not ported; write it with pl.pallas_call inside st.jax_op"
__getattr__ = _support.module_getattr(
    "torch_xla.experimental.custom_kernel",
    {
        "_shard_map": "use st.shard_map(fn, mesh, in_specs, out_specs)",
        "make_kernel_from_pallas": "use st.jax_op(jax_fn) on a function that calls pl.pallas_call",
        "trace_pallas": "use st.jax_op(jax_fn) on a function that calls pl.pallas_call",
        "paged_attention": _NOT_PORTED,
        "multi_queries_paged_attention": _NOT_PORTED,
        "ragged_paged_attention": _NOT_PORTED,
        "gmm": _NOT_PORTED,
        "tgmm": _NOT_PORTED,
        "quantized_matmul_int8": _NOT_PORTED,
        "FlashAttention": "call flash_attention(q, k, v, ...)",
    },
)
