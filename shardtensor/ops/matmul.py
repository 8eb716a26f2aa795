"""Lowerings of matrix products: mm, bmm, addmm, baddbmm, addbmm, mv, addmv, dot, vdot, addr.

Products keep torch's dtype (bf16 stays bf16, int64 stays int64 and exact) and float32 runs at
torch's float32 matmul precision (``ops.precision``; 'highest' by default, so results match torch's).
bf16/f16 products accumulate in float32 and
``beta * self + alpha * prod`` is formed in float32 and rounded once, as torch's CPU kernels do.
For integer results beta/alpha are truncated to integers first; ``beta=0`` ignores ``self`` entirely
(its NaN/inf do not propagate), as in torch.

Example::

    lookup(aten.addmm.default).fn(bias, x, w, beta=1, alpha=1)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from shardtensor.dtypes import to_jax
from shardtensor.ops._promote import acc_dtype
from shardtensor.ops.precision import precision
from shardtensor.ops.registry import register
from shardtensor.ops.shape import rows_source, transposed_source

aten = torch.ops.aten


def _check_same_dtype(name, *xs):
    if len({x.dtype for x in xs}) != 1:
        raise RuntimeError(f"{name}: expected all operands to have the same dtype, got {[str(x.dtype) for x in xs]}")


def product(a, b, out_dtype=None):
    """a @ b at full float32 precision, left in the accumulation dtype (float32 for bf16/f16) so a
    fused ``beta * self + alpha * prod`` rounds once, as torch's addmm/baddbmm do."""
    dtype = a.dtype if out_dtype is None else out_dtype
    if a.dtype == jnp.bool_:
        raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Bool'")
    if a.ndim == 2 and b.ndim == 2 and a.dtype == b.dtype:
        # a 2-D operand that is t(w): contract w itself (see shape.transposed_source), so that a
        # Linear layer's forward and backward dots read the same (once gathered) weight
        at, bt = transposed_source(a), transposed_source(b)
        lhs, lc = (at, 0) if at is not None else (a, 1)
        rhs, rc = (bt, 1) if bt is not None else (b, 0)
        unmerged = _rows_product(lhs, lc, rhs, rc, dtype)
        if unmerged is not None:
            return unmerged
        if at is not None or bt is not None:
            return lax.dot_general(
                lhs, rhs, (((lc,), (rc,)), ((), ())), precision=precision(), preferred_element_type=acc_dtype(dtype)
            )
    return jnp.matmul(a, b, precision=precision(), preferred_element_type=acc_dtype(dtype))


def _rows_product(lhs, lc, rhs, rc, dtype):
    """The 2-D product of ``lhs`` and ``rhs`` over their dims ``lc`` and ``rc`` computed from the values
    their rows were flattened from (``shape.rows_source``), as JAX's dots of a Linear layer on
    (batch, tokens, features): contracting both over their leading dims (a weight's gradient), or
    keeping the leading dims of ``lhs`` and flattening the result; None where neither applies, or for
    a layer whose widths differ more than ``_HEAD_RATIO`` times (``_head_like``)."""
    if _head_like(lhs.shape[1], rhs.shape[1 - rc]):
        return None

    def dot(x, y, dims):
        return lax.dot_general(x, y, (dims, ((), ())), precision=precision(), preferred_element_type=acc_dtype(dtype))

    ls = rows_source(lhs)
    if lc == 0:
        rs = rows_source(rhs) if rc == 0 else None
        if ls is None or rs is None or ls.shape[:-1] != rs.shape[:-1]:
            return None
        lead = tuple(range(ls.ndim - 1))
        return dot(ls, rs, (lead, lead))
    if ls is None:
        return None
    out = dot(ls, rhs, ((ls.ndim - 1,), (rc,)))
    return out.reshape(lhs.shape[0], out.shape[-1])


# a vocabulary head (768 -> 50257 features): its 2-D products let a TPU's XLA compute the logits'
# gradient inside them rather than write it (v5e, float32 GPT step: 25.2 ms with the head in 3-D,
# 22.4 ms without; bfloat16 95.0 / 95.3 ms). Other layers' widths differ at most 4 times (an MLP).
_HEAD_RATIO = 8


