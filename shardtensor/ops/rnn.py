"""The fused LSTM and GRU cell ops and their backward (``aten._thnn_fused_lstm_cell`` /
``_thnn_fused_gru_cell``): what ``nn.LSTM``, ``nn.GRU``, ``nn.LSTMCell`` and ``nn.GRUCell`` call on
any device but the CPU (torch has kernels for them on CUDA only). The gate formulas are those of
``torch.lstm_cell`` / ``torch.gru_cell`` on CPU; the workspace that forward saves for backward holds,
as in torch's CUDA kernels, the activated gates (LSTM: i, f, g, o) and, for the GRU, the reset,
update and new gates, ``hx`` and the hidden part of the new gate.

Example::

    lstm = torch.nn.LSTM(4, 8).to(st.device())
    out, (h, c) = lstm(st.shard(torch.randn(5, 6, 4), mesh, (None, "x", None)))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from shardtensor.ops._promote import acc_dtype
from shardtensor.ops.registry import register

aten = torch.ops.aten


def _gates(input_gates, hidden_gates, input_bias, hidden_bias, acc):
    """input_gates + hidden_gates + both biases, in the accumulation dtype."""
    gates = input_gates.astype(acc) + hidden_gates.astype(acc)
    for bias in (input_bias, hidden_bias):
        if bias is not None:
            gates = gates + bias.astype(acc)
    return gates


@register(aten._thnn_fused_lstm_cell.default, meta_from_lowering=True)  # torch's meta fails without biases
def thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """(hy, cy, workspace): cy = f * cx + i * g, hy = o * tanh(cy), the gates (i, f, g, o) chunks of
    the summed gate pre-activations (sigmoid, sigmoid, tanh, sigmoid); workspace = the activated gates."""
    acc = acc_dtype(cx.dtype)
    i, f, g, o = jnp.split(_gates(input_gates, hidden_gates, input_bias, hidden_bias, acc), 4, axis=1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * cx.astype(acc) + i * g
    hy = o * jnp.tanh(cy)
    workspace = jnp.concatenate([i, f, g, o], axis=1)
    return hy.astype(cx.dtype), cy.astype(cx.dtype), workspace.astype(input_gates.dtype)


@register(aten._thnn_fused_lstm_cell_backward_impl.default)
def thnn_fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """(grad_gates, grad_cx, grad_bias) of ``thnn_fused_lstm_cell`` from its saved ``workspace``;
    grad_bias is the batch sum of grad_gates (None without biases)."""
    if grad_hy is None and grad_cy is None:
        return None, None, None
    acc = acc_dtype(cx.dtype)
    i, f, g, o = jnp.split(workspace.astype(acc), 4, axis=1)
    cx_, cy_ = cx.astype(acc), cy.astype(acc)
    grad_hy = jnp.zeros_like(cy_) if grad_hy is None else grad_hy.astype(acc)
    tanh_cy = jnp.tanh(cy_)
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        grad_c = grad_c + grad_cy.astype(acc)
    grad_gates = jnp.concatenate(
        [
            grad_c * g * i * (1 - i),
            grad_c * cx_ * f * (1 - f),
            grad_c * i * (1 - g * g),
            grad_hy * tanh_cy * o * (1 - o),
        ],
        axis=1,
    )
    grad_bias = grad_gates.sum(0).astype(workspace.dtype) if has_bias else None
    return grad_gates.astype(workspace.dtype), (grad_c * f).astype(cx.dtype), grad_bias


@register(aten._thnn_fused_gru_cell.default)
def thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """(hy, workspace): r = sigmoid(i_r + h_r), z = sigmoid(i_z + h_z), n = tanh(i_n + r * h_n),
    hy = n + z * (hx - n), biases added to their side; workspace = (r, z, n, hx, h_n)."""
    acc = acc_dtype(hx.dtype)
    gi = input_gates.astype(acc) + (0 if input_bias is None else input_bias.astype(acc))
    gh = hidden_gates.astype(acc) + (0 if hidden_bias is None else hidden_bias.astype(acc))
    i_r, i_z, i_n = jnp.split(gi, 3, axis=1)
    h_r, h_z, h_n = jnp.split(gh, 3, axis=1)
    r = jax.nn.sigmoid(i_r + h_r)
    z = jax.nn.sigmoid(i_z + h_z)
    n = jnp.tanh(i_n + r * h_n)
    hx_ = hx.astype(acc)
    hy = n + z * (hx_ - n)
    workspace = jnp.concatenate([r, z, n, hx_, h_n], axis=1)
    return hy.astype(hx.dtype), workspace.astype(input_gates.dtype)


@register(aten._thnn_fused_gru_cell_backward.default)
def thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias):
    """(grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias) of
    ``thnn_fused_gru_cell`` from its saved ``workspace``; bias gradients are batch sums (None
    without biases)."""
    acc = acc_dtype(workspace.dtype)
    r, z, n, hx, h_n = jnp.split(workspace.astype(acc), 5, axis=1)
    g = grad_hy.astype(acc)
    grad_n = g * (1 - z) * (1 - n * n)
    grad_z = g * (hx - n) * z * (1 - z)
    grad_r = grad_n * h_n * r * (1 - r)
    grad_input = jnp.concatenate([grad_r, grad_z, grad_n], axis=1)
    grad_hidden = jnp.concatenate([grad_r, grad_z, grad_n * r], axis=1)
    dt = grad_hy.dtype
    biases = (grad_input.sum(0).astype(dt), grad_hidden.sum(0).astype(dt)) if has_bias else (None, None)
    return grad_input.astype(dt), grad_hidden.astype(dt), (g * z).astype(dt), *biases
