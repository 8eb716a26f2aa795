"""Convolution lowerings (shardtensor/ops/conv.py) against eager torch on CPU, forward and backward ops;
then through the dispatcher: spatially sharded kernels, bfloat16 bias rounding."""

import pytest
import torch

from _lowering_harness import BF16, aten, check, deferred_checks, lower, randn, to_jax  # noqa: F401  (the deferred_checks fixture)

torch.manual_seed(0)


r = randn  # float32 normal samples


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
        lower(aten.convolution.default)(
            *to_jax([r(3, 6, 6), r(4, 3, 3, 3), r(4)]), [1, 1], [0, 0], [1, 1], False, [0, 0], 1
        )


# -------------------------------------------- through the dispatcher: sharded, bf16
def _mesh():
    import shardtensor as st

    return st, st.Mesh(range(8), (4, 2), ("x", "y"))


@pytest.mark.parametrize("transposed", [False, True])
def test_sharded_conv_with_spatially_sharded_kernel(transposed):
    """XLA's windowed partitioning of a convolution whose kernel is sharded over a spatial dim as
    well as the input (uneven, or dilated) gives wrong sums: the kernel is kept spatially whole."""
    st, mesh = _mesh()
    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    for size, k, dilation in [(5, 3, 2), (5, 3, 1), (8, 4, 2)]:
        x = torch.randn(1, 2, size, 5, 5, generator=g)
        w = torch.randn(2, 2, k, 3, 3, generator=g)
        sx, sw = st.shard(x, mesh, (None, None, "x", None, None)), st.shard(w, mesh, (None, None, "x", None, None))
        if transposed:
            want = F.conv_transpose3d(x, w, stride=2, dilation=dilation)
            got = F.conv_transpose3d(sx, sw, stride=2, dilation=dilation)
        else:
            want, got = F.conv3d(x, w, dilation=dilation), F.conv3d(sx, sw, dilation=dilation)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def _bf16_ulp(t):
    """The spacing of bfloat16 numbers at each element of ``t`` (8 significant bits)."""
    return torch.ldexp(
        torch.ones_like(t, dtype=torch.float64), torch.frexp(t.double().abs().clamp_min(2.0**-126))[1] - 8
    )


def test_bfloat16_conv_bias_rounds_once():
    """The promise: a bf16 convolution accumulates in float32 and adds the bias before its one
    rounding to bf16. The reference is the exact (float64) result rounded once, which no CPU's
    kernels change; torch's own bf16 kernel rounds differently per instruction set (oneDNN on AVX2
    rounds before the bias), so it is compared at bf16's precision scaled by the sums' magnitudes."""
    st, mesh = _mesh()
    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 6, 8, 8, 8, generator=g) * 3).bfloat16()
    w, b = torch.randn(6, 4, 3, 3, 3, generator=g).bfloat16(), (torch.randn(4, generator=g) * 10).bfloat16()
    sx, sw, sb = (st.shard(t, mesh, ("x",) + (None,) * (t.dim() - 1)) for t in (x, w, b))
    for fn, kw in [(F.conv_transpose3d, dict(stride=2, padding=1)), (F.conv3d, dict(padding=1))]:
        ww, sww = (w, sw) if fn is F.conv_transpose3d else (w.transpose(0, 1).contiguous(), sw.transpose(0, 1))
        got = fn(sx, sww, sb, **kw).cpu()
        exact = fn(x.double(), ww.double(), b.double(), **kw)
        once = exact.bfloat16()
        twice = (
            fn(x.double(), ww.double(), None, **kw).bfloat16().double() + b.double().view(-1, *[1] * (x.dim() - 2))
        ).bfloat16()
        assert got.dtype == torch.bfloat16
        off = (got.double() - once.double()).abs() / _bf16_ulp(once)
        # float32 accumulation may land across a rounding midpoint on a rare element: one ulp, rarely
        assert off.max() <= 1 and (off > 0).double().mean() < 0.005, (
            f"{fn.__name__}: {(off > 0).double().mean():.2%} of elements differ from the once-rounded "
            f"exact result (up to {off.max():.0f} ulp)"
        )
        # ... which rounding twice cannot meet: the test tells the two apart
        assert ((twice.double() - once.double()).abs() > 0).double().mean() > 0.05
        # torch's kernel: within two bf16 roundings of the sums' magnitudes, whatever the CPU
        scale = fn(x.double().abs(), ww.double().abs(), b.double().abs(), **kw)
        err = (got.double() - fn(x, ww, b, **kw).double()).abs()
        assert (err <= 2.0**-7 * scale).all(), f"{fn.__name__}: {err.max():.3g} from torch's kernel"