def _head_like(features: int, other: int) -> bool:
    """Whether a Linear layer's two feature widths differ more than ``_HEAD_RATIO`` times."""
    return max(features, other) > _HEAD_RATIO * min(features, other)


def matmul(a, b, out_dtype=None):
    """a @ b with torch's result dtype (no int/bf16 widening of the result; one rounding)."""
    return product(a, b, out_dtype).astype(a.dtype if out_dtype is None else out_dtype)


def _scale(v, s):
    """s * v where a Python 1 leaves v untouched (no extra op, no dtype change)."""
    if isinstance(s, (int, float, bool)) and s == 1:
        return v
    return v * s


def _integral_scalar(s, dtype):
    """torch casts beta/alpha to an integral result's dtype first (0.6 -> 0), so they never make the
    sum fractional."""
    if not jnp.issubdtype(dtype, jnp.integer):
        return s
    if isinstance(s, (int, float, bool)):
        return int(s)
    return s.astype(dtype)


def add_scaled(self, prod, beta, alpha, dtype=None):
    """beta * self + alpha * prod in ``prod``'s dtype, rounded once to ``dtype`` (default self's);
    with beta == 0, self (and its NaN/inf) is ignored, as in torch."""
    dtype = self.dtype if dtype is None else dtype
    beta, alpha = _integral_scalar(beta, dtype), _integral_scalar(alpha, dtype)
    self = self.astype(prod.dtype)
    prod = _scale(prod, alpha)
    if isinstance(beta, (int, float, bool)):
        if beta == 0:
            return jnp.broadcast_to(prod, jnp.broadcast_shapes(self.shape, prod.shape)).astype(dtype)
        return (_scale(self, beta) + prod).astype(dtype)
    term = jnp.where(beta == 0, jnp.zeros((), self.dtype), self * beta)
    return (term + prod).astype(dtype)


def _need(x, ndim, name, what):
    if x.ndim != ndim:
        raise RuntimeError(f"{name}: {what} must be a {ndim}D tensor, got {x.ndim}D")


@register(aten.mm.default, products=True)
def mm(a, b):
    _need(a, 2, "mm", "self"), _need(b, 2, "mm", "mat2")
    _check_same_dtype("mm", a, b)
    return matmul(a, b)


@register(aten.mm.dtype, products=True)
def mm_dtype(a, b, out_dtype):
    return matmul(a, b, to_jax(out_dtype))


@register(aten.bmm.default, products=True)
def bmm(a, b):
    _need(a, 3, "bmm", "self"), _need(b, 3, "bmm", "mat2")
    _check_same_dtype("bmm", a, b)
    return matmul(a, b)


@register(aten.bmm.dtype, products=True)
def bmm_dtype(a, b, out_dtype):
    return matmul(a, b, to_jax(out_dtype))


@register(aten.addmm.default, products=True)
def addmm(self, a, b, *, beta=1, alpha=1):
    _need(a, 2, "addmm", "mat1"), _need(b, 2, "addmm", "mat2")
    _check_same_dtype("addmm", self, a, b)
    return add_scaled(self, product(a, b), beta, alpha)


@register(aten.addmm.dtype, products=True)
def addmm_dtype(self, a, b, out_dtype, *, beta=1, alpha=1):
    return add_scaled(self, product(a, b, to_jax(out_dtype)), beta, alpha, to_jax(out_dtype))


@register(aten._addmm_activation.default, products=True)
def addmm_activation(self, a, b, *, beta=1, alpha=1, use_gelu=False):
    y = addmm(self, a, b, beta=beta, alpha=alpha)
    if use_gelu:
        return jax.nn.gelu(y, approximate=False).astype(y.dtype)
    return jnp.maximum(y, jnp.zeros((), y.dtype))


@register(aten.baddbmm.default, products=True)
def baddbmm(self, a, b, *, beta=1, alpha=1):
    _need(a, 3, "baddbmm", "batch1"), _need(b, 3, "baddbmm", "batch2")
    _check_same_dtype("baddbmm", self, a, b)
    return add_scaled(self, product(a, b), beta, alpha)


@register(aten.baddbmm.dtype, products=True)
def baddbmm_dtype(self, a, b, out_dtype, *, beta=1, alpha=1):
    return add_scaled(self, product(a, b, to_jax(out_dtype)), beta, alpha, to_jax(out_dtype))


