"""float64 on a TPU says what it does (issue 36 §5): the chip has no 64-bit float units and XLA's
emulation keeps float32's exponent range, so the first float64 / complex128 value made there warns,
once per process, naming the dtype and the way out. On the CPU the platform check is faked; the test
marked ``tpu`` runs on the chip."""

import warnings

import pytest
import torch

import shardtensor as st
from shardtensor import runtime as rt


@pytest.fixture
def first_warning(monkeypatch):
    """The once-per-process flag cleared for the test (and put back after)."""
    monkeypatch.setattr(rt, "_FLOAT64_WARNED", [False])


def test_float64_on_a_tpu_warns_once_naming_the_dtype(first_warning, monkeypatch):
    monkeypatch.setattr(rt, "_on_tpu", lambda: True)
    x = torch.rand(7, 13, dtype=torch.float64)  # a shape no other test records
    with pytest.warns(st.Float64OnTPUWarning, match=r"float64 value .* TPU.*1e-38.*\.cpu\(\).*float32"):
        y = x.to(st.device()) * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second warning
        z = (y + 1).sum() * 2
    torch.testing.assert_close(z.cpu(), ((x * 3 + 1).sum() * 2))  # the CPU's result is exact


def test_complex128_warns_too(first_warning, monkeypatch):
    monkeypatch.setattr(rt, "_on_tpu", lambda: True)
    with pytest.warns(st.Float64OnTPUWarning, match="complex128"):
        torch.ones(3, 5, dtype=torch.complex128).to(st.device()).cpu()


def test_no_warning_off_a_tpu_or_for_other_dtypes(first_warning, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (torch.rand(3, 11, dtype=torch.float64).to(st.device()) * 2).cpu()  # a CPU: float64 is exact
        monkeypatch.setattr(rt, "_on_tpu", lambda: True)
        (torch.rand(3, 11).to(st.device()) * 2).cpu()  # float32 on the "TPU"


@pytest.mark.tpu
@pytest.mark.skipif("rt.platform() != 'tpu'", reason="needs a TPU chip: run SHARDTENSOR_PLATFORM=tpu pytest -m tpu")
def test_float64_warns_on_the_chip(first_warning):
    x = torch.rand(100, dtype=torch.float64) + 0.5
    with pytest.warns(st.Float64OnTPUWarning, match="float64"):
        (x.to(st.device()) * 1e-300 / 3).sum().cpu()
