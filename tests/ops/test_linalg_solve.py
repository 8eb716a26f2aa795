"""Solver and factorization lowerings (shardtensor/ops/linalg_solve.py) against eager torch on CPU:
float32 and float64 (complex where the algorithm differs), batched and broadcast shapes, singular
inputs' ``info``; then forward and backward through sharded tensors (eigvalsh and matrix_exp, of
shardtensor/ops/linalg_eig.py, among them)."""

import importlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _linalg_inputs import _square, _sym, _tol
from _lowering_harness import Batch, call, make, to_torch

importlib.import_module("shardtensor.ops.linalg_solve")
importlib.import_module("shardtensor.ops.linalg_eig")

aten = torch.ops.aten
F32, F64, C64, C128 = torch.float32, torch.float64, torch.complex64, torch.complex128


def _spd(shape, dtype, seed=0):
    a = _square(shape, dtype, seed)
    return a @ a.mH + torch.eye(shape[-1], dtype=dtype)


# ----------------------------------------------------------------------------------------------
# LU family
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64, C128])
def test_solve_inv_det(dtype):
    t = _tol(dtype)
    A = _square((2, 4, 4), dtype)
    with Batch() as b:
        for B in (
            make((2, 4, 3), F64, seed=1),
            make((4,), F64, seed=2),
            make((2, 4), F64, seed=3),
            make((5, 2, 4, 2), F64, seed=4),
        ):
            b.check(aten._linalg_solve_ex.default, A, B.to(dtype), **t)
        b.check(aten._linalg_solve_ex.default, A[0], make((3, 2, 4, 4), F64, seed=5).to(dtype), **t)  # broadcast
        b.check(aten._linalg_solve_ex.default, A, make((2, 3, 4), F64, seed=6).to(dtype), left=False, **t)
        b.check(aten.linalg_inv_ex.default, A, **t)
        b.check(aten.linalg_inv_ex.default, A[0], **t)
        b.check(aten._linalg_det.default, A, **t)  # LU and pivots too (of A^T for a real A, as torch)
        b.check(aten._linalg_slogdet.default, A, **t)
        b.check(aten._linalg_slogdet.default, -A[1], **t)


def _same_values_and_matrix(dtype, values):
    """A ``Batch.check`` comparison for ``_linalg_det`` (``values=1``: det) and ``_linalg_slogdet``
    (``values=2``: sign, logabsdet): those values, then the LU factors only through the matrix P·L·U
    they multiply back to (torch's and the lowering's factor the same matrix, A^T for a real A). The
    factors of a singular matrix themselves are not unique: once a pivot is zero, LAPACK's choice of
    the next one (and so L's entries) depends on the CPU's code path, as do the pivots of ties."""

    def compare(got, want, what):
        tol = _tol(dtype)
        for i in range(values):
            torch.testing.assert_close(got[i], want[i], **tol, msg=lambda m, i=i: f"{what} output {i}: {m}")
        P, L, U = torch.lu_unpack(*got[values:])
        P0, L0, U0 = torch.lu_unpack(*want[values:])
        torch.testing.assert_close(P @ L @ U, P0 @ L0 @ U0, **tol, msg=lambda m: f"{what} P·L·U: {m}")

    return compare


@pytest.mark.parametrize("dtype", [F32, F64])
def test_singular_info(dtype):
    # rank 2 with powers of two only: every elimination step is exact in either orientation (A or
    # A^T) and with or without fused multiply-adds, so the exactly zero pivot and ``info`` are the
    # same on every CPU
    exact = torch.tensor([[4.0, 2, 0], [2, 2, 0], [1, 1, 0]], dtype=dtype)
    batch = torch.stack([torch.eye(3, dtype=dtype), exact, torch.zeros(3, 3, dtype=dtype)])
    _, info = (to_torch(v) for v in call(aten.linalg_inv_ex.default, batch))
    torch.testing.assert_close(info, aten.linalg_inv_ex.default(batch)[1])
    torch.testing.assert_close(info, torch.tensor([0, 3, 1], dtype=torch.int32))
    info = to_torch(call(aten._linalg_solve_ex.default, batch, torch.ones(3, 3, dtype=dtype))[3])
    torch.testing.assert_close(info, aten._linalg_solve_ex.default(batch, torch.ones(3, 3, dtype=dtype))[3])
    # rank 2 with inexact multipliers (1/3): the factors after the zero pivot are the CPU's choice
    rounded = torch.tensor([[1.0, 2, 3], [2, 4, 6], [1, 0, 1]], dtype=dtype)
    with Batch() as b:  # det 0, slogdet (0, -inf)
        b.check(aten._linalg_det.default, batch, compare=_same_values_and_matrix(dtype, 1))
        b.check(aten._linalg_det.default, rounded, compare=_same_values_and_matrix(dtype, 1))
        b.check(aten._linalg_slogdet.default, batch[1:], compare=_same_values_and_matrix(dtype, 2))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_lu_unpack_solve(dtype):
    t = _tol(dtype)
    with Batch() as b:
        for shape in ((4, 4), (2, 5, 3), (2, 3, 5)):
            A = make(shape, dtype, seed=len(shape))
            b.check(aten.linalg_lu.default, A, **t)
            LU, piv = torch.linalg.lu_factor(A)
            for data, pivots in ((True, True), (False, True), (True, False)):
                b.check(aten.lu_unpack.default, LU, piv, data, pivots, **t)
        A = _square((2, 4, 4), dtype)
        LU, piv = torch.linalg.lu_factor(A)
        B = make((2, 4, 3), dtype, seed=7)
        for left in (True, False):
            for adjoint in (True, False):
                Bl = B if left else B.mT
                b.check(aten.linalg_lu_solve.default, LU, piv, Bl, left=left, adjoint=adjoint, **t)
        b.check(aten.linalg_lu_solve.default, LU[0], piv[0], make((3, 4, 2), dtype, seed=8), **t)  # broadcast


