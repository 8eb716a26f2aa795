"""Linear algebra lowerings (shardtensor/ops/linalg.py: SVD, QR, pinv, LU factor, triangular solves,
diag_embed, max_unpool) against eager torch on CPU (float32, float64, odd and batched shapes)."""

import importlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _lowering_harness import Batch, call, make, to_torch  # noqa: E402

importlib.import_module("shardtensor.ops.linalg")  # not yet in shardtensor.ops' import list

aten = torch.ops.aten
F32, F64 = torch.float32, torch.float64
SHAPES = [(3, 3), (5, 3), (3, 5), (2, 4, 4), (2, 3, 5, 2)]


def _tol(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == F32 else dict(atol=1e-10, rtol=1e-10)


def _tri(shape, dtype, upper, seed=0):
    a = make(shape, dtype, low=-1, high=1, seed=seed)
    a = a + 3 * torch.eye(shape[-1], dtype=dtype)  # well conditioned
    return a.triu() if upper else a.tril()


@pytest.mark.parametrize("dtype", [F32, F64])
def test_decompositions(dtype):
    t = _tol(dtype)
    with Batch() as b:
        for i, s in enumerate(SHAPES):
            a = make(s, dtype, seed=i)
            b.check(aten._linalg_svd.default, a, False, False, **t)
            for mode in ("reduced", "complete", "r"):
                b.check(aten.linalg_qr.default, a, mode, **t)
            b.check(aten.linalg_pinv.atol_rtol_tensor, a, **t)
            b.check(aten.linalg_lu_factor_ex.default, a, **t)
        h = make((2, 4, 4), dtype, seed=7)
        b.check(aten.linalg_pinv.atol_rtol_tensor, h + h.mT, hermitian=True, **t)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("tols", [dict(rtol=0.3), dict(atol=0.5), dict(atol=0.0), dict(atol=0.2, rtol=0.1)])
def test_pinv_tolerances(dtype, tols):
    # atol / rtol are also Batch.check's own keywords, so call the lowering directly
    a = make((2, 5, 3), dtype, seed=3)
    tt = {k: torch.tensor(v, dtype=F64) for k, v in tols.items()}
    expected = aten.linalg_pinv.atol_rtol_tensor(a, **tt)
    got = to_torch(call(aten.linalg_pinv.atol_rtol_tensor, a, **tt))
    torch.testing.assert_close(got, expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("full", [False, True])
def test_svd(dtype, shape, full):
    # singular vectors are unique only up to sign (LAPACK may pick others for wide matrices):
    # compare S exactly, and U / Vh after aligning each singular pair's sign
    a = make(shape, dtype, seed=5)
    U0, S0, Vh0 = aten._linalg_svd.default(a, full, True)
    U, S, Vh = (to_torch(v) for v in call(aten._linalg_svd.default, a, full, True))
    assert (U.dtype, S.dtype, Vh.dtype) == (U0.dtype, S0.dtype, Vh0.dtype)
    assert (U.shape, S.shape, Vh.shape) == (U0.shape, S0.shape, Vh0.shape)
    t = _tol(dtype)
    torch.testing.assert_close(S, S0, **t)
    k = S0.shape[-1]
    sign = torch.sign((U[..., :k] * U0[..., :k]).sum(-2))
    torch.testing.assert_close(U[..., :k] * sign.unsqueeze(-2), U0[..., :k], **t)
    torch.testing.assert_close(Vh[..., :k, :] * sign.unsqueeze(-1), Vh0[..., :k, :], **t)
    torch.testing.assert_close(U[..., :k] * S.unsqueeze(-2) @ Vh[..., :k, :], a, **t)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_lu_singular_info(dtype):
    a = torch.zeros(2, 3, 3, dtype=dtype)
    a[0] = torch.eye(3, dtype=dtype)
    a[1, 0, 0] = 1.0
    check_args = dict(**_tol(dtype))
    with Batch() as b:
        b.check(aten.linalg_lu_factor_ex.default, a, **check_args)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_triangular(dtype):
    t = _tol(dtype)
    with Batch() as b:
        for upper in (True, False):
            for uni in (True, False):
                A = _tri((2, 3, 3), dtype, upper)
                B = make((2, 3, 5), dtype, seed=1)
                b.check(aten.linalg_solve_triangular.default, A, B, upper=upper, unitriangular=uni, **t)
                b.check(aten.linalg_solve_triangular.default, A, B.mT, upper=upper, left=False, unitriangular=uni, **t)
                b.check(aten.linalg_solve_triangular.default, A[0], B, upper=upper, unitriangular=uni, **t)  # broadcast
                for tr in (True, False):
                    b.check(aten.triangular_solve.default, B, A, upper, tr, uni, **t)
                    b.check(aten.triangular_solve.default, B[0], A, upper, tr, uni, **t)


@pytest.mark.parametrize("dtype", [F32, F64, torch.int64])
def test_diag_embed(dtype):
    x = make((2, 3, 4), dtype)
    with Batch() as b:
        for off in (0, 1, -2):
            b.check(aten.diag_embed.default, x, off)
            b.check(aten.diag_embed.default, x, off, 0, 2)
            b.check(aten.diag_embed.default, x, off, -1, 1)
        b.check(aten.diag_embed.default, make((5,), dtype), 1)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_max_unpool(dtype):
    x = make((2, 3, 6, 5), dtype)
    v, i = torch.nn.functional.max_pool2d(x, 2, return_indices=True)
    x3 = make((1, 2, 4, 4, 5), dtype)
    v3, i3 = torch.nn.functional.max_pool3d(x3, 2, return_indices=True)
    with Batch() as b:
        b.check(aten.max_unpool2d.default, v, i, [6, 5])
        b.check(aten.max_unpool2d.default, v[0], i[0], [6, 5])
        b.check(aten.max_unpool3d.default, v3, i3, [4, 4, 5], [2, 2, 2], [0, 0, 0])
