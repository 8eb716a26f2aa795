"""The fused LSTM / GRU cell lowerings (shardtensor/ops/rnn.py) against eager torch on CPU.

torch has kernels for ``aten._thnn_fused_*_cell`` on CUDA only, so the references are torch's CPU
cells (``torch.lstm_cell`` / ``torch.gru_cell`` on the same weights) for the forward, and torch's
composite ``_thnn_differentiable_*_cell_backward`` (what autograd runs under create_graph) for the
backward. nn.LSTM / nn.GRU / nn.LSTMCell / nn.GRUCell, sharded, are checked by tests/test_nn_modules.py.
"""

import pytest
import torch

from _lowering_harness import TIGHT, assert_same, aten, call, randn

F64 = torch.float64
B, IN, H = 5, 3, 4


def _gates(n_gates, bias, seed):
    """(input, hx, w_ih, w_hh, b_ih, b_hh, input_gates, hidden_gates) of a cell with ``n_gates`` gates."""
    x, hx = randn(B, IN, dtype=F64, seed=seed), randn(B, H, dtype=F64)
    w_ih, w_hh = randn(n_gates * H, IN, dtype=F64), randn(n_gates * H, H, dtype=F64)
    b_ih, b_hh = (randn(n_gates * H, dtype=F64), randn(n_gates * H, dtype=F64)) if bias else (None, None)
    return x, hx, w_ih, w_hh, b_ih, b_hh, x @ w_ih.T, hx @ w_hh.T


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_lstm_cell_forward_and_backward(bias):
    x, hx, w_ih, w_hh, b_ih, b_hh, ig, hg = _gates(4, bias, seed=21)
    cx = randn(B, H, dtype=F64)
    want_h, want_c = torch.lstm_cell(x, (hx, cx), w_ih, w_hh, b_ih, b_hh)
    hy, cy, workspace = call(aten._thnn_fused_lstm_cell.default, ig, hg, cx, b_ih, b_hh)
    assert_same((hy, cy), (want_h, want_c), **TIGHT)
    assert workspace.shape == (B, 4 * H)

    grad_hy, grad_cy = randn(B, H, dtype=F64, seed=22), randn(B, H, dtype=F64)
    for gh, gc in ((grad_hy, grad_cy), (grad_hy, None), (None, grad_cy)):
        ref = aten._thnn_differentiable_lstm_cell_backward(gh, gc, ig, hg, b_ih, b_hh, cx, want_c)
        got = call(aten._thnn_fused_lstm_cell_backward_impl.default, gh, gc, cx, want_c, torch.tensor(workspace), bias)
        assert_same(got[0], ref[0], **TIGHT)  # gates
        assert_same(got[1], ref[2], **TIGHT)  # cx
        if bias:
            assert_same(got[2], ref[3], **TIGHT)
        else:
            assert got[2] is None


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_gru_cell_forward_and_backward(bias):
    x, hx, w_ih, w_hh, b_ih, b_hh, ig, hg = _gates(3, bias, seed=23)
    want = torch.gru_cell(x, hx, w_ih, w_hh, b_ih, b_hh)
    hy, workspace = call(aten._thnn_fused_gru_cell.default, ig, hg, hx, b_ih, b_hh)
    assert_same(hy, want, **TIGHT)
    assert workspace.shape == (B, 5 * H)

    grad_hy = randn(B, H, dtype=F64, seed=24)
    ref = aten._thnn_differentiable_gru_cell_backward(grad_hy, ig, hg, hx, b_ih, b_hh)
    got = call(aten._thnn_fused_gru_cell_backward.default, grad_hy, torch.tensor(workspace), bias)
    assert_same(got[:3], ref[:3], **TIGHT)  # input gates, hidden gates, hx
    if bias:
        assert_same(got[3:], ref[3:], **TIGHT)
    else:
        assert got[3] is None and got[4] is None