@register(aten.addbmm.default, products=True)
def addbmm(self, a, b, *, beta=1, alpha=1):
    _need(a, 3, "addbmm", "batch1"), _need(b, 3, "addbmm", "batch2")
    _check_same_dtype("addbmm", self, a, b)
    # contract the batch and inner dims in one dot: sum_b a[b] @ b[b]
    prod = lax.dot_general(
        a, b, (((0, 2), (0, 1)), ((), ())), precision=precision(), preferred_element_type=acc_dtype(a.dtype)
    )
    return add_scaled(self, prod, beta, alpha)


@register(aten.mv.default, products=True)
def mv(a, v):
    _need(a, 2, "mv", "self"), _need(v, 1, "mv", "vec")
    _check_same_dtype("mv", a, v)
    return matmul(a, v)


@register(aten.addmv.default, products=True)
def addmv(self, a, v, *, beta=1, alpha=1):
    _need(a, 2, "addmv", "mat"), _need(v, 1, "addmv", "vec")
    _check_same_dtype("addmv", self, a, v)
    return add_scaled(self, product(a, v), beta, alpha)


@register(aten.dot.default, products=True)
def dot(a, b):
    _need(a, 1, "dot", "self"), _need(b, 1, "dot", "tensor")
    _check_same_dtype("dot", a, b)
    if a.shape != b.shape:
        raise RuntimeError(f"inconsistent tensor size, expected tensor [{a.shape[0]}] and src [{b.shape[0]}]")
    return matmul(a, b)


@register(aten.vdot.default, products=True)
def vdot(a, b):
    return dot(jnp.conj(a), b)


@register(aten.addr.default)
def addr(self, v1, v2, *, beta=1, alpha=1):
    _need(v1, 1, "addr", "vec1"), _need(v2, 1, "addr", "vec2")
    if jnp.issubdtype(self.dtype, jnp.integer) or self.dtype == jnp.bool_:
        for name, s in (("beta", beta), ("alpha", alpha)):
            if isinstance(s, float) or (hasattr(s, "dtype") and jnp.issubdtype(s.dtype, jnp.inexact)):
                raise RuntimeError(f"For integral input tensors, argument {name} must not be a floating point number.")
    prod = v1[:, None] * v2[None, :]
    if self.dtype == jnp.bool_:  # torch: beta and alpha act as logical and/or for bool
        out = jnp.logical_and(prod, jnp.asarray(alpha) != 0)
        return jnp.where(jnp.asarray(beta) != 0, jnp.logical_or(out, self), out)
    return add_scaled(self, prod, beta, alpha, prod.dtype)


def _round_each(x):
    """``x`` rounded to its own dtype now: XLA would otherwise keep a bf16/f16 product in float32
    until the end of a fused chain, where torch rounds after every op."""
    if x.dtype in (jnp.bfloat16, jnp.float16):
        info = jnp.finfo(x.dtype)
        return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return x


@register(aten.linalg_cross.default)
def linalg_cross(a, b, *, dim=-1):
    """The cross product along ``dim`` (of length 3) of broadcast inputs, each product and
    difference rounded as in torch's CPU kernel."""
    if a.ndim != b.ndim:
        raise RuntimeError("linalg.cross: inputs must have the same number of dimensions.")
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected scalar type {a.dtype} but found {b.dtype}")
    if not -a.ndim <= dim < max(a.ndim, 1):
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-a.ndim}, {a.ndim - 1}], but got {dim})"
        )
    if a.shape[dim] != 3 or b.shape[dim] != 3:
        raise RuntimeError(
            f"linalg.cross: inputs dimension {dim} must have length 3. Got {a.shape[dim]} and {b.shape[dim]}"
        )
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    a, b = jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
    a0, a1, a2 = (lax.index_in_dim(a, i, dim, keepdims=False) for i in range(3))
    b0, b1, b2 = (lax.index_in_dim(b, i, dim, keepdims=False) for i in range(3))

    def term(p, q, r, s):
        return _round_each(_round_each(p * q) - _round_each(r * s))

    return jnp.stack([term(a1, b2, a2, b1), term(a2, b0, a0, b2), term(a0, b1, a1, b0)], axis=dim)
