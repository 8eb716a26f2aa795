"""embedding_bag and segment_reduce lowerings (shardtensor/ops/embedding.py) against eager torch on CPU,
forward and backward ops; then a few NN ops through sharded tensors (forward and autograd backward):
grid_sample / bicubic and antialiased interpolate, margin and CTC losses, embedding_bag, cdist / pdist
(kept together: they share the ``_sharded`` helper)."""

import functools
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _lowering_harness import TIGHT, assert_same, aten, check, deferred_checks, lower, randn, run, to_jax  # noqa: F401  (the deferred_checks fixture)

F64 = torch.float64


r = functools.partial(randn, dtype=F64)


# -------------------------------------------------------------------------------------- embedding_bag


def _bag_case(sgf, include_last):
    # (torch's CPU scale_grad_by_freq divides by the count of another index unless all counts agree)
    idx = torch.tensor([5, 1, 6, 5, 6, 1, 7, 7]) if sgf else torch.tensor([5, 1, 6, 5, 6, 2, 9, 7])
    off = torch.tensor([0, 3, 3, 5, 8]) if include_last else torch.tensor([0, 3, 3, 5, 6])
    return idx, off


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_embedding_bag(mode):
    w = r(10, 3, seed=6)
    w[7, 1] = float("nan")
    psw = torch.rand(8, dtype=F64)
    for pad, include_last, use_psw, sgf in itertools.product((-1, 5, 7), (False, True), (False, True), (False, True)):
        if use_psw and mode != 0:
            continue
        idx, off = _bag_case(sgf, include_last)
        p = psw if use_psw else None
        want = aten._embedding_bag.default(w, idx, off, sgf, mode, False, p, include_last, pad)
        got = run(lower(aten._embedding_bag.default), to_jax([w, idx, off, sgf, mode, False, p, include_last, pad]), {})
        assert_same(got[0], want[0])
        if mode == 2:
            assert_same(got[3], want[3])
        if mode != 0 or pad >= 0:  # (CPU's sum fast path leaves offset2bag empty)
            assert_same(got[1], want[1])
        o2b, bag_size = (torch.from_numpy(np.array(v)) for v in got[1:3])
        max_idx = torch.from_numpy(np.array(got[3])) if mode == 2 else want[3]
        g = torch.randn_like(want[0])
        check(
            aten._embedding_bag_dense_backward.default, g, idx, o2b, bag_size, max_idx, 10, sgf, mode, p, pad, **TIGHT
        )
        if use_psw:
            check(aten._embedding_bag_per_sample_weights_backward.default, g, w, idx, off, o2b, mode, pad, **TIGHT)


def test_embedding_bag_meta_layout():
    """Aux outputs are shaped as torch's meta kernel (the dispatcher's contract), not as CPU's."""
    w, idx, off = r(10, 3, seed=7), torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2, 4])
    for mode, include_last in itertools.product((0, 1, 2), (False, True)):
        meta = aten._embedding_bag.default(
            w.to("meta"), idx.to("meta"), off.to("meta"), False, mode, False, None, include_last, -1
        )
        got = run(
            lower(aten._embedding_bag.default), to_jax([w, idx, off, False, mode, False, None, include_last, -1]), {}
        )
        assert [tuple(g.shape) for g in got] == [tuple(m.shape) for m in meta]
    empty = torch.zeros(0, dtype=torch.long)
    for mode in (0, 1, 2):  # no indices at all: every bag is empty
        args = [w, empty, torch.tensor([0, 0]), False, mode, False, None, False, -1]
        assert_same(run(lower(aten._embedding_bag.default), to_jax(args), {})[0], aten._embedding_bag.default(*args)[0])


