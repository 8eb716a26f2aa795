"""Activation functions and their backward ops, with the formulas of torch's CPU kernels.

bfloat16/float16 are computed in float32 and rounded at the end, as torch does.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch
from jax import lax

from shardtensor.ops._promote import BOOL, cast, dtype_of, fresh, opmath, promote
from shardtensor.ops.registry import register

aten = torch.ops.aten

_SQRT1_2 = 1 / math.sqrt(2)
_INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)
_GELU_BETA = math.sqrt(2 / math.pi)
_GELU_KAPPA = 0.044715


def _zero(x):
    return jnp.zeros_like(x)


@register(aten.relu.default)
def relu(self):
    dt = dtype_of(self)
    return lax.max(self, jnp.zeros_like(self)) if dt != BOOL else fresh(self)


def _gelu_tanh_inner(x):
    """tanh GELU's argument, sqrt(2/pi) * (x + 0.044715 x^3), as torch's kernels compute it. Forward and
    backward build it with the same ops, so that XLA's common-subexpression pass reuses the forward's
    tanh in the backward (one tanh per element, as autodiff has) instead of computing it twice."""
    return _GELU_BETA * (x + _GELU_KAPPA * (x * x * x))


@register(aten.gelu.default)
def gelu(self, *, approximate="none"):
    rt, ct, x = promote(self)
    if approximate == "tanh":
        out = 0.5 * x * (1 + jnp.tanh(_gelu_tanh_inner(x)))
    else:
        out = x * 0.5 * (1 + lax.erf(x * _SQRT1_2))
    return cast(out, rt)


@register(aten.gelu_backward.default)
def gelu_backward(grad_output, self, *, approximate="none"):
    rt, ct, g, x = promote(grad_output, self)
    if approximate == "tanh":
        x_sq = x * x
        t = jnp.tanh(_gelu_tanh_inner(x))
        left_derivative = 0.5 * (1 + t)
        right_derivative = 0.5 * x * (1 - t * t) * _GELU_BETA * (1 + 3 * _GELU_KAPPA * x_sq)
        out = g * (left_derivative + right_derivative)
    else:
        cdf = 0.5 * (1 + lax.erf(x * _SQRT1_2))
        pdf = jnp.exp(-0.5 * x * x) * _INV_SQRT_2PI
        out = g * (cdf + x * pdf)
    return cast(out, rt)


@register(aten.silu.default)
def silu(self):
    rt, ct, x = promote(self)
    return cast(x / (1 + jnp.exp(-x)), rt)


@register(aten.silu_backward.default)
def silu_backward(grad_output, self):
    rt, ct, g, x = promote(grad_output, self)
    s = 1 / (1 + jnp.exp(-x))
    return cast(g * s * (1 + x * (1 - s)), rt)


@register(aten.mish.default)
def mish(self):
    rt, ct, x = promote(self)
    return cast(x * jnp.tanh(jnp.log1p(jnp.exp(x))), rt)


@register(aten.mish_backward.default)
def mish_backward(grad_output, self):
    rt, ct, g, x = promote(grad_output, self)
    s = 1 / (1 + jnp.exp(-x))
    t = jnp.tanh(jnp.log1p(jnp.exp(x)))
    return cast(g * (t + x * s * (1 - t * t)), rt)


@register(aten.sigmoid_backward.default)
def sigmoid_backward(grad_output, output):
    rt, ct, g, y = promote(grad_output, output)
    return cast(g * (1 - y) * y, rt)


@register(aten.tanh_backward.default)
def tanh_backward(grad_output, output):
    rt, ct, g, y = promote(grad_output, output)
    return cast(g * (1 - y * y), rt)


@register(aten.threshold.default)
def threshold(self, threshold, value):
    dt = dtype_of(self)
    return jnp.where(self <= cast(threshold, dt), cast(value, dt), self)


@register(aten.threshold_backward.default)
def threshold_backward(grad_output, self, threshold):
    rt, ct, g, x = promote(grad_output, self)
    return cast(jnp.where(x <= cast(threshold, ct), _zero(g), g), rt)


@register(aten.leaky_relu.default)
def leaky_relu(self, negative_slope=0.01):
    rt, ct, x = promote(self)
    return cast(jnp.where(x > 0, x, x * cast(negative_slope, ct)), rt)


@register(aten.leaky_relu_backward.default)
def leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    rt, ct, g, x = promote(grad_output, self)
    return cast(jnp.where(x > 0, g, g * cast(negative_slope, ct)), rt)


@register(aten.elu.default)
def elu(self, alpha=1, scale=1, input_scale=1):
    rt, ct, x = promote(self)
    negcoef = cast(alpha, ct) * cast(scale, ct)
    out = jnp.where(x <= 0, jnp.expm1(x * cast(input_scale, ct)) * negcoef, x * cast(scale, ct))
    return cast(out, rt)


@register(aten.elu_backward.default)
def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    rt, ct, g, x = promote(grad_output, self_or_result)
    negcoef = cast(alpha, ct) * cast(scale, ct)
    poscoef = cast(scale, ct)
    negiptcoef = cast(input_scale, ct)
    if is_result:
        neg = g * negiptcoef * (x + negcoef)
    else:
        neg = g * negiptcoef * negcoef * jnp.exp(x * negiptcoef)
    return cast(jnp.where(x > 0, g * poscoef, neg), rt)  # (torch: NaN takes the negative branch)


@register(aten.celu.default)
def celu(self, alpha=1.0):
    rt, ct, x = promote(self)
    a = cast(alpha, ct)
    return cast(jnp.where(x <= 0, jnp.expm1(x * (1 / a)) * a, x), rt)


@register(aten.softplus.default)
def softplus(self, beta=1, threshold=20):
    rt, ct, x = promote(self)
    b = cast(beta, ct)
    xb = x * b
    return cast(jnp.where(xb > cast(threshold, ct), x, jnp.log1p(jnp.exp(xb)) / b), rt)


@register(aten.softplus_backward.default)
def softplus_backward(grad_output, self, beta, threshold):
    rt, ct, g, x = promote(grad_output, self)
    xb = x * cast(beta, ct)
    z = jnp.exp(xb)
    return cast(jnp.where(xb > cast(threshold, ct), g, g * z / (z + 1)), rt)


@register(aten.hardtanh.default)
def hardtanh(self, min_val=-1, max_val=1):
    dt = dtype_of(self)
    ct = opmath(dt)
    x = cast(self, ct)
    return cast(lax.min(lax.max(x, jnp.full_like(x, cast(min_val, ct))), jnp.full_like(x, cast(max_val, ct))), dt)


@register(aten.hardtanh_backward.default)
def hardtanh_backward(grad_output, self, min_val, max_val):
    rt, ct, g, x = promote(grad_output, self)
    # NaN inputs get 0, as torch's vectorised CPU loop (its scalar loop, for tiny tensors, passes grad)
    inside = (x > cast(min_val, ct)) & (x < cast(max_val, ct))
    return cast(jnp.where(inside, g, _zero(g)), rt)


def _relu6(x):
    return jnp.minimum(jnp.maximum(x, 0), 6)


@register(aten.hardsigmoid.default)
def hardsigmoid(self):
    rt, ct, x = promote(self)
    return cast(_relu6(x + 3) / 6, rt)


@register(aten.hardsigmoid_backward.default)
def hardsigmoid_backward(grad_output, self):
    rt, ct, g, x = promote(grad_output, self)
    return cast(jnp.where((x > -3) & (x < 3), g * (1 / 6), _zero(g)), rt)


@register(aten.hardswish.default)
def hardswish(self):
    rt, ct, x = promote(self)
    return cast(x * _relu6(x + 3) / 6, rt)


@register(aten.hardswish_backward.default)
def hardswish_backward(grad_output, self):
    rt, ct, g, x = promote(grad_output, self)
    out = jnp.where(x <= -3, _zero(g), jnp.where(x >= 3, g, g * (x / 3 + 0.5)))
    return cast(out, rt)


def _halves(x, dim):
    dim = dim % x.ndim
    n = x.shape[dim] // 2
    return lax.slice_in_dim(x, 0, n, axis=dim), lax.slice_in_dim(x, n, 2 * n, axis=dim)


@register(aten.glu.default)
def glu(self, dim=-1):
    rt, ct, x = promote(self)
    a, b = _halves(x, dim)
    return cast(a * (1 / (1 + jnp.exp(-b))), rt)


@register(aten.glu_backward.default)
def glu_backward(grad_output, self, dim):
    rt, ct, g, x = promote(grad_output, self)
    a, b = _halves(x, dim)
    s = 1 / (1 + jnp.exp(-b))
    ga = g * s
    gb = g * a * s * (1 - s)
    return cast(jnp.concatenate([ga, gb], axis=dim % x.ndim), rt)


@register(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(self):
    rt, ct, x = promote(self)
    z = jnp.exp(-jnp.abs(x))
    out = jnp.minimum(x, 0) - jnp.log1p(z)
    return cast(out, rt), cast(z, rt)


@register(aten.log_sigmoid_backward.default)
def log_sigmoid_backward(grad_output, self, buffer):
    # recompute z = exp(-|x|) rather than trusting ``buffer`` (empty on accelerator code paths)
    rt, ct, g, x = promote(grad_output, self)
    z = jnp.exp(-jnp.abs(x))
    neg = x < 0
    max_deriv = jnp.where(neg, 1, 0).astype(ct)
    sign = jnp.where(neg, 1, -1).astype(ct)
    return cast((max_deriv - sign * (z / (1 + z))) * g, rt)


@register(aten.softshrink.default)
def softshrink(self, lambd=0.5):
    rt, ct, x = promote(self)
    lam = cast(lambd, ct)
    return cast(jnp.where(x > lam, x - lam, jnp.where(x < -lam, x + lam, x * 0)), rt)


@register(aten.softshrink_backward.default)
def softshrink_backward(grad_output, self, lambd):
    rt, ct, g, x = promote(grad_output, self)
    lam = cast(lambd, ct)
    return cast(jnp.where((x < -lam) | (x > lam), g, _zero(g)), rt)  # NaN: 0 (torch's vectorised loop)


@register(aten.hardshrink.default)
def hardshrink(self, lambd=0.5):
    dt = dtype_of(self)
    lam = cast(lambd, opmath(dt))
    x = cast(self, opmath(dt))
    return cast(jnp.where((x >= -lam) & (x <= lam), _zero(x), x), dt)


@register(aten.hardshrink_backward.default)
def hardshrink_backward(grad_out, self, lambd):
    rt, ct, g, x = promote(grad_out, self)
    lam = cast(lambd, ct)
    return cast(jnp.where((x < -lam) | (x > lam), g, _zero(g)), rt)  # NaN: 0, as torch


@register(aten._prelu_kernel.default)
def _prelu_kernel(self, weight):
    rt, ct, x, w = promote(self, weight)
    return cast(jnp.where(x > 0, x, w * x), rt)


@register(aten._prelu_kernel_backward.default)
def _prelu_kernel_backward(grad_output, self, weight):
    rt, ct, g, x, w = promote(grad_output, self, weight)
    g, x, w = jnp.broadcast_arrays(g, x, w)
    grad_input = jnp.where(x > 0, g, w * g)
    grad_weight = jnp.where(x > 0, _zero(g), x * g)
    return cast(grad_input, rt), cast(grad_weight, rt)


@register(aten.logit_backward.default)
def logit_backward(grad_output, self, eps=None):
    rt, ct, g, x = promote(grad_output, self)
    d = g / (x * (1 - x))
    if eps is None or eps < 0:
        return cast(jnp.where((x < 0) | (x > 1), jnp.full_like(d, jnp.nan), d), rt)
    return cast(jnp.where((x < eps) | (x > 1 - eps), _zero(d), d), rt)