# ----------------------------------------------------------------------------------------------
# Cholesky
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64, C128])
def test_cholesky_family(dtype):
    t = _tol(dtype)
    A = _spd((2, 4, 4), dtype)
    junk = torch.triu(make((4, 4), F64, seed=9), 1).to(dtype)  # only one triangle may be read
    L = torch.linalg.cholesky(A)
    B = make((2, 4, 3), F64, seed=10).to(dtype)
    with Batch() as b:
        for upper in (False, True):
            Aj = A + (junk if not upper else junk.mT).resolve_conj()
            b.check(aten.linalg_cholesky_ex.default, Aj, upper=upper, **t)
            b.check(aten.cholesky.default, Aj, upper, **t)
            F = (L.mH if upper else L).resolve_conj()
            b.check(aten.cholesky_inverse.default, F, upper, **t)
            b.check(aten.cholesky_solve.default, B, F, upper, **t)
            b.check(aten.cholesky_solve.default, B, F[0], upper, **t)  # broadcast


@pytest.mark.parametrize("dtype", [F32, F64])
def test_cholesky_not_positive_definite(dtype):
    A = _spd((3, 5, 5), dtype)
    A[1, 2, 2] = -100.0  # leading minor of order 3 fails
    A[2, 0, 0] = float("nan")
    L0, info0 = aten.linalg_cholesky_ex.default(A)
    L, info = (to_torch(v) for v in call(aten.linalg_cholesky_ex.default, A))
    torch.testing.assert_close(info, info0)
    torch.testing.assert_close(L[0], L0[0], **_tol(dtype))
    torch.testing.assert_close(L[1, :2, :2], L0[1, :2, :2], **_tol(dtype))  # the part torch also finished


# ----------------------------------------------------------------------------------------------
# LDL
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,hermitian", [(F32, False), (F64, False), (C128, True), (C128, False)])
def test_ldl(dtype, hermitian):
    t = _tol(dtype)
    A = _sym((3, 6, 6), dtype, herm=hermitian)
    A[0, 0, 0] = 0  # forces a 2x2 pivot
    LD, piv, _ = torch.linalg.ldl_factor_ex(A, hermitian=hermitian)
    assert (piv < 0).any()
    B = make((3, 6, 2), F64, seed=11).to(dtype)
    with Batch() as b:
        b.check(aten.linalg_ldl_factor_ex.default, A, hermitian=hermitian, **t)
        b.check(aten.linalg_ldl_factor_ex.default, _spd((5, 5), dtype), hermitian=hermitian, **t)  # 1x1 pivots
        b.check(aten.linalg_ldl_solve.default, LD, piv, B, hermitian=hermitian, **t)
        b.check(aten.linalg_ldl_solve.default, LD[0], piv[0], B, hermitian=hermitian, **t)  # broadcast


def test_ldl_singular_info():
    A = torch.zeros(2, 3, 3, dtype=F64)
    A[0] = torch.diag(torch.tensor([1.0, 0.0, 2.0], dtype=F64))
    with Batch() as b:
        b.check(aten.linalg_ldl_factor_ex.default, A)


