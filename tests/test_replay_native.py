"""A frozen replay's per-call passes in C++ (``replay_gather``, ``replay_store`` of the device
extension) and their Python fallback (the extension absent): both give torch's results, and each
pass does what the Python does, dead cells, ownership and changed arrays included. The check rows'
host read (``checks.host_rows``) equals ``np.asarray``'s.
"""

from __future__ import annotations

import gc
import weakref

import jax
import numpy as np
import pytest
import torch

import shardtensor as st
from shardtensor import frozen_replay
from shardtensor.graph import checks, inflight
from shardtensor.graph.ir import Cell
from shardtensor.tensor import device as torch_device
from test_replay_fast_path import _clean, _decoder  # noqa: F401 (_clean: autouse)
from test_replay_fast_path import _run as run_decoder

NATIVE = getattr(torch_device.EXT, "replay_store", None) is not None
needs_extension = pytest.mark.skipif(not NATIVE, reason="the C++ extension could not be built here")


def _run(step, calls, device):
    """``calls`` steps of the greedy decoder from token 1 at position 0."""
    return run_decoder(step, torch.tensor([1]).to(device), torch.tensor([0]).to(device), calls)


@pytest.mark.parametrize("raise_on_call", [True, False])
@pytest.mark.parametrize("passes", ["extension", "python"])
def test_replay_equals_torch_with_either_passes(passes, raise_on_call, monkeypatch):
    if passes == "python":
        monkeypatch.setattr(frozen_replay, "NATIVE_PASSES", False)  # (read when a trace freezes)
    elif not NATIVE:
        pytest.skip("the C++ extension could not be built here")
    step, cache = _decoder(st.device(), raise_on_call)
    ref_step, ref_cache = _decoder("cpu")
    replays = st.counter_value("CompileReplay") or 0
    got, expected = _run(step, 7, st.device()), _run(ref_step, 7, "cpu")
    assert (st.counter_value("CompileReplay") or 0) - replays >= 5
    (frozen,) = step._frozen.values()
    assert (frozen._native is not None) == (passes == "extension")
    for (t, p, lg), (t2, p2, lg2) in zip(expected, got):
        assert torch.equal(t2.cpu(), t) and torch.equal(p2.cpu(), p)
        torch.testing.assert_close(lg2.cpu(), lg)
    torch.testing.assert_close(cache.cpu(), ref_cache)


@needs_extension
def test_gather_matches_python_and_sees_changes():
    step, _ = _decoder(st.device())
    outs = _run(step, 4, st.device())
    tok, pos, _ = outs[-2]  # (the last call's inputs: they passed its checks)
    (frozen,) = step._frozen.values()
    flat = [tok, pos]
    plan = (*frozen._gather_plan, frozen._passed, frozen._donated_read_at)
    cells, values, unchanged, owned = torch_device.EXT.replay_gather(flat, *plan)
    py_cells, py_values = frozen._gather(flat)
    assert all(a is b for a, b in zip(cells, py_cells)) and len(cells) == len(py_cells)
    assert all(a is b for a, b in zip(values, py_values)) and len(values) == len(py_values)
    assert unchanged and owned  # (the cache holds what the last replay wrote into it)
    # another array in an argument's cell: not the one that passed
    other = torch.tensor([2]).to(st.device())
    st.sync()
    assert torch_device.EXT.replay_gather([tok, other], *plan)[2] is False
    # a donated input shared with another tensor: not owned
    donated = frozen._donated_read_at
    assert donated
    cell = cells[donated[0]]
    cell.owned = False
    try:
        assert torch_device.EXT.replay_gather(flat, *plan)[3] is False
    finally:
        cell.owned = True


@needs_extension
def test_gather_answers_none_for_a_dead_cell():
    dead = Cell(None, (1,), torch.float32)
    ref = weakref.ref(dead)
    del dead
    gc.collect()
    assert torch_device.EXT.replay_gather([], (), (ref,), (), [lambda: None], ()) is None


