"""The inference fast paths of ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and
``nn.TransformerEncoder`` (``eval()`` under ``torch.no_grad()``) on shardtensor tensors against eager
torch on CPU: ``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd`` and the encoder's
nested-tensor path with a ``src_key_padding_mask`` (shardtensor/ops/transformer.py,
shardtensor/dispatch/nested.py). Inputs are batch-sharded over an (8,) or a (4, 2) mesh and some
parameters are sharded too; lazy mode unless a test says otherwise.

Rows whose every key is masked are NaN in torch's CPU kernel and here (compared with equal_nan).
"""

from unittest import mock

import pytest
import torch
from torch import nn

import shardtensor as st
from shardtensor.dispatch.nested import PaddedNested

TOL = {"rtol": 1e-5, "atol": 1e-5}
B, T, E, HEADS = 8, 5, 16, 2


def _mesh(name):
    return st.Mesh(range(8), (8,), ("x",)) if name == "8" else st.Mesh(range(8), (4, 2), ("x", "y"))


def _padding():
    """(B, T) key padding: left-aligned rows, a full row, a row with a single token, an all-padding row."""
    lengths = [5, 3, 1, 5, 0, 4, 2, 5]
    return torch.arange(T)[None, :] >= torch.tensor(lengths)[:, None]


def _device_copy(module, mesh):
    """``module`` moved to st.device(), its packed q/k/v projection sharded over the mesh's last axis."""
    dev = module.to(st.device())
    attention = next(m for m in dev.modules() if isinstance(m, nn.MultiheadAttention))
    st.mark_sharding(attention.in_proj_weight, mesh, (mesh.axis_names[-1], None))
    return dev


def _on_device(value, mesh):
    """``value`` on st.device(), sharded over "x" on its batch dimension (the first of size B)."""
    if not isinstance(value, torch.Tensor):
        return value
    if B not in value.shape:
        return value.to(st.device())
    spec = [None] * value.dim()
    spec[list(value.shape).index(B)] = "x"
    return st.shard(value, mesh, tuple(spec))


def _run(module, mesh, *args, **kwargs):
    """(eager CPU result, shardtensor result) of ``module(*args, **kwargs)`` in eval, under no_grad."""
    module.eval()
    with torch.no_grad():
        ref = module(*args, **kwargs)
        dev = _device_copy(module, mesh)
        moved = {id(a): _on_device(a, mesh) for a in args}  # query is key is value stays true on the device
        out = dev(*(moved[id(a)] for a in args), **{k: _on_device(v, mesh) for k, v in kwargs.items()})
    return ref, out


MHA_CASES = {
    "plain": {},
    "no_weights": {"need_weights": False},
    "per_head_weights": {"average_attn_weights": False},
    "key_padding": {"key_padding_mask": _padding()},
    "attn_mask": {"attn_mask": torch.rand(T, T, generator=torch.Generator().manual_seed(3)) > 0.6},
    "both_masks_per_head": {
        "key_padding_mask": _padding(),
        "attn_mask": nn.Transformer.generate_square_subsequent_mask(T) == 0,
        "average_attn_weights": False,
    },
    "causal": {"attn_mask": nn.Transformer.generate_square_subsequent_mask(T).isinf(), "is_causal": True},
}


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("case", list(MHA_CASES))
def test_multihead_attention(case, batch_first):
    torch.manual_seed(0)
    mesh = _mesh("4x2" if batch_first else "8")
    mha = nn.MultiheadAttention(E, HEADS, batch_first=batch_first)
    x = torch.randn(B, T, E)
    if not batch_first:
        x = x.transpose(0, 1).contiguous()
    spy = mock.patch.object(torch, "_native_multi_head_attention", wraps=torch._native_multi_head_attention)
    with spy as fused:
        ref, out = _run(mha, mesh, x, x, x, **MHA_CASES[case])
    # the fast path in eager torch and on shardtensor; torch takes it only with batch_first
    assert fused.call_count == (2 if batch_first else 0)
    torch.testing.assert_close(out[0].cpu(), ref[0], equal_nan=True, **TOL)
    if ref[1] is None:
        assert out[1] is None
    else:
        torch.testing.assert_close(out[1].cpu(), ref[1], equal_nan=True, **TOL)


def _layer(norm_first, activation):
    return nn.TransformerEncoderLayer(
        E, HEADS, 32, dropout=0.0, batch_first=True, norm_first=norm_first, activation=activation
    )