# ----------------------------------------------------------------------------------------------
# least squares, Householder
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
def test_lstsq(dtype):
    t = _tol(dtype)
    with Batch() as b:
        for driver in ("gels", "gelsy", "gelsd", "gelss"):
            for m, n in ((5, 3), (3, 3), (3, 5)):
                A = make((2, m, n), dtype, seed=m)
                b.check(aten.linalg_lstsq.default, A, make((2, m, 2), dtype, seed=n), driver=driver, **t)
            b.check(aten.linalg_lstsq.default, make((2, 5, 3), dtype), make((2, 5), dtype, seed=1), driver=driver, **t)
        b.check(aten.linalg_lstsq.default, make((4, 3), dtype), make((4, 2), dtype, seed=1), **t)  # default driver


@pytest.mark.parametrize("dtype", [F32, F64])
def test_householder(dtype):
    t = _tol(dtype)
    with Batch() as b:
        for shape in ((5, 3), (2, 4, 4), (2, 3, 5)):
            b.check(aten.geqrf.default, make(shape, dtype, seed=len(shape)), **t)
        A, tau = torch.geqrf(make((2, 5, 3), dtype))
        b.check(aten.linalg_householder_product.default, A, tau, **t)
        b.check(aten.linalg_householder_product.default, A, tau[..., :2], **t)
        for left in (True, False):
            for tr in (True, False):
                C = make((2, 5, 4) if left else (2, 4, 5), dtype, seed=3)
                b.check(aten.ormqr.default, A, tau, C, left, tr, **t)


# ----------------------------------------------------------------------------------------------
# through sharded tensors: forward and backward against torch autograd
# ----------------------------------------------------------------------------------------------
def _sharded_grads(fn, *inputs):
    import shardtensor as st

    mesh = st.Mesh(range(8), (4, 2), ("x", "y"))
    ref = [x.detach().clone().requires_grad_() for x in inputs]
    want = fn(*ref)
    sum(w.sum() for w in want if w.is_floating_point()).backward()
    sh = [st.shard(x.detach().clone(), mesh, ("x",) + (None,) * (x.dim() - 1)).requires_grad_() for x in inputs]
    got = fn(*sh)
    sum(g.sum() for g in got if g.is_floating_point()).backward()
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w.detach(), **_tol(w.dtype if w.is_floating_point() else F64))
    for s, r in zip(sh, ref):
        torch.testing.assert_close(s.grad.cpu(), r.grad, **_tol(r.dtype))


CASES = {
    "solve_ex": (lambda A, B: torch.linalg.solve_ex(A, B)[:1], 2),
    "inv_ex": (lambda A: torch.linalg.inv_ex(A)[:1], 1),
    "det_slogdet": (lambda A: (torch.linalg.det(A), torch.linalg.slogdet(A)[1], torch.logdet(A @ A.mT)), 1),
    "cholesky_ex": (lambda A: torch.linalg.cholesky_ex(A @ A.mT)[:1], 1),
    "cholesky_solve_inverse": (
        lambda A, B: (
            torch.cholesky_solve(B, torch.cholesky(A @ A.mT)),
            torch.cholesky_inverse(torch.cholesky(A @ A.mT)),
        ),
        2,
    ),
    "lu": (lambda A: torch.linalg.lu(A), 1),
    "lu_solve": (lambda A, B: (torch.linalg.lu_solve(*torch.linalg.lu_factor_ex(A)[:2], B, adjoint=True),), 2),
    "eigvalsh": (lambda A: (torch.linalg.eigvalsh(A + A.mT),), 1),
    "matrix_exp": (lambda A: (torch.linalg.matrix_exp(A * 0.5),), 1),
    "householder_ormqr": (
        lambda A, B: (torch.linalg.householder_product(A, A[..., 0, :3]), torch.ormqr(A, A[..., 0, :], B)),
        2,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_forward_backward(case):
    fn, nargs = CASES[case]
    inputs = [_square((4, 4, 4), F64, seed=1), make((4, 4, 3), F64, seed=2)][:nargs]
    _sharded_grads(fn, *inputs)


# torch's det/slogdet backward reads LU as the factor of A^T only when A is contiguous; the dispatcher
# hands a non-contiguous A to the lowering as the contiguous values of A^T (dispatch._det_factors)
def test_sharded_det_backward_transposed_input():
    _sharded_grads(lambda A: (torch.linalg.det(A.mT),), _square((4, 4, 4), F64, seed=1))
    _sharded_grads(lambda A: tuple(torch.linalg.slogdet(A.mT)), _square((4, 4, 4), F64, seed=3))
    _sharded_grads(lambda A: (torch.linalg.det(A[:, 1:, 1:]),), _square((4, 4, 4), F64, seed=4))