@needs_extension
def test_store_gives_each_output_to_its_cell():
    arg_cell = Cell("a0", (1,), torch.float32, owned=True)
    made = Cell(None, (1,), torch.float32)
    old = Cell("c0", (1,), torch.float32)
    gone = Cell("d0", (1,), torch.float32)

    class Arg:
        _cell = arg_cell

    plan = (
        (0, 0, None, False, True),  # an argument's cell, kept before, not owned after (passed through)
        (1, 0, None, True, False),  # a returned tensor's new cell
        (2, 0, weakref.ref(old), True, True),  # a closed-over cell
        (2, 0, weakref.ref(gone), True, False),  # one that died: skipped
    )
    del gone
    gc.collect()
    versions = arg_cell.version, made.version, old.version
    outs = ["a1", "m1", "c1", "d1"]
    cells, refs, befores, owned = torch_device.EXT.replay_store(plan, [Arg()], outs, [made])
    entries = list(inflight.Entries(refs, outs, befores, owned))  # (as a replay notes them)
    assert cells[:3] == [arg_cell, made, old] and cells[3] is None
    assert refs[3] is None and befores[3] is None and owned[3] is None
    assert [c.value for c in cells[:3]] == ["a1", "m1", "c1"]
    assert [c.owned for c in cells[:3]] == [False, True, True]
    assert [c.version for c in cells[:3]] == [v + 1 for v in versions]
    assert all(c._leaf is None for c in cells[:3])
    assert [(e[0](), e[1], e[2], e[3]) for e in entries] == [
        (arg_cell, "a1", "a0", True),
        (made, "m1", None, False),
        (old, "c1", "c0", False),
    ]


@needs_extension
def test_store_notes_what_passes_and_takes_any_cell_class():
    """A target with a read position sets ``passed`` to a weak reference to its output; a cell of
    another class (its fields reached by attribute, not by slot) is stored the same."""

    class Out:  # (weakly referenceable, as jax arrays are)
        pass

    class OtherCell(Cell):
        __slots__ = ()

    class DictCell:  # no slots at all
        def __init__(self):
            self.value, self.owned, self.version, self._leaf = "b0", True, 5, "leaf"

    cells_in = [Cell("a0", (1,), torch.float32, owned=True), OtherCell("c0", (1,), torch.float32), DictCell()]
    plan = tuple((2, 0, weakref.ref(c), False, True, r) for c, r in zip(cells_in, (1, -1, 0)))
    outs = [Out(), Out(), Out()]
    passed = [None, None]
    cells, refs, befores, owned = torch_device.EXT.replay_store(plan, [], outs, [], passed)
    entries = list(inflight.Entries(refs, outs, befores, owned))
    assert cells == cells_in
    assert passed[0]() is outs[2] and passed[1]() is outs[0]
    assert [c.value for c in cells] == outs and [c.owned for c in cells] == [False] * 3
    assert [c.version for c in cells] == [1, 1, 6] and all(c._leaf is None for c in cells)
    assert [e[2:] for e in entries] == [("a0", True), ("c0", False), ("b0", True)]
    with pytest.raises(IndexError, match="passed"):
        torch_device.EXT.replay_store(((2, 0, weakref.ref(cells_in[0]), False, False, 5),), [], [Out()], [], passed)


@needs_extension
@needs_extension
def test_passes_refuse_malformed_plans():
    with pytest.raises(TypeError):
        torch_device.EXT.replay_store(((0, 0),), [], ["x"], [])
    with pytest.raises(ValueError, match="one output per target"):
        torch_device.EXT.replay_store((), [], ["x"], [])
    with pytest.raises(IndexError):
        torch_device.EXT.replay_gather([], (3,), (), (), [lambda: None], ())


def test_host_rows_equals_numpy():
    mesh = jax.make_mesh((len(jax.devices()),), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rows = jax.device_put(np.arange(18, dtype=np.int32).reshape(6, 3), replicated)
    np.testing.assert_array_equal(checks.host_rows(rows), np.asarray(rows))
    plain = np.ones((2, 3), np.int32)  # (no single-shard read: np.asarray's)
    np.testing.assert_array_equal(checks.host_rows(plain), plain)