# ------------------------------------------------------------------------------------ segment_reduce


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min", "prod"])
def test_segment_reduce(reduce):
    data = r(6, 3, seed=8)
    data[1, 0] = float("nan")
    data[4, 1] = 0.0
    data[5, 2] = data[3, 2]  # a tie in the last segment
    lengths = torch.tensor([2, 0, 1, 3])
    offsets = torch.tensor([0, 2, 2, 3, 6])
    for initial in (None, 1.5):
        out = check(aten.segment_reduce.default, data, reduce, lengths=lengths, initial=initial)
        check(aten.segment_reduce.default, data, reduce, offsets=offsets, initial=initial)
        g = torch.randn_like(out)
        check(aten._segment_reduce_backward.default, g, out, data, reduce, lengths=lengths, initial=initial, **TIGHT)
        check(aten._segment_reduce_backward.default, g, out, data, reduce, offsets=offsets, initial=initial, **TIGHT)
    # along axis 1, lengths per row
    d2, l2 = r(2, 5, 3, seed=9), torch.tensor([[2, 3], [0, 5]])
    out = check(aten.segment_reduce.default, d2, reduce, lengths=l2, axis=1)
    check(aten._segment_reduce_backward.default, torch.randn_like(out), out, d2, reduce, lengths=l2, axis=1, **TIGHT)


# ------------------------------------------------------------------------------ through sharded tensors


def _sharded(fn, inputs, grad=True, tol=None):
    """fn on CPU tensors and on the same tensors sharded over their first dim (8 devices, (4, 2) mesh);
    compares the outputs and, with ``grad``, the gradients of their sum."""
    import shardtensor as st

    tol = tol or {"rtol": 1e-5, "atol": 1e-5}
    mesh = st.Mesh(range(8), (4, 2), ("x", "y"))
    diff = [x.is_floating_point() and grad for x in inputs]
    ref = [x.detach().clone().requires_grad_(d) for x, d in zip(inputs, diff)]
    want = fn(*ref)
    sh = [
        st.shard(x.detach().clone(), mesh, ("x",) + (None,) * (x.dim() - 1)).requires_grad_(d)
        for x, d in zip(inputs, diff)
    ]
    got = fn(*sh)
    torch.testing.assert_close(got.cpu(), want.detach(), **tol)
    if grad:
        want.sum().backward()
        got.sum().backward()
        for s, x, d in zip(sh, ref, diff):
            if d:
                torch.testing.assert_close(s.grad.cpu(), x.grad, **tol)


def test_sharded_grid_sample_and_bicubic():
    torch.manual_seed(18)
    x, grid = torch.randn(8, 3, 6, 5), torch.rand(8, 4, 7, 2) * 2.2 - 1.1
    _sharded(
        lambda a, g: F.grid_sample(a, g, mode="bilinear", padding_mode="reflection", align_corners=False), [x, grid]
    )
    _sharded(lambda a: F.interpolate(a, size=(9, 4), mode="bicubic", align_corners=False), [x])
    _sharded(lambda a: F.interpolate(a, size=(3, 4), mode="bilinear", antialias=True), [x])


def test_sharded_losses():
    torch.manual_seed(19)
    logits, t = torch.randn(8, 5), torch.tensor([0, 4, 1, 1, 3, 2, 0, 4])
    _sharded(lambda a, b: F.multi_margin_loss(a, b, p=2, margin=0.7), [logits, t])
    targets = torch.randint(1, 5, (2, 3), generator=torch.Generator().manual_seed(0))
    _sharded(lambda a: F.ctc_loss(a.log_softmax(2), targets, [8, 6], [3, 2]), [torch.randn(8, 2, 5)])


def test_sharded_embedding_bag_and_cdist():
    torch.manual_seed(20)
    w = torch.randn(12, 4)
    idx = torch.tensor([1, 5, 2, 7, 7, 11, 0, 3])
    offsets = torch.tensor([0, 3, 3, 6])
    for mode in ("sum", "mean", "max"):
        _sharded(lambda weight, i, o, mode=mode: F.embedding_bag(i, weight, o, mode=mode), [w, idx, offsets])
    _sharded(lambda a, b: torch.cdist(a, b, p=1.5), [torch.randn(8, 3), torch.randn(8, 3)])
    _sharded(lambda a: F.pdist(a), [torch.randn(8, 3)])
