"""Conjugation / complex / polar lowerings (shardtensor/ops/complex.py) against eager torch on CPU, and
conjugate views through sharded tensors (reads, autograd, writes through the view)."""

import importlib

import pytest
import torch

from _lowering_harness import Batch, call, make

importlib.import_module("shardtensor.ops.complex")

aten = torch.ops.aten
F32, F64 = torch.float32, torch.float64
C64, C128 = torch.complex64, torch.complex128
NAN, INF = float("nan"), float("inf")


def _complex(shape, dtype, seed=0):
    real = make(shape, F32 if dtype == C64 else F64, seed=seed)
    imag = make(shape, F32 if dtype == C64 else F64, seed=seed + 1)
    return torch.complex(real, imag)


# ----------------------------------------------------------------------------------------------
# conj, complex, polar
# ----------------------------------------------------------------------------------------------
def test_conj_complex_polar():
    with Batch() as b:
        for dt in (C64, C128):
            z = _complex((3, 4), dt)
            z[0, 0] = complex(NAN, INF)
            for op in (aten._conj.default, aten._conj_physical.default, aten._conj_copy.default):
                b.check(op, z)
                b.check(op, z[0, 1])
        b.check(aten._conj_physical.default, make((3,), F32))  # real: a copy
        for dt in (F32, F64):
            a, t = make((4, 1), dt, seed=2), make((5,), dt, seed=3)
            b.check(aten.complex.default, a, t)  # broadcasting
            b.check(aten.complex.default, torch.tensor(1.5, dtype=dt), t)
            special = torch.tensor([NAN, INF, -0.0], dtype=dt)
            b.check(aten.complex.default, special, torch.tensor([1, NAN, -INF], dtype=dt))
            b.check(aten.polar.default, a.abs(), t)
            b.check(
                aten.polar.default,
                torch.tensor([2.0, 0.0, INF, NAN, -1.0], dtype=dt),
                torch.tensor([0.5, 1.0, 0.0, 1.0, 3.0], dtype=dt),
            )


def test_complex_errors():
    with pytest.raises(RuntimeError, match="same dtype"):
        call(aten.complex.default, make((2,), F32), make((2,), F64))
    with pytest.raises(RuntimeError, match="float or double"):
        call(aten.polar.default, torch.tensor([1, 2]), torch.tensor([1, 2]))


# ----------------------------------------------------------------------------------------------
# through sharded tensors
# ----------------------------------------------------------------------------------------------
def _mesh(shape=(4, 2)):
    import shardtensor as st

    names = ("x", "y")[: len(shape)]
    return st, st.Mesh(range(8), shape, names)


def test_sharded_conj_views():
    st, mesh = _mesh()
    z = _complex((8, 3), C64, seed=14)
    sz = st.shard(z.clone(), mesh, ("x", None))
    # no conjugate bit: the view holds the conjugated values, is_conj() is False, resolve_conj is a no-op
    view = sz.conj()
    assert not view.is_conj()
    torch.testing.assert_close(view.cpu(), z.conj().resolve_conj())
    torch.testing.assert_close(view.resolve_conj().cpu(), z.conj().resolve_conj())
    torch.testing.assert_close(sz.mH.cpu(), z.mH.resolve_conj())
    torch.testing.assert_close(torch.view_as_real(view).cpu(), torch.view_as_real(z.conj().resolve_conj()))
    sz.mul_(2)  # a later write into the base shows through the view
    torch.testing.assert_close(view.cpu(), (2 * z).conj().resolve_conj())
    # autograd through conj, hfft (conj + c2r) and ifft of a real input (r2c + conj)
    r = make((8, 6), F32, seed=15)
    for fn in (
        lambda t: torch.fft.hfft(t.to(C64) * (1 + 1j)),
        lambda t: torch.view_as_real(torch.fft.ifft(t).resolve_conj()),
        lambda t: (torch.polar(t.abs(), t) * torch.complex(t, t).conj()).abs(),
    ):
        ref = r.clone().requires_grad_()
        fn(ref).sum().backward()
        sr = st.shard(r.clone(), mesh, ("x", None)).requires_grad_()
        got = fn(sr)
        got.sum().backward()
        torch.testing.assert_close(got.detach().cpu(), fn(r), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sr.grad.cpu(), ref.grad, rtol=1e-4, atol=1e-4)


def test_sharded_write_through_conj_view():
    st, mesh = _mesh()
    z = _complex((8, 3), C64, seed=16)
    sz = st.shard(z.clone(), mesh, ("x", None))
    view, want = sz.conj(), z.clone()
    want_view = want.conj()
    view.mul_(2)
    want_view.mul_(2)
    view[0, 0] = 1 + 1j
    want_view[0, 0] = 1 + 1j
    torch.testing.assert_close(sz.cpu(), want)
