"""Lowerings of linear solvers and the factorizations behind them: LU (solve, inv, det, slogdet,
lu_unpack, lu_solve), Cholesky, LDL (Bunch-Kaufman), least squares, Householder products (geqrf, ormqr).

Outputs follow torch's schemas: ``info`` and pivots are int32, pivots 1-based as LAPACK returns them,
LU is packed like LAPACK's getrf (unit L below the diagonal, U on and above it), LD like sytrf.

Where torch's CPU kernel factors ``A^T`` instead of ``A`` (det and slogdet of a *contiguous real* A,
to save a copy), the returned LU is of ``A^T`` too, because torch's backward formulas read it back
that way. A lowering cannot see strides, so it assumes a contiguous A (every ShardedTensor that is not
a transposed view).

``_linalg_check_errors`` (what makes linalg.inv / solve / cholesky / lu_factor raise on a singular or
indefinite input) has no lowering: raising needs ``info`` on the host, so it belongs to the dispatcher.

Example::

    X, LU, pivots, info = lookup(aten._linalg_solve_ex.default).fn(A, B)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from jax import lax

from shardtensor.ops.linalg import _check_float, _check_matrix, _mH, _mm, _real_dtype
from shardtensor.ops.registry import register

aten = torch.ops.aten


def _is_complex(x):
    return jnp.issubdtype(x.dtype, jnp.complexfloating)


def _check_square(name, A, what="A"):
    _check_matrix(name, A)
    if A.shape[-1] != A.shape[-2]:
        raise RuntimeError(
            f"{name}: {what} must be batches of square matrices, but they are {A.shape[-2]} by {A.shape[-1]} matrices"
        )


def _eye_like(A):
    return jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)


def _batch_to(x, batch, core):
    """Broadcast ``x``'s batch dimensions (all but the last ``core``) to ``batch``."""
    return jnp.broadcast_to(x, tuple(batch) + tuple(x.shape[-core:]))


# ----------------------------------------------------------------------------------------------
# LU helpers
# ----------------------------------------------------------------------------------------------
def _lu_factor(A):
    """LAPACK getrf: (packed LU, 1-based int32 pivots, permutation with A[perm] = L U, int32 info)."""
    m, n = A.shape[-2], A.shape[-1]
    k = min(m, n)
    batch = A.shape[:-2]
    if A.size == 0:
        piv = jnp.broadcast_to(jnp.arange(1, k + 1, dtype=jnp.int32), batch + (k,))
        perm = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), batch + (m,))
        return A, piv, perm, jnp.zeros(batch, jnp.int32)
    lu, piv, perm = lax.linalg.lu(A)
    zero = jnp.diagonal(lu, axis1=-2, axis2=-1) == 0
    # info = 1-based index of the first exactly-zero diagonal entry of U, else 0
    info = jnp.where(jnp.any(zero, axis=-1), jnp.argmax(zero, axis=-1) + 1, 0).astype(jnp.int32)
    return lu.astype(A.dtype), (piv + 1).astype(jnp.int32), perm.astype(jnp.int32), info


def _perm_from_pivots(pivots, m):
    """LAPACK's sequential row swaps (1-based) -> the permutation ``perm`` with A[perm] = L U."""
    if pivots.shape[-1] == 0:
        return jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), pivots.shape[:-1] + (m,))
    return lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)


def _rows(B, perm):
    return jnp.take_along_axis(B, perm[..., :, None], axis=-2)


def _lu_solve_left(lu, perm, B, adjoint):
    """op(M) X = B, M = P^T L U packed in ``lu`` (M[perm] = L U); op = conjugate transpose if adjoint."""
    batch = jnp.broadcast_shapes(lu.shape[:-2], B.shape[:-2])
    lu, perm, B = _batch_to(lu, batch, 2), _batch_to(perm, batch, 1), _batch_to(B, batch, 2)
    if B.size == 0 or lu.size == 0:
        return jnp.zeros(B.shape, B.dtype)
    tri = lax.linalg.triangular_solve
    if not adjoint:
        Y = tri(lu, _rows(B, perm), left_side=True, lower=True, unit_diagonal=True)
        return tri(lu, Y, left_side=True, lower=False)
    # M^H = U^H L^H P: solve U^H, then L^H, then undo the row permutation
    Y = tri(lu, B, left_side=True, lower=False, transpose_a=True, conjugate_a=True)
    Y = tri(lu, Y, left_side=True, lower=True, transpose_a=True, conjugate_a=True, unit_diagonal=True)
    return _rows(Y, jnp.argsort(perm, axis=-1))


