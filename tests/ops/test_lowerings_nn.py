"""NN lowerings (shardtensor/ops/nn.py: conv, norm, pooling, resize, loss, attention) against eager
torch on CPU, forward and backward ops."""
import pytest
import torch
import torch.nn.functional as F

from _lowering_harness import assert_same, aten, check, deferred_checks, lower, run, to_jax  # noqa: F401  (the deferred_checks fixture)

torch.manual_seed(0)


def r(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


BF16 = {"rtol": 2e-2, "atol": 2e-2}

# ------------------------------------------------------------------------------------ convolution

CONV_CASES = [
    # x shape, w shape, stride, padding, dilation, transposed, output_padding, groups
    ((2, 3, 9), (4, 3, 3), [2], [1], [1], False, [0], 1),
    ((2, 4, 7, 6), (6, 2, 3, 2), [1, 2], [1, 0], [2, 1], False, [0, 0], 2),
    ((1, 3, 5, 5), (8, 3, 1, 1), [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
    ((2, 2, 5, 4, 4), (4, 2, 2, 3, 2), [1, 2, 1], [1, 1, 0], [1, 1, 2], False, [0, 0, 0], 1),
    ((2, 4, 5, 6), (4, 3, 3, 3), [2, 2], [1, 0], [1, 1], True, [1, 0], 1),
    ((2, 4, 5, 5), (4, 1, 3, 2), [3, 2], [2, 1], [2, 1], True, [2, 1], 2),
    ((2, 6, 7), (6, 1, 4), [2], [3], [1], True, [1], 3),
    ((2, 4, 7, 6), (4, 1, 3, 3), [1, 1], [1, 1], [1, 1], False, [0, 0], 4),  # depthwise
]


@pytest.mark.parametrize("case", CONV_CASES)
def test_convolution(case):
    xs, ws, stride, padding, dilation, transposed, opad, groups = case
    x, w = r(*xs), r(*ws) * 0.3
    cout = ws[1] * groups if transposed else ws[0]
    b = r(cout)
    args = (stride, padding, dilation, transposed, opad, groups)
    out = check(aten.convolution.default, x, w, b, *args, rtol=1e-4, atol=1e-4)
    check(aten.convolution.default, x, w, None, *args, rtol=1e-4, atol=1e-4)
    g = torch.randn_like(out)
    masks = [[True, True, True]] + ([[True, False, False], [False, True, True]] if case in CONV_CASES[:2] else [])
    for mask in masks:
        check(aten.convolution_backward.default, g, x, w, [cout], *args, mask, rtol=1e-4, atol=1e-4)


def test_convolution_bf16_and_rank_check():
    x, w, b = r(2, 3, 6, 6, dtype=torch.bfloat16), r(4, 3, 3, 3, dtype=torch.bfloat16), r(4, dtype=torch.bfloat16)
    check(aten.convolution.default, x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, **BF16)
    with pytest.raises(RuntimeError):  # aten.convolution takes batched input only (F.conv2d unsqueezes)
        lower(aten.convolution.default)(*to_jax([r(3, 6, 6), r(4, 3, 3, 3), r(4)]), [1, 1], [0, 0], [1, 1], False, [0, 0], 1)


# ----------------------------------------------------------------------------------- normalization


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(dtype, affine):
    x = r(3, 5, 6, dtype=dtype) * 3 + 1
    w, b = (r(5, 6, dtype=dtype), r(5, 6, dtype=dtype)) if affine else (None, None)
    tol = BF16 if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    out, mean, rstd = check(aten.native_layer_norm.default, x, [5, 6], w, b, 1e-5, **tol)
    check(aten.native_layer_norm.default, x, [6], None if w is None else w[0], None, 1e-3, **tol)
    g = torch.randn_like(out)
    if affine:
        check(aten.native_layer_norm_backward.default, g, x, [5, 6], mean, rstd, w, b, [True, True, True], **tol)
    check(aten.native_layer_norm_backward.default, g, x, [5, 6], mean, rstd, w, b, [True, False, False], **tol)


def test_layer_norm_mixed_dtype():
    x, w, b = r(4, 8, dtype=torch.bfloat16), r(8), r(8)
    check(aten.native_layer_norm.default, x, [8], w, b, 1e-5, **BF16)


def _bn_inputs(dtype=torch.float32, shape=(4, 3, 5, 6)):
    x = r(*shape, dtype=dtype) * 2 + 0.5
    c = shape[1]
    return x, r(c, dtype=dtype), r(c, dtype=dtype), r(c, dtype=dtype) * 0.1, torch.rand(c).to(dtype) + 0.5


@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (5, 3), (2, 3, 7), (2, 3, 2, 3, 2)])
def test_native_batch_norm_train_and_eval(shape):
    x, w, b, rm, rv = _bn_inputs(shape=shape)
    tol = {"rtol": 1e-4, "atol": 1e-4}
    for training in (True, False):
        rm_t, rv_t = rm.clone(), rv.clone()
        out = check(aten.native_batch_norm.default, x, w, b, rm_t, rv_t, training, 0.1, 1e-5, **tol)
        if training:  # torch updated rm_t/rv_t in place; our update helper must agree
            from shardtensor.ops.norm import batch_norm_update_stats

            new_m, new_v = run(batch_norm_update_stats, to_jax([x, rm, rv, 0.1]), {})
            assert_same((new_m, new_v), (rm_t, rv_t), **tol)
        g = torch.randn_like(x)
        for mask in ([True, True, True], [True, False, False], [False, True, True]):
            check(aten.native_batch_norm_backward.default, g, x, w, rm, rv, out[1], out[2], training, 1e-5, mask, **tol)
    check(aten.native_batch_norm.default, x, None, None, None, None, True, 0.1, 1e-5, **tol)


def test_batch_norm_functional_forms():
    x, w, b, rm, rv = _bn_inputs()
    tol = {"rtol": 1e-4, "atol": 1e-4}
    for training in (True, False):
        check(aten._native_batch_norm_legit_functional.default, x, w, b, rm, rv, training, 0.1, 1e-5, **tol)
    check(aten._native_batch_norm_legit.no_stats, x, w, b, True, 0.1, 1e-5, **tol)
    check(aten._native_batch_norm_legit_no_training.default, x, w, b, rm, rv, 0.1, 1e-5, **tol)
    check(aten._batch_norm_with_update_functional.default, x, w, b, rm, rv, 0.1, 1e-5, **tol)
    out = check(aten._batch_norm_no_update.default, x, w, b, rm, rv, 0.1, 1e-5, **tol)
    fwd = aten._batch_norm_with_update_functional.default(x, w, b, rm, rv, 0.1, 1e-5)
    g = torch.randn_like(x)
    check(aten.batch_norm_backward.default, g, x, w, rm, rv, fwd[1], fwd[2], True, 1e-5, [True, True, True], fwd[3], **tol)
    check(aten.batch_norm_backward.default, g, x, w, rm, rv, out[1], out[2], False, 1e-5, [True, True, True], out[3], **tol)


def test_batch_norm_bf16():
    x, w, b, rm, rv = _bn_inputs(torch.bfloat16)
    check(aten.native_batch_norm.default, x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5, **BF16)
    check(aten.native_batch_norm.default, x, w.float(), b.float(), rm.float(), rv.float(), True, 0.1, 1e-5, **BF16)
    check(aten.native_batch_norm.default, x, w, b, rm, rv, False, 0.1, 1e-5, **BF16)


def test_group_norm():
    x = r(2, 6, 4, 3) * 2 + 1
    w, b = r(6), r(6)
    tol = {"rtol": 1e-4, "atol": 1e-4}
    out, mean, rstd = check(aten.native_group_norm.default, x, w, b, 2, 6, 12, 3, 1e-5, **tol)
    g = torch.randn_like(x)
    check(aten.native_group_norm_backward.default, g, x, mean, rstd, w, 2, 6, 12, 3, [True, True, True], **tol)
    out, mean, rstd = check(aten.native_group_norm.default, x, None, None, 2, 6, 12, 2, 1e-5, **tol)
    check(aten.native_group_norm_backward.default, g, x, mean, rstd, None, 2, 6, 12, 2, [True, False, False], **tol)


# ------------------------------------------------------------------------------------------ pooling

POOL2 = [  # kernel, stride, padding, dilation, ceil_mode
    ([2, 2], [2, 2], [0, 0], [1, 1], False),
    ([3, 3], [2, 2], [1, 1], [1, 1], False),
    ([3, 2], [2, 1], [1, 0], [2, 1], True),
    ([3], [], [1], [1], True),
    ([2, 3], [3, 2], [1, 1], [1, 1], True),
]


@pytest.mark.parametrize("case", POOL2)
def test_max_pool2d(case):
    k, s, p, d, ceil = case
    x = r(2, 3, 9, 8)
    x[0, 0, :3, :3] = float("nan")
    x[1, 1] = x[1, 1].round()  # ties: the first max wins
    out, idx = check(aten.max_pool2d_with_indices.default, x, k, s, p, d, ceil)
    g = torch.randn_like(out)
    check(aten.max_pool2d_with_indices_backward.default, g, x, k, s, p, d, ceil, idx)


def test_max_pool_int_3d_and_unbatched():
    xi = torch.randint(-5, 5, (2, 3, 6, 7))
    check(aten.max_pool2d_with_indices.default, xi, [3, 3], [2, 2], [1, 1], [1, 1], False)
    check(aten.max_pool2d_with_indices.default, r(3, 7, 7), [2, 2], [2, 2], [0, 0], [1, 1], True)
    x3 = r(2, 2, 5, 6, 7)
    out, idx = check(aten.max_pool3d_with_indices.default, x3, [2, 3, 2], [2, 2, 1], [1, 1, 0], [1, 1, 2], True)
    check(aten.max_pool3d_with_indices_backward.default, torch.randn_like(out), x3, [2, 3, 2], [2, 2, 1], [1, 1, 0],
          [1, 1, 2], True, idx)
    xinf = torch.full((1, 1, 4, 4), float("-inf"))
    check(aten.max_pool2d_with_indices.default, xinf, [3, 3], [2, 2], [1, 1], [1, 1], False)


AVG2 = [  # kernel, stride, padding, ceil_mode, count_include_pad, divisor_override
    ([2, 2], [2, 2], [0, 0], False, True, None),
    ([3, 3], [2, 2], [1, 1], False, True, None),
    ([3, 3], [2, 2], [1, 1], True, False, None),
    ([3, 2], [2, 3], [1, 1], True, True, None),
    ([2, 2], [1, 1], [1, 0], False, True, 3),
]


@pytest.mark.parametrize("case", AVG2)
def test_avg_pool2d(case):
    k, s, p, ceil, cip, div = case
    x = r(2, 3, 7, 8)
    out = check(aten.avg_pool2d.default, x, k, s, p, ceil, cip, div, rtol=1e-5, atol=1e-5)
    check(aten.avg_pool2d_backward.default, torch.randn_like(out), x, k, s, p, ceil, cip, div, rtol=1e-5, atol=1e-5)


def test_avg_pool_int_bf16_3d():
    check(aten.avg_pool2d.default, torch.arange(-20, 20).reshape(1, 2, 4, 5), [3, 3], [1, 1], [1, 1], False, True, None)
    check(aten.avg_pool2d.default, r(2, 3, 6, 6, dtype=torch.bfloat16), [2, 2], [2, 2], [0, 0], False, True, None, **BF16)
    x3 = r(2, 2, 5, 6, 5)
    out = check(aten.avg_pool3d.default, x3, [2, 3, 2], [2, 2, 1], [1, 1, 0], True, False, None, rtol=1e-5, atol=1e-5)
    check(aten.avg_pool3d_backward.default, torch.randn_like(out), x3, [2, 3, 2], [2, 2, 1], [1, 1, 0], True, False, None,
          rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_hw,out_hw", [((7, 7), (3, 2)), ((8, 6), (4, 3)), ((5, 5), (1, 1)), ((3, 4), (5, 6))])
def test_adaptive_pool2d(in_hw, out_hw):
    x = r(2, 3, *in_hw)
    out = check(aten._adaptive_avg_pool2d.default, x, list(out_hw), rtol=1e-5, atol=1e-5)
    check(aten._adaptive_avg_pool2d_backward.default, torch.randn_like(out), x, rtol=1e-5, atol=1e-5)
    out, idx = check(aten.adaptive_max_pool2d.default, x, list(out_hw))
    check(aten.adaptive_max_pool2d_backward.default, torch.randn_like(out), x, idx)


def test_adaptive_pool3d():
    x = r(1, 2, 5, 4, 6)
    out = check(aten._adaptive_avg_pool3d.default, x, [2, 3, 4], rtol=1e-5, atol=1e-5)
    check(aten._adaptive_avg_pool3d_backward.default, torch.randn_like(out), x, rtol=1e-5, atol=1e-5)
    out, idx = check(aten.adaptive_max_pool3d.default, x, [3, 2, 4])
    check(aten.adaptive_max_pool3d_backward.default, torch.randn_like(out), x, idx)


def test_im2col_col2im():
    x = r(2, 3, 7, 6)
    cols = check(aten.im2col.default, x, [3, 2], [1, 2], [1, 0], [2, 1])
    check(aten.col2im.default, cols, [7, 6], [3, 2], [1, 2], [1, 0], [2, 1], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------- upsample, pads


@pytest.mark.parametrize("out_size,scales", [([6, 8], [None, None]), ([7, 5], [None, None]), ([6, 9], [2.0, 2.5]),
                                             ([3, 4], [None, None]), ([5, 4], [1.7, None])])
def test_upsample_2d(out_size, scales):
    x = r(2, 3, 3, 4)
    for op, bwd in [(aten.upsample_nearest2d, aten.upsample_nearest2d_backward),
                    (aten._upsample_nearest_exact2d, aten._upsample_nearest_exact2d_backward)]:
        out = check(op.default, x, out_size, *scales)
        check(bwd.default, torch.randn_like(out), out_size, list(x.shape), *scales, rtol=1e-5, atol=1e-5)
    for align in (False, True):
        out = check(aten.upsample_bilinear2d.default, x, out_size, align, *scales, rtol=1e-5, atol=1e-5)
        check(aten.upsample_bilinear2d_backward.default, torch.randn_like(out), out_size, list(x.shape), align, *scales,
              rtol=1e-5, atol=1e-5)


def test_upsample_1d_3d():
    x1, x3 = r(2, 3, 5), r(1, 2, 3, 4, 2)
    check(aten.upsample_nearest1d.default, x1, [11], None)
    check(aten.upsample_linear1d.default, x1, [8], False, None, rtol=1e-5, atol=1e-5)
    check(aten.upsample_linear1d.default, x1, [8], True, None, rtol=1e-5, atol=1e-5)
    out = check(aten.upsample_nearest3d.default, x3, [6, 5, 4], None, None, None)
    check(aten.upsample_nearest3d_backward.default, torch.randn_like(out), [6, 5, 4], list(x3.shape), None, None, None)
    out = check(aten.upsample_trilinear3d.default, x3, [5, 7, 3], False, None, None, None, rtol=1e-5, atol=1e-5)
    check(aten.upsample_trilinear3d_backward.default, torch.randn_like(out), [5, 7, 3], list(x3.shape), False, None, None,
          None, rtol=1e-5, atol=1e-5)
    check(aten.upsample_bilinear2d.default, r(1, 2, 4, 4, dtype=torch.bfloat16), [7, 9], False, None, None, **BF16)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_reflection_replication_pad(n):
    x = r(*((2, 3) + (5, 4, 6)[:n]))
    pad = [2, 1, 0, 3, 1, 1][: 2 * n]
    for name in ("reflection", "replication"):
        out = check(getattr(aten, f"{name}_pad{n}d").default, x, pad)
        check(getattr(aten, f"{name}_pad{n}d_backward").default, torch.randn_like(out), x, pad, rtol=1e-5, atol=1e-5)


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
    check(aten.nll_loss_backward.default, torch.randn_like(out), logp, t.clamp(min=0), w, reduction, 2, total,
          rtol=1e-5, atol=1e-6)
    out, total = check(aten.nll_loss_forward.default, logp[0], torch.tensor(3), w, reduction, -100)
    check(aten.nll_loss_backward.default, torch.randn_like(out), logp[0], torch.tensor(3), w, reduction, -100, total)


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_nll_loss2d_and_all_ignored(reduction):
    logp = torch.log_softmax(r(2, 4, 3, 5), 1)
    t = torch.randint(0, 4, (2, 3, 5))
    t[0, 0] = -100
    w = torch.rand(4)
    out, total = check(aten.nll_loss2d_forward.default, logp, t, w, reduction, -100, rtol=1e-5, atol=1e-6)
    check(aten.nll_loss2d_backward.default, torch.randn_like(out), logp, t, w, reduction, -100, total, rtol=1e-5, atol=1e-6)
    out, total = check(aten.nll_loss_forward.default, logp[:, :, 0, 0], torch.full((2,), -100), None, reduction, -100)
    check(aten.nll_loss_backward.default, torch.ones_like(out), logp[:, :, 0, 0], torch.full((2,), -100), None, reduction,
          -100, total)


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
    for op, bwd, extra in [(aten.mse_loss, aten.mse_loss_backward, ()),
                           (aten.smooth_l1_loss, aten.smooth_l1_loss_backward, (0.5,)),
                           (aten.smooth_l1_loss, aten.smooth_l1_loss_backward, (0.0,)),
                           (aten.huber_loss, aten.huber_loss_backward, (0.5,)),
                           (aten.soft_margin_loss, aten.soft_margin_loss_backward, ())]:
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
        check(aten.binary_cross_entropy_backward.default, torch.randn_like(out), p.clamp(0.01, 0.99), t, weight, reduction,
              rtol=1e-5, atol=1e-5)
    logits = r(4, 5) * 5
    check(aten.binary_cross_entropy_with_logits.default, logits, t, None, None, reduction, rtol=1e-5, atol=1e-5)
    check(aten.binary_cross_entropy_with_logits.default, logits, t, w, torch.rand(5) * 3, reduction, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------- attention


def _sdpa_case(dtype, hq=2, hk=2, L=5, S=5, E=8, Ev=8):
    q = r(2, hq, L, E, dtype=dtype)
    k = r(2, hk, S, E, dtype=dtype)
    v = r(2, hk, S, Ev, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["plain", "causal", "mask", "gqa_causal_rect", "scale_masked_row"])
def test_sdpa_flash_cpu(dtype, kind):
    tol = BF16 if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
    mask, causal, scale = None, False, None
    if kind == "gqa_causal_rect":
        q, k, v = _sdpa_case(dtype, hq=4, hk=2, L=3, S=6)
        causal = True
    else:
        q, k, v = _sdpa_case(dtype)
    if kind == "causal":
        causal = True
    if kind in ("mask", "scale_masked_row"):
        mask = torch.randn(5, 5).to(dtype)
        if kind == "scale_masked_row":
            mask[2] = float("-inf")
            scale = 0.3
    out, lse = check(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, 0.0, causal,
                     attn_mask=mask, scale=scale, **tol)
    g = torch.randn_like(out)
    check(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, g, q, k, v, out, lse, 0.0, causal,
          attn_mask=mask, scale=scale, **tol)


def test_sdpa_matches_autograd_through_functional():
    q, k, v = (t.requires_grad_() for t in _sdpa_case(torch.float32))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    g = torch.randn_like(out)
    out.backward(g)
    fwd = lower(aten._scaled_dot_product_flash_attention_for_cpu.default)
    bwd = lower(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)

    def both(q, k, v, g):
        o, lse = fwd(q, k, v, 0.0, True)
        return o, bwd(g, q, k, v, o, lse, 0.0, True)

    o, grads = run(both, to_jax([q, k, v, g]), {})
    assert_same(o, out, rtol=1e-4, atol=1e-5)
    assert_same(grads, (q.grad, k.grad, v.grad), rtol=1e-4, atol=1e-5)
