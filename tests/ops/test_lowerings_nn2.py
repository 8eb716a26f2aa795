"""More NN lowerings against eager torch on CPU, forward and backward ops: negative replicate padding,
bicubic and antialiased resampling, grid_sampler, fractional max pooling, embedding_bag,
segment_reduce, margin and CTC losses, chunked linear cross entropy, rrelu, _trilinear, cdist / pdist;
then a few through sharded tensors (forward and autograd backward)."""
import itertools
import math

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _lowering_harness import assert_same, aten, check, deferred_checks, lower, run, to_jax  # noqa: F401  (the deferred_checks fixture)

F64 = torch.float64
BF16 = {"rtol": 2e-2, "atol": 2e-2}
TIGHT = {"rtol": 1e-9, "atol": 1e-9}


def r(*shape, dtype=F64, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    return torch.randn(*shape).to(dtype)


# --------------------------------------------------------------------------------- pad, resampling


def test_replicate_pad_negative():
    x = r(2, 3, 4, 5, seed=0)
    for pad in ([-4, 5, 0, 0], [0, 0, 2, -4], [5, -4, -4, 3], [-2, -1, 4, 6], [-5, 6, 1, 1]):
        out = check(aten.replication_pad2d.default, x, pad)
        check(aten.replication_pad2d_backward.default, torch.randn_like(out), x, pad, **TIGHT)
    check(aten.replication_pad1d.default, x[0], [-5, 7])


RESAMPLE = [(aten.upsample_bicubic2d, aten.upsample_bicubic2d_backward),
            (aten._upsample_bilinear2d_aa, aten._upsample_bilinear2d_aa_backward),
            (aten._upsample_bicubic2d_aa, aten._upsample_bicubic2d_aa_backward)]


@pytest.mark.parametrize("in_hw,scales", [((4, 4), (1.7, 0.6)), ((10, 20), (0.3, 2.5)), ((33, 17), (0.26, 0.5)),
                                          ((7, 3), (3.0, 1.0))])
def test_bicubic_and_antialiased_resampling(in_hw, scales):
    x = r(2, 3, *in_hw, seed=1)
    out_hw = [math.floor(n * s) for n, s in zip(in_hw, scales)]
    for (op, bwd), align, sc in itertools.product(RESAMPLE, (False, True), (scales, (None, None))):
        out = check(op.default, x, out_hw, align, *sc, **TIGHT)
        check(op.default, x.float(), out_hw, align, *sc, rtol=1e-5, atol=1e-5)
        check(bwd.default, torch.randn_like(out), out_hw, list(x.shape), align, *sc, **TIGHT)


def test_bicubic_bf16():
    check(aten.upsample_bicubic2d.default, r(1, 2, 5, 6, dtype=torch.bfloat16, seed=2), [8, 9], False, None, None, **BF16)


# ------------------------------------------------------------------------------------ grid_sampler


@pytest.mark.parametrize("nsp", [2, 3])
def test_grid_sampler(nsp):
    torch.manual_seed(3)
    x = r(*((2, 3, 5, 7) if nsp == 2 else (2, 3, 4, 5, 3)))
    grid = torch.rand((2, 4, 6) + ((3,) if nsp == 3 else ()) + (nsp,), dtype=F64) * 3 - 1.5
    op = aten.grid_sampler_2d if nsp == 2 else aten.grid_sampler_3d
    bwd = aten.grid_sampler_2d_backward if nsp == 2 else aten.grid_sampler_3d_backward
    for mode, pad, align in itertools.product(range(3 if nsp == 2 else 2), range(3), (False, True)):
        out = check(op.default, x, grid, mode, pad, align, **TIGHT)
        g = torch.randn_like(out)
        check(bwd.default, g, x, grid, mode, pad, align, [True, True], **TIGHT)
        if mode == 0:
            check(bwd.default, g, x, grid, mode, pad, align, [False, True], **TIGHT)


def test_grid_sampler_bf16_rounds_like_torch():
    """torch's CPU kernel rounds every step of a bfloat16 sample: the lowering follows its order exactly."""
    torch.manual_seed(4)
    x = torch.randn(2, 3, 5, 20).bfloat16()
    grid = (torch.rand(2, 7, 6, 2) * 2.4 - 1.2).bfloat16()
    for mode, pad, align in itertools.product(range(3), range(3), (False, True)):
        check(aten.grid_sampler_2d.default, x, grid, mode, pad, align, rtol=0, atol=0)
    x3, g3 = torch.randn(1, 2, 4, 5, 6).bfloat16(), (torch.rand(1, 3, 4, 5, 3) * 2.4 - 1.2).bfloat16()
    for mode, pad in itertools.product(range(2), range(3)):
        check(aten.grid_sampler_3d.default, x3, g3, mode, pad, False, rtol=0, atol=0)


# ------------------------------------------------------------------------------- fractional pooling


@pytest.mark.parametrize("nsp,shape,kernel,out", [(2, (2, 3, 9, 9), [3, 3], [2, 3]), (2, (1, 3, 9, 8), [2, 3], [5, 4]),
                                                   (2, (3, 7, 6), [2, 2], [4, 5]), (3, (2, 3, 5, 5, 5), [2, 2, 2], [2, 3, 2]),
                                                   (3, (2, 2, 7, 6, 5), [2, 3, 1], [4, 3, 4])])
def test_fractional_max_pool(nsp, shape, kernel, out):
    for dtype in (torch.float32, F64):
        x = r(*shape, dtype=dtype, seed=5)
        x.view(-1)[::7] = x.view(-1)[::7].round()  # ties: the first maximum wins
        x.view(-1)[5] = float("nan")
        n = shape[0] if len(shape) == nsp + 2 else 1
        samples = torch.rand(n, shape[-nsp - 1], nsp, dtype=dtype)
        op = getattr(aten, f"fractional_max_pool{nsp}d")
        val, idx = check(op.default, x, kernel, out, samples)
        check(getattr(aten, f"fractional_max_pool{nsp}d_backward").default, torch.randn_like(val), x, kernel, out, idx)


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
        check(aten._embedding_bag_dense_backward.default, g, idx, o2b, bag_size, max_idx, 10, sgf, mode, p, pad,
              **TIGHT)
        if use_psw:
            check(aten._embedding_bag_per_sample_weights_backward.default, g, w, idx, off, o2b, mode, pad, **TIGHT)


def test_embedding_bag_meta_layout():
    """Aux outputs are shaped as torch's meta kernel (the dispatcher's contract), not as CPU's."""
    w, idx, off = r(10, 3, seed=7), torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2, 4])
    for mode, include_last in itertools.product((0, 1, 2), (False, True)):
        meta = aten._embedding_bag.default(w.to("meta"), idx.to("meta"), off.to("meta"), False, mode, False, None,
                                           include_last, -1)
        got = run(lower(aten._embedding_bag.default), to_jax([w, idx, off, False, mode, False, None, include_last, -1]), {})
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


