"""Inputs for the linear-algebra lowering tests: well-conditioned square, symmetric / Hermitian
matrices, and the tolerances per dtype."""

import torch

from _lowering_harness import make

F32, F64, C64 = torch.float32, torch.float64, torch.complex64


def _tol(dtype):
    return {"atol": 1e-4, "rtol": 1e-4} if dtype in (F32, C64) else {"atol": 1e-9, "rtol": 1e-9}


def _square(shape, dtype, seed=0):
    """A well-conditioned (diagonally weighted) square matrix batch."""
    if dtype.is_complex:
        real = F32 if dtype == C64 else F64
        a = torch.complex(
            make(shape, real, low=-1, high=1, seed=seed), make(shape, real, low=-1, high=1, seed=seed + 1)
        )
    else:
        a = make(shape, dtype, low=-1, high=1, seed=seed)
    return a + 2 * torch.eye(shape[-1], dtype=dtype)


def _sym(shape, dtype, seed=0, herm=True):
    a = _square(shape, dtype, seed) - 2 * torch.eye(shape[-1], dtype=dtype)
    return a + (a.mH if herm else a.mT)