def _lu_solve(lu, perm, B, *, left, adjoint):
    if left:
        return _lu_solve_left(lu, perm, B, adjoint).astype(B.dtype)
    # X op(M) = B  <=>  op(M)^H X^H = B^H
    return _mH(_lu_solve_left(lu, perm, _mH(B), not adjoint)).astype(B.dtype)


def _use_A_T(A):
    # torch's det / slogdet factor A^T for contiguous real A (see the module docstring)
    return not _is_complex(A)


# ----------------------------------------------------------------------------------------------
# solve, inv, det, slogdet
# ----------------------------------------------------------------------------------------------
@register(aten._linalg_solve_ex.default)
def linalg_solve_ex(A, B, *, left=True, check_errors=False):
    _check_float("linalg.solve", A)
    _check_square("linalg.solve", A)
    vector = B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])
    if vector and not left:
        raise RuntimeError(
            "linalg.solve: Vector broadcasting of the left hand side is not supported for left=False. "
            "In this case linalg.solve is equivalent to B / A.squeeze(-1)"
        )
    lu, piv, perm, info = _lu_factor(A)
    X = _lu_solve(lu, perm, B[..., None] if vector else B, left=left, adjoint=False)
    return (X[..., 0] if vector else X), lu, piv, info


@register(aten.linalg_inv_ex.default)
def linalg_inv_ex(A, *, check_errors=False):
    _check_float("linalg.inv", A)
    _check_square("linalg.inv", A)
    lu, _, perm, info = _lu_factor(A)  # torch solves A X = I
    return _lu_solve(lu, perm, _eye_like(A), left=True, adjoint=False), info


def _perm_sign(piv, dtype):
    n = piv.shape[-1]
    odd = jnp.sum(piv != jnp.arange(1, n + 1, dtype=piv.dtype), axis=-1) % 2
    return jnp.where(odd == 1, -1, 1).astype(dtype)


def _checked_lu(name, A):
    """(lu, pivots, diagonal of U) of a float square A, factored as torch does for det/slogdet."""
    _check_float(name, A)
    _check_square(name, A)
    lu, piv, _, _ = _lu_factor(jnp.swapaxes(A, -1, -2) if _use_A_T(A) else A)
    return lu, piv, jnp.diagonal(lu, axis1=-2, axis2=-1)


@register(aten._linalg_det.default)
def linalg_det(A):
    lu, piv, diag = _checked_lu("linalg.det", A)
    return (jnp.prod(diag, axis=-1) * _perm_sign(piv, A.dtype)).astype(A.dtype), lu, piv


@register(aten._linalg_slogdet.default)
def linalg_slogdet(A):
    lu, piv, diag = _checked_lu("linalg.slogdet", A)
    absd = jnp.abs(diag)
    unit = diag / jnp.where(absd == 0, 1, absd).astype(A.dtype)  # sgn: 0 stays 0
    sign = jnp.prod(unit, axis=-1) * _perm_sign(piv, A.dtype)
    logabs = jnp.sum(jnp.log(absd), axis=-1)
    return sign.astype(A.dtype), logabs.astype(_real_dtype(A.dtype)), lu, piv


# ----------------------------------------------------------------------------------------------
# LU: linalg_lu, lu_unpack, lu_solve
# ----------------------------------------------------------------------------------------------
def _unpack(lu, pivots, unpack_data, unpack_pivots):
    m, n = lu.shape[-2], lu.shape[-1]
    k = min(m, n)
    empty = jnp.zeros((0,), lu.dtype)
    if unpack_data:
        L = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
        U = jnp.triu(lu[..., :k, :])
    else:
        L = U = empty
    if unpack_pivots:
        perm = _perm_from_pivots(pivots, m)
        # A = P L U with P[perm[i], i] = 1
        P = jnp.swapaxes(jax.nn.one_hot(perm, m, dtype=lu.dtype), -1, -2)
    else:
        P = empty
    return P, L, U


