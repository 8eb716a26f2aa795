"""Loss lowerings (shardtensor/ops/loss.py: nll, regression, binary cross entropy, margin, CTC and chunked
linear cross entropy losses) against eager torch on CPU, forward and backward ops."""

import functools
import itertools
import math

import numpy as np
import pytest
import torch

from _lowering_harness import BF16, TIGHT, assert_same, aten, check, deferred_checks, lower, randn, run, to_jax  # noqa: F401  (the deferred_checks fixture)

torch.manual_seed(0)

F64 = torch.float64


r = randn  # float32 normal samples


r64 = functools.partial(randn, dtype=F64)


# ------------------------------------------------------------------------------------------- losses


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("weighted", [False, True])
def test_nll_loss(reduction, weighted):
    logp = torch.log_softmax(r(6, 5), 1)
    t = torch.tensor([0, 4, -100, 2, 2, 1])
    w = torch.rand(5) if weighted else None
    out, total = check(aten.nll_loss_forward.default, logp, t, w, reduction, -100, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    check(aten.nll_loss_backward.default, g, logp, t, w, reduction, -100, total, rtol=1e-5, atol=1e-6)
    # ignore_index that is a real class; 1-d input
    out, total = check(aten.nll_loss_forward.default, logp, t.clamp(min=0), w, reduction, 2, rtol=1e-5, atol=1e-6)
    check(
        aten.nll_loss_backward.default,
        torch.randn_like(out),
        logp,
        t.clamp(min=0),
        w,
        reduction,
        2,
        total,
        rtol=1e-5,
        atol=1e-6,
    )
    out, total = check(aten.nll_loss_forward.default, logp[0], torch.tensor(3), w, reduction, -100)
    check(aten.nll_loss_backward.default, torch.randn_like(out), logp[0], torch.tensor(3), w, reduction, -100, total)


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_nll_loss2d_and_all_ignored(reduction):
    logp = torch.log_softmax(r(2, 4, 3, 5), 1)
    t = torch.randint(0, 4, (2, 3, 5))
    t[0, 0] = -100
    w = torch.rand(4)
    out, total = check(aten.nll_loss2d_forward.default, logp, t, w, reduction, -100, rtol=1e-5, atol=1e-6)
    check(
        aten.nll_loss2d_backward.default,
        torch.randn_like(out),
        logp,
        t,
        w,
        reduction,
        -100,
        total,
        rtol=1e-5,
        atol=1e-6,
    )
    out, total = check(aten.nll_loss_forward.default, logp[:, :, 0, 0], torch.full((2,), -100), None, reduction, -100)
    check(
        aten.nll_loss_backward.default,
        torch.ones_like(out),
        logp[:, :, 0, 0],
        torch.full((2,), -100),
        None,
        reduction,
        -100,
        total,
    )


def test_cross_entropy_grads_match_autograd():
    """log_softmax -> nll_loss_forward/backward as in nn.CrossEntropyLoss, bf16 too."""
    for dtype, tol in [(torch.float32, {}), (torch.bfloat16, BF16)]:
        logits = r(7, 11, dtype=dtype)
        t = torch.randint(0, 11, (7,))
        logp = torch.log_softmax(logits, 1)
        out, total = check(aten.nll_loss_forward.default, logp, t, None, 1, -100, **tol)
        check(aten.nll_loss_backward.default, torch.tensor(1.0, dtype=dtype), logp, t, None, 1, -100, total, **tol)


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_regression_losses(reduction):
    x, y = r(4, 5), r(4, 5)
    y[0, :2] = x[0, :2] + 0.5  # exactly at beta/delta
    for op, bwd, extra in [
        (aten.mse_loss, aten.mse_loss_backward, ()),
        (aten.smooth_l1_loss, aten.smooth_l1_loss_backward, (0.5,)),
        (aten.smooth_l1_loss, aten.smooth_l1_loss_backward, (0.0,)),
        (aten.huber_loss, aten.huber_loss_backward, (0.5,)),
        (aten.soft_margin_loss, aten.soft_margin_loss_backward, ()),
    ]:
        tgt = y.sign() if op is aten.soft_margin_loss else y
        out = check(op.default, x, tgt, reduction, *extra, rtol=1e-5, atol=1e-6)
        check(bwd.default, torch.randn_like(out), x, tgt, reduction, *extra, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_bce(reduction):
    p = torch.rand(4, 5)
    p[0, 0], p[0, 1] = 0.0, 1.0  # log clamps at -100
    t = torch.rand(4, 5)
    w = torch.rand(4, 5)
    for weight in (None, w):
        out = check(aten.binary_cross_entropy.default, p, t, weight, reduction, rtol=1e-5, atol=1e-5)
        check(
            aten.binary_cross_entropy_backward.default,
            torch.randn_like(out),
            p.clamp(0.01, 0.99),
            t,
            weight,
            reduction,
            rtol=1e-5,
            atol=1e-5,
        )
    logits = r(4, 5) * 5
    check(aten.binary_cross_entropy_with_logits.default, logits, t, None, None, reduction, rtol=1e-5, atol=1e-5)
    check(
        aten.binary_cross_entropy_with_logits.default, logits, t, w, torch.rand(5) * 3, reduction, rtol=1e-5, atol=1e-5
    )


# ------------------------------------------------- margin, CTC and chunked linear cross entropy losses


def test_multi_margin_loss():
    x = r64(5, 4, seed=10)
    t = torch.tensor([0, 3, 1, 1, 2])
    x[1, 0] = x[1, 3] - 1  # margin term exactly 0: zero derivative, as torch
    w = torch.rand(4, dtype=F64)
    for p, margin, weight, red in itertools.product((1, 2), (1.0, 0.5), (None, w), (0, 1, 2)):
        for xx, tt in ((x, t), (x[0], t[0]), (x[0], t[:1]), (x[0, 0], t[0] * 0)):
            if xx.ndim == 0 and weight is not None:
                continue
            out = check(aten.multi_margin_loss.default, xx, tt, p, margin, weight, red, **TIGHT)
            check(
                aten.multi_margin_loss_backward.default, torch.randn_like(out), xx, tt, p, margin, weight, red, **TIGHT
            )


def test_multilabel_margin_loss():
    x = r64(5, 4, seed=11)
    t = torch.tensor([[3, 0, -1, 1], [0, 1, 2, 3], [-1, 0, 1, 2], [1, 1, -1, 0], [2, -1, -1, -1]])
    for red in (0, 1, 2):
        for xx, tt in ((x, t), (x[0], t[0]), (x.float(), t), (x[0, 0], t[0, 0] * 0)):
            out, is_target = check(aten.multilabel_margin_loss_forward.default, xx, tt, red, rtol=1e-6, atol=1e-6)
            check(
                aten.multilabel_margin_loss_backward.default,
                torch.randn_like(out),
                xx,
                tt,
                red,
                is_target,
                rtol=1e-6,
                atol=1e-6,
            )


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_ctc_loss(dtype):
    torch.manual_seed(12)
    T, N, C = 12, 4, 5
    lp = torch.randn(T, N, C, dtype=dtype).log_softmax(2)
    il, tl = [12, 10, 0, 7], [4, 0, 0, 6]
    tg2 = torch.randint(1, C, (N, 7))
    tg2[0, 1] = tg2[0, 2]  # a repeated label needs a blank in between
    tg1 = torch.cat([tg2[i, : tl[i]] for i in range(N)])
    tol = TIGHT if dtype == F64 else {"rtol": 1e-5, "atol": 1e-5}
    for tg, zero_inf, blank in itertools.product((tg2, tg1), (False, True), (0, 2)):
        tg = torch.where(tg == blank, 1, tg) if blank else tg  # targets never hold the blank
        nll, log_alpha = aten._ctc_loss.default(lp, tg, il, tl, blank, zero_inf)
        got = run(lower(aten._ctc_loss.default), to_jax([lp, tg, il, tl, blank, zero_inf]), {})
        assert_same(got[0], nll, **tol)
        got_alpha = torch.from_numpy(np.array(got[1]))
        for b in range(N):  # torch leaves log_alpha unset outside each sample's input and states
            if il[b]:
                torch.testing.assert_close(
                    got_alpha[b, : il[b], : 2 * tl[b] + 1], log_alpha[b, : il[b], : 2 * tl[b] + 1], **tol
                )
        # torch's own log_alpha (unset parts included) must give torch's gradient
        check(
            aten._ctc_loss_backward.default,
            torch.rand(N, dtype=dtype),
            lp,
            tg,
            il,
            tl,
            nll,
            log_alpha,
            blank,
            zero_inf,
            **tol,
        )


def test_ctc_loss_impossible_alignment():
    lp = torch.randn(3, 2, 4, dtype=F64).log_softmax(2)
    tg = torch.tensor([[1, 1, 2], [1, 2, 3]])  # sample 0 needs 4 steps: infinite loss
    nll, log_alpha = check(aten._ctc_loss.default, lp, tg, [3, 3], [3, 3], 0, False)
    assert math.isinf(nll[0])
    for zero_inf in (False, True):
        check(
            aten._ctc_loss_backward.default,
            torch.ones(2, dtype=F64),
            lp,
            tg,
            [3, 3],
            [3, 3],
            nll,
            log_alpha,
            0,
            zero_inf,
            **TIGHT,
        )


def test_linear_cross_entropy_chunked():
    import torch.nn.modules.linear_cross_entropy  # (registers the torch_nn ops)

    ops = torch.ops.torch_nn
    x, lw = r64(7, 4, seed=13), r64(5, 4)
    masks = ((True, True, True), (True, False, False), (False, True, True))
    for red, ignore, use_b, use_w, flags in itertools.product(
        ("mean", "sum"), (-100, 2), (False, True), (False, True), masks
    ):
        t = torch.tensor([0, 2, 4, 2, 1, -100, 3]) if ignore == -100 else torch.tensor([0, 2, 4, 2, 1, 2, 3])
        b = r64(5) if use_b else None
        w = torch.rand(5, dtype=F64) if use_w else None
        flags = (flags[0], flags[1], flags[2] and use_b)
        check(
            ops._linear_cross_entropy_batch_chunked.default,
            x,
            lw,
            t,
            b,
            w,
            red,
            ignore,
            0.0,
            3,
            "balanced",
            F64,
            True,
            *flags,
            **TIGHT,
        )
        check(
            ops._linear_cross_entropy_batch_chunked_no_reduction.default,
            x,
            lw,
            t,
            b,
            w,
            ignore,
            3,
            "balanced",
            F64,
            **TIGHT,
        )
    all_ignored = torch.full((7,), -100)
    check(
        ops._linear_cross_entropy_batch_chunked.default,
        x,
        lw,
        all_ignored,
        None,
        None,
        "mean",
        -100,
        0.0,
        3,
        "balanced",
        F64,
        True,
        True,
        True,
        False,
    )
