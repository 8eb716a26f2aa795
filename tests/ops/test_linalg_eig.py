"""Eigen and matrix-exponential lowerings (shardtensor/ops/linalg_eig.py) against eager torch on CPU:
float32, float64 and complex128, batched shapes. (Through sharded tensors: test_linalg_solve.py's
test_sharded_forward_backward, cases eigvalsh and matrix_exp.)"""

import importlib

import pytest
import torch

from _linalg_inputs import _sym, _tol
from _lowering_harness import Batch, call, make, to_torch

importlib.import_module("shardtensor.ops.linalg_eig")

aten = torch.ops.aten
F32, F64, C64, C128 = torch.float32, torch.float64, torch.complex64, torch.complex128


# ----------------------------------------------------------------------------------------------
# eigen, matrix_exp
# ----------------------------------------------------------------------------------------------
def _align_columns(V, V0):
    """Eigenvectors are unique up to a unit factor per column: rotate V's columns onto V0's."""
    phase = (V.conj() * V0).sum(-2)
    phase = phase / phase.abs()
    return V * phase.unsqueeze(-2)


@pytest.mark.parametrize("dtype", [F32, F64, C128])
@pytest.mark.parametrize("uplo", ["L", "U"])
def test_eigh(dtype, uplo):
    t = _tol(dtype)
    A = _sym((2, 5, 5), dtype)
    A = A + torch.triu(make((5, 5), F64, seed=4), 1).to(dtype) * (uplo == "L")  # unread triangle
    w0, V0 = aten._linalg_eigh.default(A, uplo)
    w, V = (to_torch(v) for v in call(aten._linalg_eigh.default, A, uplo))
    assert (w.dtype, V.dtype) == (w0.dtype, V0.dtype)
    torch.testing.assert_close(w, w0, **t)
    torch.testing.assert_close(_align_columns(V, V0), V0, **t)
    w, e = (to_torch(v) for v in call(aten._linalg_eigh.default, A, uplo, False))
    torch.testing.assert_close(w, w0, **t)
    assert e.shape == (0,) and e.dtype == A.dtype


def _matched(w, w0):
    """The order of ``w`` that puts each eigenvalue next to the nearest of ``w0`` (torch leaves their
    order to LAPACK's implementation; these inputs' eigenvalues are well apart)."""
    return (w.unsqueeze(-2) - w0.unsqueeze(-1)).abs().argmin(-1)


@pytest.mark.parametrize("dtype", [F32, F64, C128])
def test_eig(dtype):
    t = _tol(dtype)
    A = make((2, 5, 5), F64, seed=6).to(dtype)
    w0, V0 = aten.linalg_eig.default(A)
    w, V = (to_torch(v) for v in call(aten.linalg_eig.default, A))
    assert (w.dtype, V.dtype) == (w0.dtype, V0.dtype)
    order = _matched(w, w0)
    assert (order.sort(-1).values == torch.arange(5)).all(), order  # one to one
    torch.testing.assert_close(w.gather(-1, order), w0, **t)
    V = V.gather(-1, order.unsqueeze(-2).expand(V.shape))
    torch.testing.assert_close(_align_columns(V, V0), V0, **t)
    w = to_torch(call(aten._linalg_eigvals.default, A))
    torch.testing.assert_close(w.gather(-1, _matched(w, w0)), w0, **t)


@pytest.mark.parametrize("dtype", [F32, F64, C128])
def test_matrix_exp(dtype):
    t = _tol(dtype)
    with Batch() as b:
        for scale in (1e-3, 0.3, 1.0, 4.0):  # no scaling up to 2^4 squarings
            b.check(aten.linalg_matrix_exp.default, make((3, 4, 4), F64, low=-1, high=1, seed=2).to(dtype) * scale, **t)
        b.check(aten.linalg_matrix_exp.default, make((2, 1, 1), dtype), **t)
