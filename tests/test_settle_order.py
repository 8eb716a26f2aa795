"""The host prepares the next program while the devices still run the last one.

Reading an earlier run's check rows (``checks.verify``) waits for that run. A lazy sync therefore
builds and looks up its program first, and a frozen ``st.compile`` replay gathers and checks its
inputs first, and only then reads the earlier runs' checks and calls the program: that host work
overlaps the devices' work. What must not change: a failed check of an earlier run still raises
before anything new runs, and every value computed from the failed result still raises — also when
the next program copied that result onto its own mesh before the checks were read.
"""

from __future__ import annotations

import pytest
import torch

import shardtensor as st
from shardtensor.graph import checks, execute

MESH = st.Mesh(range(8), (4, 2), ("x", "y"))


def _put(t):
    return st.shard(t, MESH, ("x",) + (None,) * (t.dim() - 1))


@pytest.fixture
def events(monkeypatch):
    """The order of: a program prepared, check rows read, a program called."""
    seen: list[str] = []

    def log(name, fn):
        def logged(*args, **kwargs):
            seen.append(name)
            return fn(*args, **kwargs)

        return logged

    prepare = execute.Execution.prepare.__func__
    monkeypatch.setattr(execute.Execution, "prepare", classmethod(log("prepare", prepare)))
    monkeypatch.setattr(checks, "host_rows", log("rows", checks.host_rows))
    monkeypatch.setattr(execute, "call_executable", log("call", execute.call_executable))
    monkeypatch.setattr(execute, "call_prepared", log("call", execute.call_prepared))
    return seen


def _lazy_step(table, ids):
    """A step with an on-device check (the index read by ``index_select``)."""
    return (table.index_select(0, ids) * 2).sum()


def test_lazy_sync_prepares_before_reading_earlier_checks(events):
    table = _put(torch.arange(24.0).reshape(8, 3))
    ids = _put(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]))
    first = _lazy_step(table, ids)
    st.sync()
    events.clear()
    second = _lazy_step(table, ids) + first
    st.sync()
    assert events == ["prepare", "rows", "call"]
    expected = (torch.arange(24.0) * 2).sum()
    torch.testing.assert_close(second.cpu(), 2 * expected)


def test_replay_gathers_before_reading_earlier_checks(events, monkeypatch):
    table = _put(torch.arange(24.0).reshape(8, 3))
    weights = _put(torch.ones(8, 3))

    @st.compile(raise_on_call=False)  # (with True each call has read its own rows already)
    def step(ids):
        weights.mul_(2)
        return (table.index_select(0, ids) * weights).sum()

    ids = _put(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]))
    for _ in range(3):  # traced twice, then frozen
        step(ids)
    frozen = next(iter(step._frozen.values()))
    if frozen._native is not None:  # the C++ gather: seen through a stand-in for the extension

        class Logged:
            def replay_gather(self, *args):
                events.append("gather")
                return native.replay_gather(*args)

            def replay_store(self, *args):
                return native.replay_store(*args)

        native = frozen._native
        monkeypatch.setattr(frozen, "_native", Logged())
    else:
        monkeypatch.setattr(frozen, "_gather", lambda flat, g=frozen._gather: (events.append("gather"), g(flat))[1])
    events.clear()
    calls = st.counter_value("CompileReplay") or 0
    out = step(ids)
    assert st.counter_value("CompileReplay") == calls + 1
    assert events == ["gather", "rows", "call"]
    torch.testing.assert_close(out.cpu(), (torch.arange(24.0).reshape(8, 3) * 2**4).sum())


def test_an_earlier_failed_check_still_raises_before_the_next_program_runs():
    table = _put(torch.arange(24.0).reshape(8, 3))
    bad = _lazy_step(table, _put(torch.tensor([0, 1, 2, 3, 4, 5, 6, 9])))
    st.sync()
    after = bad + 1  # recorded before the failure is known
    runs = st.counter_value("ExecuteReplicated") or 0
    with pytest.raises(IndexError, match="index out of range in self"):
        st.sync()
    assert (st.counter_value("ExecuteReplicated") or 0) == runs  # the program built for `after` never ran
    for value in (bad, after):
        with pytest.raises(IndexError):
            value.cpu()


def test_a_failed_result_copied_onto_the_next_programs_mesh_still_raises():
    # replicated on the default mesh of all devices (no global mesh), then read by a program on MESH:
    # the next program copies it onto MESH before the failed check is read
    assert st.get_global_mesh() is None
    table = torch.arange(24.0).reshape(8, 3).to(st.device())
    bad = table.index_select(0, torch.tensor([0, 9]).to(st.device()))
    st.sync()
    other = st.shard(torch.ones(2, 3), MESH, (None, None))
    total = other + bad
    with pytest.raises(IndexError, match="index out of range in self"):
        st.sync()
    for value in (bad, total):
        with pytest.raises(IndexError):
            value.cpu()


def test_a_failed_input_a_replay_copies_onto_its_mesh_still_raises():
    # a frozen replay checks (and copies onto its mesh) a changed input before it reads the earlier
    # runs' checks: the copy of a failed result must fail with it
    assert st.get_global_mesh() is None
    table = torch.arange(24.0).reshape(8, 3).to(st.device())  # on the default mesh of all devices
    x = _put(torch.ones(4, 3))

    @st.compile(raise_on_call=False)
    def add(x, rows):
        return x + rows

    good = table.index_select(0, torch.tensor([0, 1, 2, 3]).to(st.device()))
    for _ in range(3):  # traced twice, then frozen
        torch.testing.assert_close(add(x, good).cpu(), 1 + torch.arange(12.0).reshape(4, 3))
    copies = st.counter_value("ReplicateToGraphMesh") or 0
    bad = table.index_select(0, torch.tensor([0, 1, 2, 9]).to(st.device()))
    st.sync()
    with pytest.raises(IndexError, match="index out of range in self"):
        add(x, bad)
    assert st.counter_value("ReplicateToGraphMesh") == copies + 1  # it was copied before the checks were read
    with pytest.raises(IndexError):
        bad.cpu()
