"""Every OpInfo entry with float32 CPU samples, sharded over a (4, 2) mesh, compared with eager torch:
forward and backward in lazy mode, forward in eager mode, with uneven shardings, with int64 / bool /
bfloat16 samples, and the in-place variants (see opinfo_harness.py for what each kind checks).

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


def _run(kind, name):
    tid = f"test_{kind}[{name}]"
    expected, reason = EXPECTED.get(tid, (None, None))
    if expected == "skip":
        pytest.skip(f"expected failure (skip): {reason}")
    failure = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compared = h.KINDS[kind][1](h.OPS[name])
    except Exception as e:  # noqa: BLE001
        if expected != "xfail":
            raise
        failure = h.failure_reason(e)[:200]
    if failure is not None:  # (outside the except: pytest would format the chained traceback's sources)
        pytest.xfail(f"{reason} [got {failure}]")
    if expected == "xfail":
        pytest.fail(f"{tid} passes now: remove it from {h.EXPECTED_FILE.name} (listed: {reason})", pytrace=False)
    if not compared:
        pytest.skip("the OpInfo entry has no sample for this check")


@pytest.mark.parametrize("name", h.ids_of("forward"))
def test_forward(name):
    _run("forward", name)


@pytest.mark.parametrize("name", h.ids_of("backward"))
def test_backward(name):
    _run("backward", name)


@pytest.mark.parametrize("name", h.ids_of("forward_eager"))
def test_forward_eager(name):
    _run("forward_eager", name)


@pytest.mark.parametrize("name", h.ids_of("forward_uneven"))
def test_forward_uneven(name):
    _run("forward_uneven", name)


@pytest.mark.parametrize("name", h.ids_of("forward_int64"))
def test_forward_int64(name):
    _run("forward_int64", name)


@pytest.mark.parametrize("name", h.ids_of("forward_bool"))
def test_forward_bool(name):
    _run("forward_bool", name)


@pytest.mark.parametrize("name", h.ids_of("forward_bfloat16"))
def test_forward_bfloat16(name):
    _run("forward_bfloat16", name)


@pytest.mark.parametrize("name", h.ids_of("inplace"))
def test_inplace(name):
    _run("inplace", name)


def test_every_kind_has_a_test():
    assert {k for k in h.KINDS} == {
        n[len("test_") :] for n in globals() if n.startswith("test_") and n[len("test_") :] in h.KINDS
    }


def test_expected_file_names_real_tests():
    known = {f"test_{kind}[{n}]" for kind in h.KINDS for n in h.ids_of(kind)}
    stale = sorted(set(EXPECTED) - known)
    assert not stale, f"{h.EXPECTED_FILE.name} lists tests that do not exist: {stale[:10]}"
