"""The lazy recording's shortcuts keep torch's behaviour: a tensor's signature (its entry in a recorded
op's memo key, kept on the tensor) follows every in-place change of its geometry, and a thread's
pending cells leave the pending set when they die. Every result is compared with eager torch.
"""

import gc

import torch
from torch.testing import assert_close

import shardtensor as st
from shardtensor.graph import state
from tensor_helpers import MESH_42, isolate_lazy_graph


def _check(fn, t):
    """fn (returning a list of tensors) gives torch's results on the sharded twin of ``t``."""
    x = st.shard(t.clone(), MESH_42, ("x", None))
    got = fn(x)
    st.sync(wait=True)
    want = fn(t.clone())
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.stride() == w.stride()
        assert_close(g.cpu(), w)


def test_same_op_after_the_tensor_changes_shape_in_place():
    def fn(x):
        first = x * 2  # memoises mul for the (8, 4) signature
        x.t_()  # now (4, 8), the same tensor object
        second = x * 2
        x.unsqueeze_(0)  # (1, 4, 8)
        third = x * 2
        return [first, second, third]

    try:
        _check(fn, torch.randn(8, 4))
    finally:
        isolate_lazy_graph()


def test_same_op_after_data_is_replaced():
    try:
        torch.manual_seed(0)
        t = torch.randn(8, 4)
        x = st.shard(t.clone(), MESH_42, ("x", None))
        y = (x + 1).sum(0)  # memoises add and sum for (8, 4)
        x.data = st.shard(torch.arange(6.0).reshape(2, 3), MESH_42, (None, None))
        z = (x + 1).sum(0)
        assert_close(y.cpu(), (t + 1).sum(0))
        assert_close(z.cpu(), (torch.arange(6.0).reshape(2, 3) + 1).sum(0))
    finally:
        isolate_lazy_graph()


def test_views_and_strided_results_record_their_own_geometry():
    def fn(x):
        v = x.t()[1:]  # a strided view: (3, 8) with strides (1, 4)
        a = v * 3
        w = x.as_strided((2, 2), (1, 4), 1)
        return [v, a, w, w + 1]

    try:
        _check(fn, torch.randn(8, 4))
    finally:
        isolate_lazy_graph()


def test_dead_pending_cells_leave_the_pending_set():
    try:
        st.sync(wait=True)
        x = st.shard(torch.ones(8, 4), MESH_42, ("x", None))
        kept = x + 1
        for _ in range(20):
            kept = kept * 1  # each intermediate dies at once
        gc.collect()
        pending = state.pending_cells()
        assert pending == [kept._cell]
        assert len(state.STATE.pending) == 1
        st.sync(wait=True)
        assert state.pending_cells() == [] and not state.has_pending()
        assert_close(kept.cpu(), torch.full((8, 4), 2.0))
    finally:
        isolate_lazy_graph()


def test_static_numbers_equal_in_python_keep_their_types():
    """8 == 8.0 == True in Python, but arange(8.0) is float, arange(8) int64 and full(s, True) bool:
    an op recorded with one must not hand its result type to the other (a cached plan once did)."""
    d = st.device()
    calls = [
        lambda dev: torch.arange(8.0, device=dev),
        lambda dev: torch.arange(8, device=dev),
        lambda dev: torch.arange(0, 8, 2.0, device=dev),
        lambda dev: torch.arange(0, 8, 2, device=dev),
        lambda dev: torch.full((2,), 1.0, device=dev),
        lambda dev: torch.full((2,), 1, device=dev),
        lambda dev: torch.full((2,), True, device=dev),
    ]
    for call in calls:
        got, want = call(d), call("cpu")
        assert got.dtype == want.dtype
        assert_close(got.cpu(), want)
    ints = [torch.arange(4), torch.arange(3)]
    for scalars in ([1, 2], [1.5, 2.5]):
        got = torch._foreach_add([st.shard(t, MESH_42, (None,)) for t in ints], scalars)
        want = torch._foreach_add(ints, scalars)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            assert_close(g.cpu(), w)


def test_foreach_inplace_casts_into_its_targets_on_every_call():
    """A foreach in-place op whose results have another dtype than some targets casts them into the
    targets' dtypes; the second call with the same arguments reuses what the first checked (the
    plan's per-target casts) and gives torch's values too."""

    def fn(x):
        a, b = x.to(torch.bfloat16), x * 3  # targets of two dtypes
        for scale in (0.5, 0.25):  # the second call: the same plan
            torch._foreach_add_([a, b], [x * scale, x + scale])
        return [a, b]

    _check(fn, torch.randn(8, 4))


def test_op_tables_answer_by_identity_after_every_change():
    """``OpTable.find`` (the dispatch's lookup by the overload's id) agrees with the dict after each
    way of changing it, as the test suite's ``monkeypatch.delitem`` and ``.pop`` do."""
    from shardtensor.ops.registry import OpTable

    aten = torch.ops.aten
    table = OpTable()
    table[aten.add.Tensor] = "add"
    table.update({aten.mul.Tensor: "mul"})
    table.setdefault(aten.sub.Tensor, "sub")
    assert [table.find(op) for op in (aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor)] == ["add", "mul", "sub"]
    del table[aten.add.Tensor]
    assert table.pop(aten.mul.Tensor) == "mul" and table.pop(aten.mul.Tensor, None) is None
    assert table.find(aten.add.Tensor) is None and table.find(aten.mul.Tensor) is None
    table[aten.sub.Tensor] = "sub2"
    assert table.find(aten.sub.Tensor) == "sub2" and table.find(aten.div.Tensor) is None
    table.clear()
    assert table.find(aten.sub.Tensor) is None and not table.ids