# ---------------------------------------------------------------------------------------------- losses


def test_multi_margin_loss():
    x = r(5, 4, seed=10)
    t = torch.tensor([0, 3, 1, 1, 2])
    x[1, 0] = x[1, 3] - 1  # margin term exactly 0: zero derivative, as torch
    w = torch.rand(4, dtype=F64)
    for p, margin, weight, red in itertools.product((1, 2), (1.0, 0.5), (None, w), (0, 1, 2)):
        for xx, tt in ((x, t), (x[0], t[0]), (x[0], t[:1]), (x[0, 0], t[0] * 0)):
            if xx.ndim == 0 and weight is not None:
                continue
            out = check(aten.multi_margin_loss.default, xx, tt, p, margin, weight, red, **TIGHT)
            check(aten.multi_margin_loss_backward.default, torch.randn_like(out), xx, tt, p, margin, weight, red, **TIGHT)


def test_multilabel_margin_loss():
    x = r(5, 4, seed=11)
    t = torch.tensor([[3, 0, -1, 1], [0, 1, 2, 3], [-1, 0, 1, 2], [1, 1, -1, 0], [2, -1, -1, -1]])
    for red in (0, 1, 2):
        for xx, tt in ((x, t), (x[0], t[0]), (x.float(), t), (x[0, 0], t[0, 0] * 0)):
            out, is_target = check(aten.multilabel_margin_loss_forward.default, xx, tt, red, rtol=1e-6, atol=1e-6)
            check(aten.multilabel_margin_loss_backward.default, torch.randn_like(out), xx, tt, red, is_target,
                  rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_ctc_loss(dtype):
    torch.manual_seed(12)
    T, N, C = 12, 4, 5
    lp = torch.randn(T, N, C, dtype=dtype).log_softmax(2)
    il, tl = [12, 10, 0, 7], [4, 0, 0, 6]
    tg2 = torch.randint(1, C, (N, 7))
    tg2[0, 1] = tg2[0, 2]  # a repeated label needs a blank in between
    tg1 = torch.cat([tg2[i, :tl[i]] for i in range(N)])
    tol = TIGHT if dtype == F64 else {"rtol": 1e-5, "atol": 1e-5}
    for tg, zero_inf, blank in itertools.product((tg2, tg1), (False, True), (0, 2)):
        tg = torch.where(tg == blank, 1, tg) if blank else tg  # targets never hold the blank
        nll, log_alpha = aten._ctc_loss.default(lp, tg, il, tl, blank, zero_inf)
        got = run(lower(aten._ctc_loss.default), to_jax([lp, tg, il, tl, blank, zero_inf]), {})
        assert_same(got[0], nll, **tol)
        got_alpha = torch.from_numpy(np.array(got[1]))
        for b in range(N):  # torch leaves log_alpha unset outside each sample's input and states
            if il[b]:
                torch.testing.assert_close(got_alpha[b, :il[b], :2 * tl[b] + 1], log_alpha[b, :il[b], :2 * tl[b] + 1],
                                           **tol)
        # torch's own log_alpha (unset parts included) must give torch's gradient
        check(aten._ctc_loss_backward.default, torch.rand(N, dtype=dtype), lp, tg, il, tl, nll, log_alpha, blank,
              zero_inf, **tol)


def test_ctc_loss_impossible_alignment():
    lp = torch.randn(3, 2, 4, dtype=F64).log_softmax(2)
    tg = torch.tensor([[1, 1, 2], [1, 2, 3]])  # sample 0 needs 4 steps: infinite loss
    nll, log_alpha = check(aten._ctc_loss.default, lp, tg, [3, 3], [3, 3], 0, False)
    assert math.isinf(nll[0])
    for zero_inf in (False, True):
        check(aten._ctc_loss_backward.default, torch.ones(2, dtype=F64), lp, tg, [3, 3], [3, 3], nll, log_alpha, 0,
              zero_inf, **TIGHT)


def test_linear_cross_entropy_chunked():
    import torch.nn.modules.linear_cross_entropy  # (registers the torch_nn ops)

    ops = torch.ops.torch_nn
    x, lw = r(7, 4, seed=13), r(5, 4)
    for red, ignore, use_b, use_w, flags in itertools.product(("mean", "sum"), (-100, 2), (False, True), (False, True),
                                                              ((True, True, True), (True, False, False), (False, True, True))):
        t = torch.tensor([0, 2, 4, 2, 1, -100, 3]) if ignore == -100 else torch.tensor([0, 2, 4, 2, 1, 2, 3])
        b = r(5) if use_b else None
        w = torch.rand(5, dtype=F64) if use_w else None
        flags = (flags[0], flags[1], flags[2] and use_b)
        check(ops._linear_cross_entropy_batch_chunked.default, x, lw, t, b, w, red, ignore, 0.0, 3, "balanced", F64,
              True, *flags, **TIGHT)
        check(ops._linear_cross_entropy_batch_chunked_no_reduction.default, x, lw, t, b, w, ignore, 3, "balanced", F64,
              **TIGHT)
    all_ignored = torch.full((7,), -100)
    check(ops._linear_cross_entropy_batch_chunked.default, x, lw, all_ignored, None, None, "mean", -100, 0.0, 3,
          "balanced", F64, True, True, True, False)


# ------------------------------------------------------------------------------ rrelu, _trilinear


def test_rrelu_with_noise():
    fn = lower(aten.rrelu_with_noise_functional.default)
    x = r(400, seed=14)
    noise = torch.zeros(400, dtype=F64)
    want, _ = aten.rrelu_with_noise_functional.default(x, noise, 0.1, 0.3, False)
    out, noise_out = fn(jax.random.key(0), *to_jax([x, noise]), 0.1, 0.3, False)
    assert_same(out, want, **TIGHT)
    assert_same(noise_out, noise)
    out, noise_out = (torch.from_numpy(np.array(v)) for v in fn(jax.random.key(1), *to_jax([x, noise]), 0.1, 0.3, True))
    neg = x <= 0
    assert torch.all(noise_out[~neg] == 1) and torch.equal(out[~neg], x[~neg])
    slopes = noise_out[neg]
    assert slopes.min() >= 0.1 and slopes.max() < 0.3 and slopes.std() > 0.03
    torch.testing.assert_close(out[neg], x[neg] * slopes, **TIGHT)


def test_trilinear():
    x1, x2, w = r(7, 3, seed=15), r(7, 4), r(5, 3, 4)
    check(aten._trilinear.default, x1, w, x2, [1, 3], [0], [1, 2], [2, 3], **TIGHT)  # as F.bilinear calls it
    check(aten._trilinear.default, x1[:1], w, x2, [1, 3], [0], [1, 2], [2, 3], **TIGHT)  # broadcast batch
    check(aten._trilinear.default, x1[:0], w, x2[:0], [1, 3], [0], [1, 2], [2, 3], **TIGHT)  # empty batch
    check(aten._trilinear.default, x1, w, x2, [1, 3], [0], [1, 2], [], **TIGHT)


# ---------------------------------------------------------------------------------------- distances


P_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf")]


@pytest.mark.parametrize("shapes", [((5, 4), (6, 4)), ((2, 3, 5, 4), (3, 6, 4)), ((1, 30, 3), (2, 7, 3)),
                                    ((0, 4, 5), (3, 5))])
def test_cdist(shapes):
    s1, s2 = shapes
    x1, x2 = r(*s1, seed=16), r(*s2)
    if s1[:-2] == s2[:-2] and x1.numel():
        x2[..., 0, :] = x1[..., 0, :]  # zero distance: zero gradient
        x2[..., 1, 0] = x1[..., 0, 0]  # a zero coordinate difference
    for p, mode in itertools.product(P_VALUES, (None, 1, 2)):
        out = check(aten._cdist_forward.default, x1, x2, p, mode, rtol=1e-7, atol=1e-7)
        mm = p == 2 and (mode == 1 or (mode is None and max(s1[-2], s2[-2]) > 25))
        if not mm:  # (the mm form differentiates through _euclidean_dist instead)
            check(aten._cdist_backward.default, torch.randn_like(out), x1, x2, p, out, rtol=1e-7, atol=1e-7)
    # _euclidean_dist is sqrt(|a|^2 + |b|^2 - 2 a.b): at a zero distance the float32 cancellation
    # leaves up to ~eps * (|a|^2 + |b|^2), whose square root is what any CPU's kernel may return
    a, b = x1.float(), x2.float()
    norms = a.pow(2).sum(-1).amax() + b.pow(2).sum(-1).amax() if a.numel() and b.numel() else torch.tensor(0.0)
    cancel = math.sqrt(4 * a.shape[-1] * torch.finfo(torch.float32).eps * float(norms))
    check(aten._euclidean_dist.default, a, b, rtol=1e-5, atol=max(1e-5, cancel))


def test_pdist():
    x = r(6, 4, seed=17)
    x[3] = x[1]
    x[4, 0] = x[2, 0]
    for p in P_VALUES:
        out = check(aten._pdist_forward.default, x, p, **TIGHT)
        check(aten._pdist_backward.default, torch.randn_like(out), x, p, out, **TIGHT)
    check(aten._pdist_forward.default, x[:1], 2.0)


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
    sh = [st.shard(x.detach().clone(), mesh, ("x",) + (None,) * (x.dim() - 1)).requires_grad_(d)
          for x, d in zip(inputs, diff)]
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
    _sharded(lambda a, g: F.grid_sample(a, g, mode="bilinear", padding_mode="reflection", align_corners=False), [x, grid])
    _sharded(lambda a: F.interpolate(a, size=(9, 4), mode="bicubic", align_corners=False), [x])
    _sharded(lambda a: F.interpolate(a, size=(3, 4), mode="bilinear", antialias=True), [x])


def test_sharded_losses():
    torch.manual_seed(19)
    logits, t = torch.randn(8, 5), torch.tensor([0, 4, 1, 1, 3, 2, 0, 4])
    _sharded(lambda a, b: F.multi_margin_loss(a, b, p=2, margin=0.7), [logits, t])
    _sharded(lambda a: F.ctc_loss(a.log_softmax(2), torch.randint(1, 5, (2, 3), generator=torch.Generator().manual_seed(0)),
                                  [8, 6], [3, 2]), [torch.randn(8, 2, 5)])


def test_sharded_embedding_bag_and_cdist():
    torch.manual_seed(20)
    w = torch.randn(12, 4)
    idx = torch.tensor([1, 5, 2, 7, 7, 11, 0, 3])
    offsets = torch.tensor([0, 3, 3, 6])
    for mode in ("sum", "mean", "max"):
        _sharded(lambda weight, i, o, mode=mode: F.embedding_bag(i, weight, o, mode=mode), [w, idx, offsets])
    _sharded(lambda a, b: torch.cdist(a, b, p=1.5), [torch.randn(8, 3), torch.randn(8, 3)])
    _sharded(lambda a: F.pdist(a), [torch.randn(8, 3)])
