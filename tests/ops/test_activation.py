"""Activation lowerings and their backward ops against eager torch on CPU."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _lowering_harness import Batch, make  # noqa: E402

aten = torch.ops.aten
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


def _x(dtype, seed=0):
    # 32 values over [-6, 6] plus the kinks of the piecewise functions and a NaN
    x = make((4, 8), dtype, low=-6, high=6, seed=seed)
    x.view(-1)[:9] = torch.tensor([-3.0, 3.0, 0.0, -1.0, 1.0, 0.5, -0.5, 25.0, float("nan")])
    return x


@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_forward(dtype):
    x = _x(dtype)
    with Batch() as b:
        b.check(aten.relu.default, x)
        b.check(aten.gelu.default, x)
        b.check(aten.gelu.default, x, approximate="tanh")
        b.check(aten.silu.default, x)
        b.check(aten.mish.default, x)
        b.check(aten.leaky_relu.default, x)
        b.check(aten.leaky_relu.default, x, 0.2)
        b.check(aten.elu.default, x)
        b.check(aten.elu.default, x, 1.5, 1.0507, 0.7)
        b.check(aten.celu.default, x, 0.7)
        b.check(aten.softplus.default, x)
        b.check(aten.softplus.default, x, 2, 5)
        b.check(aten.hardtanh.default, x)
        b.check(aten.hardtanh.default, x, -0.5, 2)
        b.check(aten.hardsigmoid.default, x)
        b.check(aten.hardswish.default, x)
        b.check(aten.threshold.default, x, 0.5, -7)
        b.check(aten.glu.default, x)
        b.check(aten.glu.default, x, 0)
        b.check(aten.log_sigmoid_forward.default, x)
        b.check(aten.softshrink.default, x)
        b.check(aten.softshrink.default, x, 1.5)
        b.check(aten.hardshrink.default, x, 1.0)
        b.check(aten._prelu_kernel.default, x, torch.tensor([0.25], dtype=dtype))
        b.check(aten._prelu_kernel.default, x, make((8,), dtype, seed=3))


@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_backward(dtype):
    x, g = _x(dtype), make((4, 8), dtype, seed=1)
    y_sig, y_tanh = torch.sigmoid(x), torch.tanh(x)
    # torch's scalar and vectorised CPU loops disagree on NaN for some backward ops: no NaN there
    xn = x.nan_to_num()
    with Batch() as b:
        b.check(aten.threshold_backward.default, g, x, 0)
        b.check(aten.threshold_backward.default, g, x, 0.5)
        b.check(aten.gelu_backward.default, g, x)
        b.check(aten.gelu_backward.default, g, x, approximate="tanh")
        b.check(aten.silu_backward.default, g, x)
        b.check(aten.mish_backward.default, g, x)
        b.check(aten.sigmoid_backward.default, g, y_sig)
        b.check(aten.tanh_backward.default, g, y_tanh)
        b.check(aten.leaky_relu_backward.default, g, x, 0.01, False)
        b.check(aten.leaky_relu_backward.default, g, torch.nn.functional.leaky_relu(x, 0.2), 0.2, True)
        b.check(aten.elu_backward.default, g, 1.0, 1.0, 1.0, False, xn)
        b.check(aten.elu_backward.default, g, 1.5, 1.0507, 0.7, False, xn)
        b.check(aten.elu_backward.default, g, 1.5, 1.0507, 0.7, True, aten.elu.default(xn, 1.5, 1.0507, 0.7))
        b.check(aten.softplus_backward.default, g, x, 1, 20)
        b.check(aten.softplus_backward.default, g, x, 2, 5)
        b.check(aten.hardtanh_backward.default, g, xn, -1, 1)
        b.check(aten.hardtanh_backward.default, g, xn, -0.5, 2)
        b.check(aten.hardsigmoid_backward.default, g, x)
        b.check(aten.hardswish_backward.default, g, xn)
        b.check(aten.glu_backward.default, make((4, 4), dtype, seed=2), x, -1)
        out, buf = aten.log_sigmoid_forward.default(x)
        b.check(aten.log_sigmoid_backward.default, g, x, buf)
        b.check(aten.softshrink_backward.default, g, x, 0.5)
        b.check(aten.hardshrink_backward.default, g, x, 0.5)
        b.check(aten._prelu_kernel_backward.default, g, x, make((8,), dtype, seed=3))
        p = torch.tensor([0.0, 0.05, 0.3, 0.7, 1.0, 1.2, -0.1, 0.5], dtype=dtype)
        b.check(aten.logit_backward.default, g[0], p)
        b.check(aten.logit_backward.default, g[0], p, 0.1)


def test_relu_int():
    with Batch() as b:
        b.check(aten.relu.default, torch.tensor([-3, 0, 4]))
        b.check(aten.threshold.default, torch.tensor([-3, 0, 4]), 0, 9)


def test_matches_autograd():
    """The backward ops chained as autograd does for F.gelu / F.silu / F.softplus."""
    x = _x(F32).nan_to_num().requires_grad_()
    for fn, back in (
        (torch.nn.functional.silu, aten.silu_backward.default),
        (torch.nn.functional.mish, aten.mish_backward.default),
    ):
        (grad,) = torch.autograd.grad(fn(x).sum(), x)
        with Batch() as b:
            b.check(back, torch.ones_like(x), x.detach())
        torch.testing.assert_close(back(torch.ones_like(x), x.detach()), grad)