@register(aten.lu_unpack.default)
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    if LU_pivots.dtype != jnp.int32:
        raise RuntimeError(
            "torch.lu_unpack: LU_pivots is expected to be a contiguous tensor of torch.int32 dtype. "
            "Note: this function is intended to be used with the output produced by "
            "torch.linalg.lu_factor"
        )
    return _unpack(LU_data, LU_pivots, unpack_data, unpack_pivots)


@register(aten.linalg_lu.default)
def linalg_lu(A, *, pivot=True):
    _check_float("linalg.lu", A)
    _check_matrix("linalg.lu", A)
    if not pivot:
        raise RuntimeError("linalg.lu: LU without pivoting is not implemented on the CPU")
    lu, piv, _, _ = _lu_factor(A)
    return _unpack(lu, piv, True, True)


@register(aten.linalg_lu_solve.default)
def linalg_lu_solve(LU, pivots, B, *, left=True, adjoint=False):
    _check_float("linalg.lu_solve", LU)
    _check_square("linalg.lu_solve", LU, "LU")
    perm = _perm_from_pivots(pivots, LU.shape[-1])
    return _lu_solve(LU, perm, B, left=left, adjoint=adjoint)


# ----------------------------------------------------------------------------------------------
# Cholesky
# ----------------------------------------------------------------------------------------------
def _hermitian_from_lower(A):
    low = jnp.tril(A, -1)
    d = jnp.diagonal(A, axis1=-2, axis2=-1)
    d = jnp.real(d).astype(A.dtype) if _is_complex(A) else d
    return low + _mH(low) + d[..., None] * jnp.eye(A.shape[-1], dtype=A.dtype)


def _cholesky_by_columns(A):
    """Right-looking Cholesky column by column: (L, info) with potrf's info (1-based index of the first
    leading minor that is not positive definite). L's leading (info-1) columns are exact; the rest holds
    the Schur complement where the factorization stopped. Only used when LAPACK's Cholesky failed."""
    n = A.shape[-1]
    idx = jnp.arange(n)
    W = _hermitian_from_lower(A)

    def body(j, state):
        W, info = state
        d = jnp.real(W[..., j, j])
        info = jnp.where((info == 0) & ~(d > 0), j + 1, info).astype(jnp.int32)
        go = (info == 0)[..., None, None]
        ljj = jnp.sqrt(jnp.where(d > 0, d, 1)).astype(W.dtype)
        col = jnp.where(idx > j, W[..., :, j] / ljj[..., None], 0)
        trailing = (idx[:, None] > j) & (idx[None, :] > j)
        upd = W - jnp.where(trailing, col[..., :, None] * jnp.conj(col)[..., None, :], 0)
        new_col = jnp.where(idx > j, col, jnp.where(idx == j, ljj[..., None], 0))
        upd = jnp.where((idx == j)[None, :], new_col[..., :, None], upd)
        return jnp.where(go, upd, W), info

    W, info = lax.fori_loop(0, n, body, (W, jnp.zeros(A.shape[:-2], jnp.int32)))
    return jnp.tril(W), info


def _cholesky_lower(A, upper):
    """(L, info) reading one triangle of A like LAPACK potrf; L is upper (L^H) if ``upper``."""
    A = _mH(A) if upper else A  # the upper triangle of A is the lower triangle of A^H
    if A.size == 0:
        return A, jnp.zeros(A.shape[:-2], jnp.int32)
    L = lax.linalg.cholesky(A, symmetrize_input=False)
    failed = jnp.any(jnp.isnan(L), axis=(-2, -1))
    # jax gives NaNs where potrf fails; work out torch's info (and partial factor) only then
    L, info = lax.cond(jnp.any(failed), _cholesky_by_columns, lambda a: (L, jnp.zeros(a.shape[:-2], jnp.int32)), A)
    L = L.astype(A.dtype)
    return (_mH(L) if upper else L), info


