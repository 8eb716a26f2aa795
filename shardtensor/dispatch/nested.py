"""Special handlers for the inference fast paths of ``nn.MultiheadAttention`` and
``nn.TransformerEncoder``: the attention weights ``_native_multi_head_attention`` does not compute,
and the nested-tensor path the encoder takes with a ``src_key_padding_mask``.

The nested path. In ``eval()`` without autograd, with ``batch_first=True``, ``norm_first=False``,
ReLU/GELU, an even head count and a left-aligned padding mask, ``TransformerEncoder`` packs its input
into a nested tensor (``torch._nested_tensor_from_mask``), runs each layer's fused
``_transformer_encoder_layer_fwd`` on the valid tokens only, and unpacks with
``to_padded_tensor(0.0, src.size())``: valid positions hold the layers' output, padding positions
exactly 0 (then the encoder's final ``norm``, if any, is applied to both).

torch's nested tensors cannot hold a shardtensor buffer (there is no nested kernel for the
PrivateUse1 backend) and their ragged shapes depend on the mask's values. shardtensor therefore
stands a dense tensor in for the nested one: ``PaddedNested`` has the padded (B, T, E) shape, zeros
at the padding positions and remembers which positions are valid. The layer op on it runs on the
dense tensor with the padding as a key padding mask — each valid token sees exactly the keys it sees
in the nested computation, and per-token ops (LayerNorm, feed-forward) do not mix tokens — and
``to_padded_tensor`` puts ``padding`` back at the invalid positions. The module's output equals eager
torch's (to float32 rounding) without changing which path the module takes. Any other op on the
stand-in raises (in eager torch most ops on such a nested tensor fail too, and a silent dense result
would differ from torch's).

Example::

    enc = nn.TransformerEncoder(layer, 2).eval().to(st.device())
    with torch.no_grad():
        out = enc(x, src_key_padding_mask=pad)   # zeros where pad is True, as in eager torch
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from shardtensor.dispatch.record import record_and_wrap
from shardtensor.dispatch.table import special
from shardtensor.graph.state import check_execution_allowed
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.readback import to_cpu

aten = torch.ops.aten


class PaddedNested(ShardedTensor):
    """A dense stand-in for the nested tensor ``torch._nested_tensor_from_mask`` makes (see the module
    docstring): the padded values (zeros at padding positions) and ``valid``, a (B, T) bool tensor."""

    valid: ShardedTensor
    _OPS = frozenset({aten._transformer_encoder_layer_fwd.default, aten.to_padded_tensor.default})

    @property
    def is_nested(self) -> bool:  # type: ignore[override]
        """True, as for the nested tensor it stands for (torch's modules check it)."""
        return True

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func not in cls._OPS:
            raise NotImplementedError(
                f"shardtensor: {func} on the nested tensor made by torch._nested_tensor_from_mask: on the "
                "shardtensor device it is a padded stand-in that supports only nn.TransformerEncoder's fast path "
                "(_transformer_encoder_layer_fwd, to_padded_tensor). Convert it with .to_padded_tensor(0.0) first."
            )
        return super().__torch_dispatch__(func, types, args, kwargs)


def _dense(x: ShardedTensor) -> ShardedTensor:
    """A plain ShardedTensor over the same value as the stand-in ``x``."""
    offset = int(x.storage_offset())
    return ShardedTensor(x._cell, x.shape, x.dtype, x._chain, strides=x.stride(), storage_offset=offset)


def _stand_in(values: ShardedTensor, valid: ShardedTensor) -> PaddedNested:
    """``values`` with zeros where ``valid`` is False, as a PaddedNested."""
    zeroed = cast(ShardedTensor, values.masked_fill(valid.logical_not().unsqueeze(-1), 0))
    out = PaddedNested(zeroed._cell, zeroed.shape, zeroed.dtype, zeroed._chain)
    out.valid = valid
    return out


def _check_mask_args(t, mask):
    # torch's messages (aten/src/ATen/native/nested/NestedTensorTransformerFunctions.cpp)
    if mask.dtype != torch.bool:
        raise RuntimeError(f"Expected mask to be of ScalarType Bool, but got {mask.dtype} instead.")
    if t.dim() != 3:
        raise RuntimeError("Input should be a 3D tensor, N * L * D")
    if mask.dim() != 2 or tuple(mask.shape) != tuple(t.shape[:2]):
        raise RuntimeError("Mask size should match input size")


def _left_aligned(mask) -> bool:
    """Every row of ``mask`` is some Trues followed only by Falses (reads the mask, as torch does)."""
    check_execution_allowed("torch._nested_tensor_from_mask_left_aligned reads the padding mask")
    m = to_cpu(mask)
    lengths = m.sum(1, keepdim=True)
    return bool((m == (torch.arange(m.shape[1]) < lengths)).all())


@special(aten._nested_tensor_from_mask_left_aligned.default)
def _nested_left_aligned(func, args, kwargs):
    t, mask = args[0], args[1]
    _check_mask_args(t, mask)
    return _left_aligned(mask)


@special(aten._nested_tensor_from_mask.default)
def _nested_from_mask(func, args, kwargs):
    t, mask = args[0], args[1]
    mask_check = args[2] if len(args) > 2 else kwargs.get("mask_check", True)
    _check_mask_args(t, mask)
    if mask_check and not _left_aligned(mask):
        raise RuntimeError("Mask must be left-aligned without gaps")
    # torch keeps the first mask.sum(1) tokens of each row (the mask is assumed left-aligned)
    lengths = mask.sum(1, keepdim=True)
    valid = torch.arange(t.shape[1], device=t.device) < lengths
    return _stand_in(t, valid)


@special(aten._transformer_encoder_layer_fwd.default)
def _encoder_layer(func, args, kwargs):
    src = args[0]
    if not isinstance(src, PaddedNested):
        return record_and_wrap(func, args, kwargs)
    mask = args[18] if len(args) > 18 else kwargs.get("mask")
    if mask is not None:
        raise RuntimeError("NestedTensor with mask is not supported yet")
    padding = src.valid.logical_not()
    out = record_and_wrap(func, (_dense(src),) + tuple(args[1:18]), {"mask": padding, "mask_type": 1})
    return _stand_in(out, src.valid)


@special(aten.to_padded_tensor.default)
def _to_padded(func, args, kwargs):
    x = args[0]
    padding = args[1] if len(args) > 1 else kwargs["padding"]
    size = args[2] if len(args) > 2 else kwargs.get("output_size")
    if not isinstance(x, PaddedNested):
        raise NotImplementedError(
            "Could not run 'aten::to_padded_tensor' on a dense shardtensor tensor: it is defined for nested tensors"
        )
    out = _dense(x).masked_fill(x.valid.logical_not().unsqueeze(-1), padding)
    # the nested tensor's own padded size: its longest row
    check_needed = size is None or size[1] < out.shape[1]
    longest = int(x.valid.sum(1).max().item()) if check_needed and out.shape[0] else out.shape[1]
    if size is None:
        return out[:, :longest].contiguous()
    if len(size) != out.dim() or size[1] < longest or any(s < n for s, n in zip(size[::2], out.shape[::2])):
        raise RuntimeError("Value in output_size is less than NestedTensor padded size")
    out = out[:, : size[1]]
    grow = [p for s, n in zip(reversed(size), reversed(out.shape)) for p in (0, s - n)]
    return F.pad(out, grow, value=padding) if any(grow) else out.contiguous()


@special(aten._native_multi_head_attention.default)
def _native_mha(func, args, kwargs):
    """torch returns no attention weights (``None``) when ``need_weights`` is False."""
    need_weights = args[10] if len(args) > 10 else kwargs.get("need_weights", True)
    out, weights = record_and_wrap(func, args, kwargs)
    return out, (weights if need_weights else None)
