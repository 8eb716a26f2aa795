"""Every OpInfo entry with float32 CPU samples, sharded over a (4, 2) mesh, forward and backward,
compared with eager torch (see opinfo_harness.py for what is checked).

Expected failures live in opinfo_expected_failures.txt, one test id a line with its reason:
  * listed as xfail and fails  -> xfail;
  * listed as xfail and passes -> FAIL (remove the line: the file only shrinks);
  * listed as skip             -> skipped before running (slow or hangs);
  * not listed and fails       -> FAIL.
Regenerate the file with ``.venv/bin/python bench/op_coverage.py --write-expected``.
"""
from __future__ import annotations

import warnings

import pytest

import opinfo_harness as h

import shardtensor as st

_RUN = {"count": 0}


@pytest.fixture(autouse=True)
def _bounded_executable_caches():
    # The sweep compiles thousands of small programs in one worker; dropping them now and then
    # keeps the worker's memory (and XLA's) bounded for the tests that run after it.
    yield
    _RUN["count"] += 1
    if _RUN["count"] % 100 == 0:
        st.clear_executables()

EXPECTED = h.load_expected()


def _run(tid, fn, op):
    kind, reason = EXPECTED.get(tid, (None, None))
    if kind == "skip":
        pytest.skip(f"expected failure (skip): {reason}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(op)
    except Exception as e:  # noqa: BLE001
        if kind == "xfail":
            pytest.xfail(f"{reason} [got {h.failure_reason(e)[:200]}]")
        raise
    if kind == "xfail":
        pytest.fail(f"{tid} passes now: remove it from {h.EXPECTED_FILE.name} (listed: {reason})",
                    pytrace=False)


@pytest.mark.parametrize("name", sorted(h.OPS))
def test_forward(name):
    _run(f"test_forward[{name}]", h.check_forward, h.OPS[name])


@pytest.mark.parametrize("name", sorted(h.DIFF_OPS))
def test_backward(name):
    _run(f"test_backward[{name}]", h.check_backward, h.OPS[name])


def test_expected_file_names_real_tests():
    known = {f"test_forward[{n}]" for n in h.OPS} | {f"test_backward[{n}]" for n in h.DIFF_OPS}
    stale = sorted(set(EXPECTED) - known)
    assert not stale, f"{h.EXPECTED_FILE.name} lists tests that do not exist: {stale[:10]}"