@register(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(A, *, upper=False, check_errors=False):
    _check_float("linalg.cholesky", A)
    _check_square("linalg.cholesky", A)
    return _cholesky_lower(A, upper)


@register(aten.cholesky.default)
def cholesky(A, upper=False):
    _check_float("cholesky", A)
    _check_square("cholesky", A)
    return _cholesky_lower(A, upper)[0]


def _cholesky_solve(B, L, upper):
    """A X = B with A = L L^H (or U^H U): two triangular solves reading one triangle of L."""
    batch = jnp.broadcast_shapes(L.shape[:-2], B.shape[:-2])
    L, B = _batch_to(L, batch, 2), _batch_to(B, batch, 2)
    if B.size == 0 or L.size == 0:
        return jnp.zeros(B.shape, B.dtype)
    tri = lax.linalg.triangular_solve
    lower = not upper
    # lower: L Y = B, L^H X = Y; upper: U^H Y = B, U X = Y
    Y = tri(L, B, left_side=True, lower=lower, transpose_a=upper, conjugate_a=upper)
    return tri(L, Y, left_side=True, lower=lower, transpose_a=lower, conjugate_a=lower).astype(B.dtype)


@register(aten.cholesky_solve.default)
def cholesky_solve(B, L, upper=False):
    _check_float("cholesky_solve", L)
    return _cholesky_solve(B, L, upper)


@register(aten.cholesky_inverse.default)
def cholesky_inverse(L, upper=False):
    _check_float("cholesky_inverse", L)
    _check_square("cholesky_inverse", L, "Input matrix")
    if L.size == 0:
        return L
    tri = lax.linalg.triangular_solve
    Linv = tri(L, _eye_like(L), left_side=True, lower=not upper)
    # (L L^H)^-1 = L^-H L^-1 ; (U^H U)^-1 = U^-1 U^-H
    out = _mm(_mH(Linv), Linv) if not upper else _mm(Linv, _mH(Linv))
    return out.astype(L.dtype)


# ----------------------------------------------------------------------------------------------
# LDL (Bunch-Kaufman, LAPACK sytrf/hetrf with uplo='L' and its sytrs/hetrs solve)
# ----------------------------------------------------------------------------------------------
_BK_ALPHA = (1 + math.sqrt(17)) / 8


def _cabs1(x):
    return jnp.abs(jnp.real(x)) + jnp.abs(jnp.imag(x)) if jnp.issubdtype(x.dtype, jnp.complexfloating) else jnp.abs(x)


def _ldl_factor_one(A, herm):
    """One matrix, lower triangle read: (LD, 1-based pivots as LAPACK sytf2/hetf2, info)."""
    n = A.shape[-1]
    idx = jnp.arange(n)
    cplx = _is_complex(A)
    herm = herm and cplx
    cj = jnp.conj if herm else (lambda x: x)
    dabs = (lambda x: jnp.abs(jnp.real(x))) if herm else _cabs1

    def full(W, k):
        # the trailing block k: as a full symmetric / Hermitian matrix built from its lower triangle
        low = jnp.tril(W, -1)
        d = jnp.diagonal(W)
        d = jnp.real(d).astype(W.dtype) if herm else d
        F = low + cj(low.T) + jnp.diag(d)
        tr = (idx[:, None] >= k) & (idx[None, :] >= k)
        return jnp.where(tr, F, W)

    def step(state):
        W, piv, k, info = state
        absakk = dabs(W[k, k])
        colv = jnp.where(idx > k, _cabs1(W[:, k]), -1.0)
        imax = jnp.argmax(colv)
        colmax = jnp.maximum(colv[imax], 0.0)
        zero = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
        F = full(W, k)
        rowv = jnp.where((idx >= k) & (idx != imax), _cabs1(F[imax, :]), -1.0)
        rowmax = jnp.max(rowv)
        one_by_one = zero | (absakk >= _BK_ALPHA * colmax) | (absakk >= _BK_ALPHA * colmax * (colmax / rowmax))
        use_imax = ~one_by_one & (dabs(W[imax, imax]) >= _BK_ALPHA * rowmax)
        kp = jnp.where(one_by_one, k, imax)
        kstep = jnp.where(one_by_one | use_imax, 1, 2)
        kk = k + kstep - 1
        # interchange rows and columns kk and kp of the trailing block (on its full form)
        sw = jnp.where(idx == kk, kp, jnp.where(idx == kp, kk, idx))
        tr = (idx[:, None] >= k) & (idx[None, :] >= k)
        F = jnp.where(tr, F[sw][:, sw], F)
        # rows k+1 and kp of column k swap too for a 2x2 pivot (they lie in the trailing block's
        # first column, so the symmetric permutation above did it)

        def update1(F):
            dkk = jnp.real(F[k, k]).astype(F.dtype) if herm else F[k, k]
            x = jnp.where(idx > k, F[:, k], 0)
            r = 1 / dkk
            F = F - r * x[:, None] * cj(x)[None, :]
            return F.at[:, k].set(jnp.where(idx > k, x * r, F[:, k]))

        def update2(F):
            a0 = jnp.where(idx > k + 1, F[:, k], 0)
            a1 = jnp.where(idx > k + 1, F[:, k + 1], 0)
            if herm:
                d = jnp.abs(F[k + 1, k])
                d11 = jnp.real(F[k + 1, k + 1]) / d
                d22 = jnp.real(F[k, k]) / d
                d21 = F[k + 1, k] / d
                t = (1 / (d11 * d22 - 1)) / d
                wk = t * (d11 * a0 - d21 * a1)
                wk1 = t * (d22 * a1 - jnp.conj(d21) * a0)
            else:
                d21 = F[k + 1, k]
                d11 = F[k + 1, k + 1] / d21
                d22 = F[k, k] / d21
                t = (1 / (d11 * d22 - 1)) / d21
                wk = t * (d11 * a0 - a1)
                wk1 = t * (d22 * a1 - a0)
            F = F - a0[:, None] * cj(wk)[None, :] - a1[:, None] * cj(wk1)[None, :]
            F = F.at[:, k].set(jnp.where(idx > k + 1, wk, F[:, k]))
            return F.at[:, k + 1].set(jnp.where(idx > k + 1, wk1, F[:, k + 1]))

        F = lax.cond(zero, lambda F: F, lambda F: lax.cond(kstep == 1, update1, update2, F), F)
        if herm:  # hetf2 keeps the diagonal real
            F = F.at[idx, idx].set(jnp.where(idx >= k, jnp.real(jnp.diagonal(F)).astype(F.dtype), jnp.diagonal(F)))
        W = jnp.where(tr, jnp.tril(F), W)
        info = jnp.where((info == 0) & zero, k + 1, info)
        p1 = jnp.where(kstep == 1, kp + 1, -(kp + 1)).astype(jnp.int32)
        piv = piv.at[k].set(p1)
        piv = jnp.where((kstep == 2) & (idx == k + 1), p1, piv)
        return W, piv, k + kstep, info

    state = (jnp.tril(A), jnp.zeros((n,), jnp.int32), jnp.int32(0), jnp.int32(0))
    W, piv, _, info = lax.while_loop(lambda s: s[2] < n, step, state)
    return W, piv, info.astype(jnp.int32)


@register(aten.linalg_ldl_factor_ex.default)
def linalg_ldl_factor_ex(A, *, hermitian=False, check_errors=False):
    _check_float("torch.linalg.ldl_factor_ex", A)
    _check_square("torch.linalg.ldl_factor_ex", A)
    batch, n = A.shape[:-2], A.shape[-1]
    if A.size == 0:
        return A, jnp.zeros(batch + (n,), jnp.int32), jnp.zeros(batch, jnp.int32)
    flat = A.reshape((-1, n, n))
    LD, piv, info = jax.vmap(lambda a: _ldl_factor_one(a, hermitian))(flat)
    return LD.reshape(A.shape).astype(A.dtype), piv.reshape(batch + (n,)), info.reshape(batch)


def _ldl_solve_one(LD, piv, B, herm):
    n = LD.shape[-1]
    idx = jnp.arange(n)
    herm = herm and _is_complex(LD)
    cj = jnp.conj if herm else (lambda x: x)

    def swap(B, r1, r2):
        sw = jnp.where(idx == r1, r2, jnp.where(idx == r2, r1, idx))
        return B[sw]

    # L D Y = P B, walking forward over the 1x1 / 2x2 blocks
    def fwd(state):
        B, k = state

        def one(B):
            B = swap(B, k, piv[k] - 1)
            a = jnp.where(idx > k, LD[:, k], 0)
            B = B - a[:, None] * B[k][None, :]
            d = jnp.real(LD[k, k]).astype(LD.dtype) if herm else LD[k, k]
            return B.at[k].set(B[k] / d)

        def two(B):
            B = swap(B, k + 1, -piv[k] - 1)
            a0 = jnp.where(idx > k + 1, LD[:, k], 0)
            a1 = jnp.where(idx > k + 1, LD[:, k + 1], 0)
            B = B - a0[:, None] * B[k][None, :] - a1[:, None] * B[k + 1][None, :]
            akm1k = LD[k + 1, k]
            akm1 = LD[k, k] / cj(akm1k)
            ak = LD[k + 1, k + 1] / akm1k
            denom = akm1 * ak - 1
            bkm1 = B[k] / cj(akm1k)
            bk = B[k + 1] / akm1k
            B = B.at[k].set((ak * bkm1 - bk) / denom)
            return B.at[k + 1].set((akm1 * bk - bkm1) / denom)

        two_block = piv[k] < 0
        return lax.cond(two_block, two, one, B), k + jnp.where(two_block, 2, 1)

    # L^T X = Y (L^H for Hermitian), walking back
    def bwd(state):
        B, k = state

        def one(B):
            a = jnp.where(idx > k, cj(LD[:, k]), 0)
            B = B.at[k].add(-(a @ B))
            return swap(B, k, piv[k] - 1)

        def two(B):
            a = jnp.where(idx > k, cj(LD[:, k]), 0)
            b = jnp.where(idx > k, cj(LD[:, k - 1]), 0)
            B = B.at[k].add(-(a @ B)).at[k - 1].add(-(b @ B))
            return swap(B, k, -piv[k] - 1)

        two_block = piv[k] < 0
        return lax.cond(two_block, two, one, B), k - jnp.where(two_block, 2, 1)

    B, _ = lax.while_loop(lambda s: s[1] < n, fwd, (B, jnp.int32(0)))
    B, _ = lax.while_loop(lambda s: s[1] >= 0, bwd, (B, jnp.int32(n - 1)))
    return B


@register(aten.linalg_ldl_solve.default)
def linalg_ldl_solve(LD, pivots, B, *, hermitian=False):
    _check_float("torch.linalg.ldl_solve", LD)
    _check_square("torch.linalg.ldl_solve", LD, "LD")
    batch = jnp.broadcast_shapes(LD.shape[:-2], B.shape[:-2])
    n, k = LD.shape[-1], B.shape[-1]
    if B.size == 0 or LD.size == 0:
        return jnp.zeros(batch + B.shape[-2:], B.dtype)
    LD = _batch_to(LD, batch, 2).reshape((-1, n, n))
    piv = _batch_to(pivots.astype(jnp.int32), batch, 1).reshape((-1, n))
    Bf = _batch_to(B, batch, 2).reshape((-1, n, k))
    X = jax.vmap(lambda a, p, b: _ldl_solve_one(a, p, b, hermitian))(LD, piv, Bf)
    return X.reshape(batch + (n, k)).astype(B.dtype)


# ----------------------------------------------------------------------------------------------
# least squares
# ----------------------------------------------------------------------------------------------
@register(aten.linalg_lstsq.default)
def linalg_lstsq(A, B, rcond=None, *, driver=None):
    """Minimum-norm least squares through the SVD (what gelsd / gelss compute; gelsy and gels agree on
    full-rank problems). Residuals, rank and singular values are returned where torch returns them."""
    _check_float("torch.linalg.lstsq", A)
    _check_matrix("torch.linalg.lstsq", A)
    driver = driver or "gelsy"  # torch's default on CPU
    if driver not in ("gels", "gelsy", "gelsd", "gelss"):
        raise RuntimeError("torch.linalg.lstsq: parameter `driver` should be one of (gels, gelsy, gelsd, gelss)")
    vector = B.ndim == A.ndim - 1
    Bm = B[..., None] if vector else B
    m, n = A.shape[-2], A.shape[-1]
    batch = jnp.broadcast_shapes(A.shape[:-2], Bm.shape[:-2])
    A_, B_ = _batch_to(A, batch, 2), _batch_to(Bm, batch, 2)
    rt = _real_dtype(A.dtype)
    eps = float(jnp.finfo(rt).eps)
    rc = rcond if rcond is not None and rcond > 0 else eps * max(m, n)
    U, S, Vh = jnp.linalg.svd(A_, full_matrices=False)
    keep = S > rc * S[..., :1]
    Sinv = jnp.where(keep, 1 / jnp.where(keep, S, 1), 0).astype(A.dtype)
    X = _mm(_mH(Vh), Sinv[..., :, None] * _mm(_mH(U), B_)).astype(A.dtype)
    rank = jnp.sum(keep, axis=-1).astype(jnp.int64)
    empty = jnp.zeros((0,), rt)
    if m > n and driver != "gelsy":
        # gelsd / gelss: torch drops the residuals when some matrix is rank deficient (a shape that
        # depends on values); here they are always returned
        residuals = jnp.sum(jnp.abs(_mm(A_, X) - B_) ** 2, axis=-2).astype(rt)
    else:
        residuals = empty
    sv = S.astype(rt) if driver in ("gelsd", "gelss") else empty
    if driver == "gels":
        rank = jnp.zeros((0,), jnp.int64)
    return (X[..., 0] if vector else X), residuals, rank, sv


# ----------------------------------------------------------------------------------------------
# Householder: geqrf, householder_product, ormqr
# ----------------------------------------------------------------------------------------------
@register(aten.geqrf.default)
def geqrf(A):
    _check_float("geqrf", A)
    _check_matrix("geqrf", A)
    k = min(A.shape[-2], A.shape[-1])
    if A.size == 0:
        return A, jnp.zeros(A.shape[:-2] + (k,), A.dtype)
    h, tau = jnp.linalg.qr(A, mode="raw")  # LAPACK geqrf, returned transposed
    return jnp.swapaxes(h, -1, -2).astype(A.dtype), tau.astype(A.dtype)


@register(aten.linalg_householder_product.default)
def linalg_householder_product(A, tau):
    _check_float("torch.linalg.householder_product", A)
    _check_matrix("torch.linalg.householder_product", A)
    m, n = A.shape[-2], A.shape[-1]
    if m < n:
        raise RuntimeError(
            "torch.linalg.householder_product: input.shape[-2] must be greater than or equal to input.shape[-1]"
        )
    if n < tau.shape[-1]:
        raise RuntimeError(
            "torch.linalg.householder_product: input.shape[-1] must be greater than or equal to tau.shape[-1]"
        )
    if A.size == 0:
        return A
    if tau.shape[-1] == 0:
        return jnp.broadcast_to(jnp.eye(m, n, dtype=A.dtype), A.shape)
    return lax.linalg.householder_product(A, tau).astype(A.dtype)


@register(aten.ormqr.default)
def ormqr(A, tau, C, left=True, transpose=False):
    _check_float("ormqr", A)
    _check_matrix("ormqr", A)
    if C.size == 0:
        return C
    if A.size == 0 or tau.shape[-1] == 0:
        return C + jnp.zeros((), C.dtype)
    return lax.linalg.ormqr(A, tau, C, left=left, transpose=transpose).astype(C.dtype)
