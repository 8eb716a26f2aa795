"""NaN, infinity and signed zeros in every reduction, sort, search and comparison op, sharded over
each dimension, lazily and under ``st.compile``, against eager torch (see nonfinite_harness.py)."""

from __future__ import annotations

import pytest

import nonfinite_harness as nf


@pytest.mark.parametrize("spec", nf.SPECS, ids=lambda s: "-".join(str(a) for a in s))
def test_nonfinite_sweep(spec):
    # lazy first: the st.compile trace records the same program, found in the executable cache
    assert nf.run_sweep(spec, compiled=False) == len(nf.cases(spec))
    assert nf.run_sweep(spec, compiled=True) == len(nf.cases(spec))
    if spec in nf.HOST_SPECS:  # the cases that read values back while they run: small programs each
        nf.run_sweep(spec, False, nf.host_cases())
        nf.run_sweep(spec, True, nf.host_cases())
