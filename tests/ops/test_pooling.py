"""Pooling lowerings (shardtensor/ops/pooling.py: max, avg, adaptive, fractional pooling, im2col / col2im)
against eager torch on CPU, forward and backward ops; then bfloat16 adaptive average pooling through
sharded tensors."""

import functools

import pytest
import torch

from _lowering_harness import BF16, aten, check, deferred_checks, randn  # noqa: F401  (the deferred_checks fixture)

torch.manual_seed(0)

F64 = torch.float64


r = randn  # float32 normal samples


r64 = functools.partial(randn, dtype=F64)


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
    check(
        aten.max_pool3d_with_indices_backward.default,
        torch.randn_like(out),
        x3,
        [2, 3, 2],
        [2, 2, 1],
        [1, 1, 0],
        [1, 1, 2],
        True,
        idx,
    )
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
    check(
        aten.avg_pool2d.default, r(2, 3, 6, 6, dtype=torch.bfloat16), [2, 2], [2, 2], [0, 0], False, True, None, **BF16
    )
    x3 = r(2, 2, 5, 6, 5)
    out = check(aten.avg_pool3d.default, x3, [2, 3, 2], [2, 2, 1], [1, 1, 0], True, False, None, rtol=1e-5, atol=1e-5)
    check(
        aten.avg_pool3d_backward.default,
        torch.randn_like(out),
        x3,
        [2, 3, 2],
        [2, 2, 1],
        [1, 1, 0],
        True,
        False,
        None,
        rtol=1e-5,
        atol=1e-5,
    )


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


# ------------------------------------------------------------------------------- fractional pooling


@pytest.mark.parametrize(
    "nsp,shape,kernel,out",
    [
        (2, (2, 3, 9, 9), [3, 3], [2, 3]),
        (2, (1, 3, 9, 8), [2, 3], [5, 4]),
        (2, (3, 7, 6), [2, 2], [4, 5]),
        (3, (2, 3, 5, 5, 5), [2, 2, 2], [2, 3, 2]),
        (3, (2, 2, 7, 6, 5), [2, 3, 1], [4, 3, 4]),
    ],
)
def test_fractional_max_pool(nsp, shape, kernel, out):
    for dtype in (torch.float32, F64):
        x = r64(*shape, dtype=dtype, seed=5)
        x.view(-1)[::7] = x.view(-1)[::7].round()  # ties: the first maximum wins
        x.view(-1)[5] = float("nan")
        n = shape[0] if len(shape) == nsp + 2 else 1
        samples = torch.rand(n, shape[-nsp - 1], nsp, dtype=dtype)
        op = getattr(aten, f"fractional_max_pool{nsp}d")
        val, idx = check(op.default, x, kernel, out, samples)
        check(getattr(aten, f"fractional_max_pool{nsp}d_backward").default, torch.randn_like(val), x, kernel, out, idx)


# -------------------------------------------- through the dispatcher: sharded, bf16
def _mesh():
    import shardtensor as st

    return st, st.Mesh(range(8), (4, 2), ("x", "y"))


def test_bfloat16_adaptive_avg_pool3d_accumulates_like_torch():
    """torch's CPU kernel sums each window in bf16, rounding after every addition."""
    st, mesh = _mesh()
    x = torch.randn(8, 8, 8, 8, generator=torch.Generator().manual_seed(0)).bfloat16() * 8
    sx = st.shard(x, mesh, ("x", None, None, None))
    for out in [(5, 7, 4), (1, 1, 1), (8, 3, 8)]:
        want = torch.nn.functional.adaptive_avg_pool3d(x, out)
        torch.testing.assert_close(torch.nn.functional.adaptive_avg_pool3d(sx, out).cpu(), want, rtol=0, atol=0)