@pytest.mark.parametrize(
    "norm_first, activation, masks",
    [
        (False, "relu", {}),
        (False, "gelu", {"src_key_padding_mask": _padding()}),
        (True, "gelu", {"src_mask": nn.Transformer.generate_square_subsequent_mask(T), "is_causal": True}),
        (True, "relu", {"src_key_padding_mask": _padding(), "src_mask": torch.rand(T, T) > 0.7}),
        # a float mask: torch's fused kernel masks every nonzero entry (it converts the mask to bool)
        (False, "relu", {"src_mask": torch.zeros(T, T).index_fill_(1, torch.tensor([2]), 0.5)}),
    ],
)
def test_encoder_layer(norm_first, activation, masks):
    torch.manual_seed(1)
    spy = mock.patch.object(torch, "_transformer_encoder_layer_fwd", wraps=torch._transformer_encoder_layer_fwd)
    with spy as fused:
        ref, out = _run(_layer(norm_first, activation), _mesh("8"), torch.randn(B, T, E), **masks)
    assert fused.call_count == 2
    torch.testing.assert_close(out.cpu(), ref, equal_nan=True, **TOL)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("eager", [False, True], ids=["lazy", "eager"])
def test_encoder_nested_path(eager):
    """enable_nested_tensor=True with a padding mask: torch packs the valid tokens into a nested tensor
    and unpacks with zeros; the output equals eager torch's, padding positions included."""
    torch.manual_seed(2)
    enc = nn.TransformerEncoder(_layer(False, "gelu"), 2, norm=nn.LayerNorm(E), enable_nested_tensor=True)
    enc.norm.bias.data.normal_()  # the final norm of the zero padding rows gives its bias
    assert enc.use_nested_tensor
    pad = _padding()
    spy = mock.patch.object(torch, "_nested_tensor_from_mask", wraps=torch._nested_tensor_from_mask)
    with st.eager_mode(eager), spy as nested:
        ref, out = _run(enc, _mesh("4x2"), torch.randn(B, T, E), src_key_padding_mask=pad)
    assert nested.call_count == 2
    torch.testing.assert_close(ref[pad], enc.norm.bias.detach().cpu().expand(int(pad.sum()), E))
    torch.testing.assert_close(out.cpu(), ref, **TOL)


def test_encoder_mask_not_left_aligned():
    """A mask with gaps: torch's mask check sends the encoder down its dense path, here too."""
    torch.manual_seed(3)
    enc = nn.TransformerEncoder(_layer(False, "relu"), 1, enable_nested_tensor=True)
    pad = _padding()
    pad[1, 2] = True  # a gap in a row
    ref, out = _run(enc, _mesh("8"), torch.randn(B, T, E), src_key_padding_mask=pad)
    torch.testing.assert_close(out.cpu(), ref, equal_nan=True, **TOL)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_stand_in_ops_and_errors():
    x = torch.randn(3, 4, 2)
    valid = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    xd, vd = x.to(st.device()), valid.to(st.device())
    assert torch._nested_tensor_from_mask_left_aligned(xd, vd) is True
    assert torch._nested_tensor_from_mask_left_aligned(xd, vd.flip(1)) is False
    nested = torch._nested_tensor_from_mask(xd, vd)
    assert isinstance(nested, PaddedNested) and nested.is_nested
    ref = torch._nested_tensor_from_mask(x, valid)
    torch.testing.assert_close(nested.to_padded_tensor(0.5).cpu(), ref.to_padded_tensor(0.5))  # (3, 3, 2)
    torch.testing.assert_close(nested.to_padded_tensor(-1.0, (3, 6, 4)).cpu(), ref.to_padded_tensor(-1.0, (3, 6, 4)))
    # torch keeps the first mask.sum(1) tokens of each row when it does not check the mask
    ref = torch._nested_tensor_from_mask(x, valid.flip(1), mask_check=False).to_padded_tensor(0.0, x.shape)
    got = torch._nested_tensor_from_mask(xd, vd.flip(1), mask_check=False).to_padded_tensor(0.0, x.shape)
    torch.testing.assert_close(got.cpu(), ref)
    with pytest.raises(RuntimeError, match="Mask must be left-aligned without gaps"):
        torch._nested_tensor_from_mask(xd, vd.flip(1))
    with pytest.raises(RuntimeError, match="Expected mask to be of ScalarType Bool"):
        torch._nested_tensor_from_mask(xd, vd.float())
    with pytest.raises(NotImplementedError, match="padded stand-in"):
        nested + 1
    with pytest.raises(NotImplementedError, match="to_padded_tensor"):
        xd.to_padded_tensor(0.0)


def test_masked_softmax():
    """``_masked_softmax`` (True = left out) for each mask type; a row with every entry masked is NaN."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 2, 4, 4, generator=g)
    key_padding = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    cases = [
        (torch.rand(4, 4, generator=g) > 0.5, 0),  # (L, L) source mask
        (key_padding, 1),  # (B, S) key padding mask
        (torch.rand(2, 2, 4, 4, generator=g) > 0.5, 2),  # full mask
    ]
    for mask, mask_type in cases:
        ref = torch._masked_softmax(x, mask, 3, mask_type)
        got = torch._masked_softmax(x.to(st.device()), mask.to(st.device()), 3, mask_type)
        torch.testing.assert_close(got.cpu(), ref, equal_nan=True, **TOL)
    with pytest.raises(RuntimeError, match=r"For mask_type == 0 mask shape should be \(L, L\)"):
        torch._masked_softmax(x.to(st.device()), key_padding.to(st.device()), 3, 0)
