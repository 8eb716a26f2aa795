"""Resampling and padding lowerings (shardtensor/ops/resize.py: upsample nearest / linear / bicubic /
antialiased, reflection and replication padding, negative padding included) against eager torch on
CPU, forward and backward ops."""

import functools
import itertools
import math

import pytest
import torch

from _lowering_harness import BF16, TIGHT, aten, check, deferred_checks, randn  # noqa: F401  (the deferred_checks fixture)

torch.manual_seed(0)

F64 = torch.float64


r = randn  # float32 normal samples


r64 = functools.partial(randn, dtype=F64)


# --------------------------------------------------------------------------------- upsample, pads


@pytest.mark.parametrize(
    "out_size,scales",
    [
        ([6, 8], [None, None]),
        ([7, 5], [None, None]),
        ([6, 9], [2.0, 2.5]),
        ([3, 4], [None, None]),
        ([5, 4], [1.7, None]),
    ],
)
def test_upsample_2d(out_size, scales):
    x = r(2, 3, 3, 4)
    for op, bwd in [
        (aten.upsample_nearest2d, aten.upsample_nearest2d_backward),
        (aten._upsample_nearest_exact2d, aten._upsample_nearest_exact2d_backward),
    ]:
        out = check(op.default, x, out_size, *scales)
        check(bwd.default, torch.randn_like(out), out_size, list(x.shape), *scales, rtol=1e-5, atol=1e-5)
    for align in (False, True):
        out = check(aten.upsample_bilinear2d.default, x, out_size, align, *scales, rtol=1e-5, atol=1e-5)
        check(
            aten.upsample_bilinear2d_backward.default,
            torch.randn_like(out),
            out_size,
            list(x.shape),
            align,
            *scales,
            rtol=1e-5,
            atol=1e-5,
        )


def test_upsample_1d_3d():
    x1, x3 = r(2, 3, 5), r(1, 2, 3, 4, 2)
    check(aten.upsample_nearest1d.default, x1, [11], None)
    check(aten.upsample_linear1d.default, x1, [8], False, None, rtol=1e-5, atol=1e-5)
    check(aten.upsample_linear1d.default, x1, [8], True, None, rtol=1e-5, atol=1e-5)
    out = check(aten.upsample_nearest3d.default, x3, [6, 5, 4], None, None, None)
    check(aten.upsample_nearest3d_backward.default, torch.randn_like(out), [6, 5, 4], list(x3.shape), None, None, None)
    out = check(aten.upsample_trilinear3d.default, x3, [5, 7, 3], False, None, None, None, rtol=1e-5, atol=1e-5)
    check(
        aten.upsample_trilinear3d_backward.default,
        torch.randn_like(out),
        [5, 7, 3],
        list(x3.shape),
        False,
        None,
        None,
        None,
        rtol=1e-5,
        atol=1e-5,
    )
    check(aten.upsample_bilinear2d.default, r(1, 2, 4, 4, dtype=torch.bfloat16), [7, 9], False, None, None, **BF16)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_reflection_replication_pad(n):
    x = r(*((2, 3) + (5, 4, 6)[:n]))
    pad = [2, 1, 0, 3, 1, 1][: 2 * n]
    for name in ("reflection", "replication"):
        out = check(getattr(aten, f"{name}_pad{n}d").default, x, pad)
        check(getattr(aten, f"{name}_pad{n}d_backward").default, torch.randn_like(out), x, pad, rtol=1e-5, atol=1e-5)


# ----------------------------------------------- negative pads, bicubic and antialiased resampling


def test_replicate_pad_negative():
    x = r64(2, 3, 4, 5, seed=0)
    for pad in ([-4, 5, 0, 0], [0, 0, 2, -4], [5, -4, -4, 3], [-2, -1, 4, 6], [-5, 6, 1, 1]):
        out = check(aten.replication_pad2d.default, x, pad)
        check(aten.replication_pad2d_backward.default, torch.randn_like(out), x, pad, **TIGHT)
    check(aten.replication_pad1d.default, x[0], [-5, 7])


RESAMPLE = [
    (aten.upsample_bicubic2d, aten.upsample_bicubic2d_backward),
    (aten._upsample_bilinear2d_aa, aten._upsample_bilinear2d_aa_backward),
    (aten._upsample_bicubic2d_aa, aten._upsample_bicubic2d_aa_backward),
]


@pytest.mark.parametrize(
    "in_hw,scales", [((4, 4), (1.7, 0.6)), ((10, 20), (0.3, 2.5)), ((33, 17), (0.26, 0.5)), ((7, 3), (3.0, 1.0))]
)
def test_bicubic_and_antialiased_resampling(in_hw, scales):
    x = r64(2, 3, *in_hw, seed=1)
    out_hw = [math.floor(n * s) for n, s in zip(in_hw, scales)]
    for (op, bwd), align, sc in itertools.product(RESAMPLE, (False, True), (scales, (None, None))):
        out = check(op.default, x, out_hw, align, *sc, **TIGHT)
        check(op.default, x.float(), out_hw, align, *sc, rtol=1e-5, atol=1e-5)
        check(bwd.default, torch.randn_like(out), out_hw, list(x.shape), align, *sc, **TIGHT)


def test_bicubic_bf16():
    check(
        aten.upsample_bicubic2d.default,
        r64(1, 2, 5, 6, dtype=torch.bfloat16, seed=2),
        [8, 9],
        False,
        None,
        None,
        **BF16,
    )
