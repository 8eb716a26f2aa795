"""Lowerings of eigendecompositions and the matrix exponential: eigh / eigvalsh, eig / eigvals,
matrix_exp.

eigh and eig call LAPACK through jax on CPU (syevd / heevd and geev, as torch does), so eigenvalues come
in the same order and eigenvectors with the same normalisation: eigh's eigenvalues are real and
ascending, eig's eigenvalues and eigenvectors are complex even for a real input, each eigenvector of
unit norm. Only the triangle named by ``UPLO`` is read. Backward goes through torch's formulas.

Example::

    L, Q = lookup(aten._linalg_eigh.default).fn(a, "L", True)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from shardtensor.ops.linalg import _check_float, _check_matrix, _mm, _real_dtype
from shardtensor.ops.registry import register

aten = torch.ops.aten


def _check_square(name, A):
    _check_matrix(name, A)
    if A.shape[-1] != A.shape[-2]:
        raise RuntimeError(
            f"{name}: A must be batches of square matrices, but they are {A.shape[-2]} by {A.shape[-1]} matrices"
        )


def _complex_dtype(dtype):
    return jnp.result_type(dtype, jnp.complex64)  # float32 -> complex64, float64 -> complex128


@register(aten._linalg_eigh.default)
def linalg_eigh(A, UPLO="L", compute_v=True):
    _check_float("linalg.eigh", A)
    _check_square("linalg.eigh", A)
    if UPLO not in ("L", "U", "l", "u"):
        raise RuntimeError(f"Expected UPLO argument to be 'L' or 'U', but got {UPLO}")
    rt = _real_dtype(A.dtype)
    if A.size == 0:
        w, v = jnp.zeros(A.shape[:-1], rt), A
    else:
        v, w = lax.linalg.eigh(A, lower=UPLO.upper() == "L", symmetrize_input=False)
    if not compute_v:
        return w.astype(rt), jnp.zeros((0,), A.dtype)
    return w.astype(rt), v.astype(A.dtype)


def _eig(A, vectors):
    _check_float("linalg.eig", A)
    _check_square("linalg.eig", A)
    ct = _complex_dtype(A.dtype)
    if A.size == 0:
        return jnp.zeros(A.shape[:-1], ct), jnp.zeros(A.shape, ct)
    out = lax.linalg.eig(A, compute_left_eigenvectors=False, compute_right_eigenvectors=vectors)
    return out[0].astype(ct), (out[1].astype(ct) if vectors else None)


@register(aten.linalg_eig.default)
def linalg_eig(A):
    return _eig(A, True)


@register(aten._linalg_eigvals.default)
def linalg_eigvals(A):
    return _eig(A, False)[0]


# Degree-18 Taylor approximant of Bader, Blanes and Casas (2019), "Computing the matrix exponential with
# an optimized Taylor polynomial approximation", evaluated with 5 matrix products. Row i holds the
# coefficients of B_i over (I, A, A^2, A^3, A^6); then A9 = B_0 B_4 + B_3, exp(A) ~ B_1 + (B_2 + A9) A9.
_T18 = np.array(
    [
        [0.0, -1.00365581030144618291e-01, -8.02924648241156932449e-03, -8.92138498045729985177e-04, 0.0],
        [
            0.0,
            3.97849749499645077844e-01,
            1.36783778460411720168e00,
            4.98289622525382669416e-01,
            -6.37898194594723280150e-04,
        ],
        [
            -1.09676396052962061844e01,
            1.68015813878906206114e00,
            5.71779846478865511061e-02,
            -6.98210122488052056106e-03,
            3.34975017086070470649e-05,
        ],
        [
            -9.04316832390810593223e-02,
            -6.76404519071381882256e-02,
            6.75961301770459654925e-02,
            2.95552570429315521194e-02,
            -1.39180257516060693404e-05,
        ],
        [0.0, 0.0, -9.23364619367118555360e-02, -1.69364939002081722752e-02, -1.40086798182036094347e-05],
    ]
)
# the 1-norm up to which the degree-18 approximant is accurate to the unit roundoff
_THETA18 = {np.dtype(np.float32): 3.010066362817634e00, np.dtype(np.float64): 1.090863719290036e00}


@register(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(A):
    """torch's algorithm (so float32 results agree with its rounding): scale A by 2^-s until its 1-norm is
    below theta_18, take the degree-18 Taylor approximant, square s times. (torch takes a lower degree
    for small norms; the degree-18 approximant without scaling is as accurate there.)"""
    _check_float("linalg.matrix_exp", A)
    _check_square("linalg.matrix_exp", A)
    if A.size == 0:
        return A
    if A.shape[-1] == 1:
        return jnp.exp(A)
    rt = _real_dtype(A.dtype)
    norm = jnp.max(jnp.sum(jnp.abs(A), axis=-2), axis=-1)  # operator 1-norm
    s = jnp.maximum(0, jnp.ceil(jnp.log2(norm / jnp.asarray(_THETA18[np.dtype(rt)], rt))))
    s = jnp.where(jnp.isfinite(s), s, 0).astype(jnp.int32)
    X = A / (2.0**s).astype(rt)[..., None, None]
    eye = jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)
    X2 = _mm(X, X)
    X3 = _mm(X, X2)
    powers = jnp.stack([eye, X, X2, X3, _mm(X3, X3)])
    B = jnp.einsum("ij,j...->i...", jnp.asarray(_T18, A.dtype), powers, precision=lax.Precision.HIGHEST)
    A9 = _mm(B[0], B[4]) + B[3]
    E = B[1] + _mm(B[2] + A9, A9)

    def square(i, E):
        return jnp.where((i < s)[..., None, None], _mm(E, E), E)

    return lax.fori_loop(0, jnp.max(s), square, E).astype(A.dtype)
