"""FFT lowerings (shardtensor/ops/fft.py) against eager torch on CPU (float32, float64, odd and batched shapes)."""

import importlib

import pytest
import torch

from _lowering_harness import Batch, make

importlib.import_module("shardtensor.ops.fft")

aten = torch.ops.aten
F32, F64 = torch.float32, torch.float64


def _tol(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == F32 else dict(atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_fft(dtype):
    t = _tol(dtype)
    ct = torch.complex64 if dtype == F32 else torch.complex128
    x = make((3, 5, 6), dtype)
    z = torch.complex(make((3, 5, 6), dtype, seed=1), make((3, 5, 6), dtype, seed=2))
    assert z.dtype == ct
    with Batch() as b:
        for norm in (0, 1, 2):
            for dim in ([2], [1], [0, 2], [0, 1, 2]):
                for onesided in (True, False):
                    b.check(aten._fft_r2c.default, x, dim, norm, onesided, **t)
                for fwd in (True, False):
                    b.check(aten._fft_c2c.default, z, dim, norm, fwd, **t)
                half = z.narrow(dim[-1], 0, z.shape[dim[-1]] // 2 + 1).contiguous()
                for last in (2 * (half.shape[dim[-1]] - 1), 2 * half.shape[dim[-1]] - 1):
                    b.check(aten._fft_c2r.default, half, dim, norm, last, **t)
