"""Lowerings of linear algebra: svd, qr, pinv, lu_factor, triangular solves, diag_embed, max_unpool.

Decompositions call LAPACK through jax on CPU (the same routines torch uses, so the signs of singular
vectors and of Q's columns agree with torch). Outputs follow torch's schemas exactly: ``compute_uv=False``
gives empty U / Vh, ``mode='r'`` gives an empty Q, LU pivots are int32 and 1-based, ``info`` is int32.
Backward goes through torch's autograd formulas, which call other aten ops.

Example::

    U, S, Vh = lookup(aten._linalg_svd.default).fn(a, False)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from shardtensor.ops.registry import register

aten = torch.ops.aten

HIGHEST = lax.Precision.HIGHEST


def _mm(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def _mH(a):
    return jnp.conj(jnp.swapaxes(a, -1, -2))


def _real_dtype(dtype):
    return jnp.finfo(dtype).dtype  # complex64 -> float32, float64 -> float64


def _check_float(name, a):
    if not (jnp.issubdtype(a.dtype, jnp.floating) or jnp.issubdtype(a.dtype, jnp.complexfloating)):
        raise RuntimeError(f"{name}: expected a floating point or complex tensor as input. Got {a.dtype}")
    if a.dtype in (jnp.float16, jnp.bfloat16):
        raise RuntimeError(f"{name}: \"linalg\" not implemented for '{a.dtype}'")


def _check_matrix(name, a):
    if a.ndim < 2:
        raise RuntimeError(f"{name}: The input tensor A must have at least 2 dimensions.")


# ----------------------------------------------------------------------------------------------
# svd, qr, pinv
# ----------------------------------------------------------------------------------------------
@register(aten._linalg_svd.default)
def linalg_svd(A, full_matrices=False, compute_uv=True, *, driver=None):
    _check_float("linalg.svd", A)
    _check_matrix("linalg.svd", A)
    rt = _real_dtype(A.dtype)
    if not compute_uv:
        S = jnp.linalg.svd(A, compute_uv=False)
        return jnp.zeros((0,), A.dtype), S.astype(rt), jnp.zeros((0,), A.dtype)
    U, S, Vh = jnp.linalg.svd(A, full_matrices=full_matrices, compute_uv=True)
    return U.astype(A.dtype), S.astype(rt), Vh.astype(A.dtype)


@register(aten.linalg_qr.default)
def linalg_qr(A, mode="reduced"):
    _check_float("linalg.qr", A)
    _check_matrix("linalg.qr", A)
    if mode not in ("reduced", "complete", "r"):
        raise RuntimeError(
            f"qr received unrecognized mode '{mode}' but expected one of 'reduced' (default), 'r', or 'complete'"
        )
    if mode == "r":
        R = jnp.linalg.qr(A, mode="r")
        return jnp.zeros((0,), A.dtype), R.astype(A.dtype)
    Q, R = jnp.linalg.qr(A, mode=mode)
    return Q.astype(A.dtype), R.astype(A.dtype)


def _tolerances(A, atol, rtol):
    """torch's get_atol_rtol: tolerances in float64; default rtol is eps * max(m, n) unless atol > 0."""
    t = jnp.float64
    eps = float(jnp.finfo(_real_dtype(A.dtype)).eps)
    default_rtol = jnp.asarray(eps * max(A.shape[-1], A.shape[-2]), t)
    atol_t = jnp.zeros((), t) if atol is None else jnp.asarray(atol).astype(t)
    if rtol is not None:
        rtol_t = jnp.asarray(rtol).astype(t)
    elif atol is not None:
        rtol_t = jnp.where(atol_t > 0, jnp.zeros((), t), default_rtol)
    else:
        rtol_t = default_rtol
    return atol_t, rtol_t


