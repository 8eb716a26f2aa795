"""Lowerings of matrix products: mm, bmm, addmm, baddbmm, addbmm, mv, addmv, dot, vdot, addr.

Products keep torch's dtype (bf16 stays bf16, int64 stays int64: ``preferred_element_type`` is the
input dtype) and float32 runs at ``Precision.HIGHEST`` so results match torch on CPU. ``beta=0``
ignores ``self`` entirely (its NaN/inf do not propagate), as in torch.

Example::

    lookup(aten.addmm.default).fn(bias, x, w, beta=1, alpha=1)
"""
from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from shardtensor.dtypes import to_jax
from shardtensor.ops.registry import register

aten = torch.ops.aten

HIGHEST = lax.Precision.HIGHEST


def _check_same_dtype(name, *xs):
    if len({x.dtype for x in xs}) != 1:
        raise RuntimeError(f"{name}: expected all operands to have the same dtype, got {[str(x.dtype) for x in xs]}")


def matmul(a, b, out_dtype=None):
    """a @ b with torch's result dtype (no int/bf16 widening) at full float32 precision."""
    dtype = a.dtype if out_dtype is None else out_dtype
    if a.dtype == jnp.bool_:
        raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Bool\'')
    return jnp.matmul(a, b, precision=HIGHEST, preferred_element_type=dtype).astype(dtype)


def _scale(v, s):
    """s * v where a Python 1 leaves v untouched (no extra op, no dtype change)."""
    if isinstance(s, (int, float, bool)) and s == 1:
        return v
    return v * s


def add_scaled(self, prod, beta, alpha):
    """beta * self + alpha * prod; with beta == 0, self (and its NaN/inf) is ignored, as in torch."""
    prod = _scale(prod, alpha)
    if isinstance(beta, (int, float, bool)):
        if beta == 0:
            return jnp.broadcast_to(prod, jnp.broadcast_shapes(self.shape, prod.shape)).astype(prod.dtype)
        return (_scale(self, beta) + prod).astype(prod.dtype)
    term = jnp.where(beta == 0, jnp.zeros((), self.dtype), self * beta)
    return (term + prod).astype(prod.dtype)


def _need(x, ndim, name, what):
    if x.ndim != ndim:
        raise RuntimeError(f"{name}: {what} must be a {ndim}D tensor, got {x.ndim}D")


@register(aten.mm.default)
def mm(a, b):
    _need(a, 2, "mm", "self"), _need(b, 2, "mm", "mat2")
    _check_same_dtype("mm", a, b)
    return matmul(a, b)


@register(aten.mm.dtype)
def mm_dtype(a, b, out_dtype):
    return matmul(a, b, to_jax(out_dtype))


@register(aten.bmm.default)
def bmm(a, b):
    _need(a, 3, "bmm", "self"), _need(b, 3, "bmm", "mat2")
    _check_same_dtype("bmm", a, b)
    return matmul(a, b)


@register(aten.bmm.dtype)
def bmm_dtype(a, b, out_dtype):
    return matmul(a, b, to_jax(out_dtype))


@register(aten.addmm.default)
def addmm(self, a, b, *, beta=1, alpha=1):
    _need(a, 2, "addmm", "mat1"), _need(b, 2, "addmm", "mat2")
    _check_same_dtype("addmm", self, a, b)
    return add_scaled(self, matmul(a, b), beta, alpha)


@register(aten.addmm.dtype)
def addmm_dtype(self, a, b, out_dtype, *, beta=1, alpha=1):
    return add_scaled(self.astype(to_jax(out_dtype)), matmul(a, b, to_jax(out_dtype)), beta, alpha)


@register(aten._addmm_activation.default)
def addmm_activation(self, a, b, *, beta=1, alpha=1, use_gelu=False):
    y = addmm(self, a, b, beta=beta, alpha=alpha)
    if use_gelu:
        import jax

        return jax.nn.gelu(y, approximate=False).astype(y.dtype)
    return jnp.maximum(y, jnp.zeros((), y.dtype))


@register(aten.baddbmm.default)
def baddbmm(self, a, b, *, beta=1, alpha=1):
    _need(a, 3, "baddbmm", "batch1"), _need(b, 3, "baddbmm", "batch2")
    _check_same_dtype("baddbmm", self, a, b)
    return add_scaled(self, matmul(a, b), beta, alpha)


@register(aten.baddbmm.dtype)
def baddbmm_dtype(self, a, b, out_dtype, *, beta=1, alpha=1):
    return add_scaled(self.astype(to_jax(out_dtype)), matmul(a, b, to_jax(out_dtype)), beta, alpha)


@register(aten.addbmm.default)
def addbmm(self, a, b, *, beta=1, alpha=1):
    _need(a, 3, "addbmm", "batch1"), _need(b, 3, "addbmm", "batch2")
    _check_same_dtype("addbmm", self, a, b)
    # contract the batch and inner dims in one dot: sum_b a[b] @ b[b]
    prod = lax.dot_general(a, b, (((0, 2), (0, 1)), ((), ())), precision=HIGHEST, preferred_element_type=a.dtype)
    return add_scaled(self, prod.astype(a.dtype), beta, alpha)


@register(aten.mv.default)
def mv(a, v):
    _need(a, 2, "mv", "self"), _need(v, 1, "mv", "vec")
    _check_same_dtype("mv", a, v)
    return matmul(a, v)


@register(aten.addmv.default)
def addmv(self, a, v, *, beta=1, alpha=1):
    _need(a, 2, "addmv", "mat"), _need(v, 1, "addmv", "vec")
    _check_same_dtype("addmv", self, a, v)
    return add_scaled(self, matmul(a, v), beta, alpha)


@register(aten.dot.default)
def dot(a, b):
    _need(a, 1, "dot", "self"), _need(b, 1, "dot", "tensor")
    _check_same_dtype("dot", a, b)
    if a.shape != b.shape:
        raise RuntimeError(f"inconsistent tensor size, expected tensor [{a.shape[0]}] and src [{b.shape[0]}]")
    return matmul(a, b)


@register(aten.vdot.default)
def vdot(a, b):
    return dot(jnp.conj(a), b)


@register(aten.addr.default)
def addr(self, v1, v2, *, beta=1, alpha=1):
    _need(v1, 1, "addr", "vec1"), _need(v2, 1, "addr", "vec2")
    prod = v1[:, None] * v2[None, :]
    if self.dtype == jnp.bool_:  # torch: beta and alpha act as logical and/or for bool
        out = jnp.logical_and(prod, jnp.asarray(alpha) != 0)
        return jnp.where(jnp.asarray(beta) != 0, jnp.logical_or(out, self), out)
    return add_scaled(self, prod, beta, alpha)