@register(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(A, *, atol=None, rtol=None, hermitian=False):
    _check_float("linalg.pinv", A)
    _check_matrix("linalg.pinv", A)
    for name, v in (("atol", atol), ("rtol", rtol)):
        if v is not None and jnp.issubdtype(jnp.asarray(v).dtype, jnp.complexfloating):
            raise RuntimeError(f"linalg.pinv: {name} tensor of complex type is not supported.")
    atol_t, rtol_t = _tolerances(A, atol, rtol)
    m, n = A.shape[-2], A.shape[-1]
    if A.size == 0:
        return jnp.zeros(A.shape[:-2] + (n, m), A.dtype)
    atol_t, rtol_t = atol_t[..., None], rtol_t[..., None]
    if hermitian:
        S, U = jnp.linalg.eigh(A, symmetrize_input=False)
        absS = jnp.abs(S)
        tol = jnp.maximum(atol_t, rtol_t * jnp.max(absS, axis=-1, keepdims=True))
        Sinv = jnp.where(absS > tol, 1 / S, jnp.zeros((), S.dtype)).astype(A.dtype)
        return _mm(U * Sinv[..., None, :], _mH(U)).astype(A.dtype)
    U, S, Vh = jnp.linalg.svd(A, full_matrices=False)
    tol = jnp.maximum(atol_t, rtol_t * S[..., :1])
    Sinv = jnp.where(S > tol, 1 / S, jnp.zeros((), S.dtype)).astype(A.dtype)
    return _mm(_mH(Vh) * Sinv[..., None, :], _mH(U)).astype(A.dtype)


# ----------------------------------------------------------------------------------------------
# LU
# ----------------------------------------------------------------------------------------------
@register(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(A, *, pivot=True, check_errors=False):
    _check_float("torch.linalg.lu_factor_ex", A)
    _check_matrix("torch.linalg.lu_factor_ex", A)
    if not pivot:
        raise RuntimeError("linalg.lu_factor: LU without pivoting is not implemented on the CPU")
    k = min(A.shape[-2], A.shape[-1])
    if A.size == 0:
        pivots = jnp.ones(A.shape[:-2] + (k,), jnp.int32) * jnp.arange(1, k + 1, dtype=jnp.int32)
        return A, pivots, jnp.zeros(A.shape[:-2], jnp.int32)
    lu, pivots, _ = lax.linalg.lu(A)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    zero = diag == 0
    # info = 1-based index of the first exactly-zero diagonal entry of U (LAPACK getrf), else 0
    info = jnp.where(jnp.any(zero, axis=-1), jnp.argmax(zero, axis=-1) + 1, 0).astype(jnp.int32)
    if check_errors:
        pass  # values are traced; torch would raise on info > 0
    return lu.astype(A.dtype), (pivots + 1).astype(jnp.int32), info


# ----------------------------------------------------------------------------------------------
# triangular solves
# ----------------------------------------------------------------------------------------------
def _broadcast_batch(A, B):
    batch = jnp.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    return jnp.broadcast_to(A, batch + A.shape[-2:]), jnp.broadcast_to(B, batch + B.shape[-2:])


def _tri_solve(A, B, *, upper, left, transpose, unitriangular):
    """op(A) X = B (left) or X op(A) = B, op = transpose or identity; only one triangle of A is read."""
    A, B = _broadcast_batch(A, B)
    if A.size == 0 or B.size == 0:
        return jnp.zeros(B.shape, B.dtype)
    return lax.linalg.triangular_solve(
        A, B, left_side=left, lower=not upper, transpose_a=transpose, conjugate_a=False, unit_diagonal=unitriangular
    ).astype(B.dtype)


@register(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(A, B, *, upper, left=True, unitriangular=False):
    _check_float("linalg.solve_triangular", A)
    if A.dtype != B.dtype:
        raise RuntimeError(
            "linalg.solve_triangular: Expected A and B to have the same dtype, "
            f"but found A of type {A.dtype} and B of type {B.dtype} instead"
        )
    return _tri_solve(A, B, upper=upper, left=left, transpose=False, unitriangular=unitriangular)


@register(aten.triangular_solve.default)
def triangular_solve(B, A, upper=True, transpose=False, unitriangular=False):
    _check_float("triangular_solve", A)
    if A.dtype != B.dtype:
        raise RuntimeError(
            "triangular_solve: Expected b and A to have the same dtype, "
            f"but got b with dtype {B.dtype} and A with dtype {A.dtype}"
        )
    Ab, _ = _broadcast_batch(A, B)
    X = _tri_solve(A, B, upper=upper, left=True, transpose=transpose, unitriangular=unitriangular)
    return X, Ab + jnp.zeros((), A.dtype)


# ----------------------------------------------------------------------------------------------
# diag_embed
# ----------------------------------------------------------------------------------------------
@register(aten.diag_embed.default)
def diag_embed(self, offset=0, dim1=-2, dim2=-1):
    nd = self.ndim + 1
    d1, d2 = dim1 % nd, dim2 % nd
    if d1 == d2:
        raise RuntimeError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")
    x = self[..., None] if self.ndim == 0 else self
    n = x.shape[-1]
    m = n + abs(offset)
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, abs(offset))])
    r = np.arange(m)[:, None]
    c = np.arange(m)[None, :]
    mask = (c - r) == offset
    vals = xp[..., :, None] if offset >= 0 else xp[..., None, :]
    out = jnp.where(mask, vals, jnp.zeros((), self.dtype))
    return jnp.moveaxis(out, (-2, -1), (d1, d2)).astype(self.dtype)


# ----------------------------------------------------------------------------------------------
# max_unpool
# ----------------------------------------------------------------------------------------------
def _unpool(x, indices, out_spatial, nspatial, name):
    if indices.shape != x.shape:
        raise RuntimeError(f"{name}: Expected shape of indices to be same as that of the input tensor")
    if x.ndim not in (nspatial + 1, nspatial + 2):
        raise RuntimeError(f"{name}: Expected {nspatial + 1}D or {nspatial + 2}D tensor, got {x.ndim}D")
    lead = x.shape[:-nspatial]
    planes = int(np.prod(lead)) if lead else 1
    size = int(np.prod(out_spatial))
    xv = x.reshape(planes, -1)
    iv = indices.reshape(planes, -1)
    out = jnp.zeros((planes, size), x.dtype)
    out = out.at[jnp.arange(planes)[:, None], iv].set(xv, mode="drop")
    return out.reshape(tuple(lead) + tuple(out_spatial))


@register(aten.max_unpool2d.default)
def max_unpool2d(self, indices, output_size):
    if len(output_size) != 2:
        raise RuntimeError("There should be exactly two elements (height, width) in output_size")
    return _unpool(self, indices, tuple(output_size), 2, "max_unpool2d")


@register(aten.max_unpool3d.default)
def max_unpool3d(self, indices, output_size, stride, padding):
    if len(output_size) != 3:
        raise RuntimeError("There should be exactly three elements (depth, height, width) in output_size")
    return _unpool(self, indices, tuple(output_size), 3, "max_unpool3d")
