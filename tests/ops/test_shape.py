"""Shape and view lowerings (shardtensor/ops/shape.py) against eager torch on CPU."""

import pytest
import torch

from _lowering_harness import assert_same, aten, check, deferred_checks, lower, run, to_jax  # noqa: F401  (the deferred_checks fixture)

torch.manual_seed(0)


def r(*shape, dtype=torch.float32):
    if dtype.is_floating_point:
        return torch.randn(*shape).to(dtype)
    if dtype == torch.bool:
        return torch.rand(*shape) > 0.5
    return torch.randint(-50, 50, shape, dtype=dtype)


X = r(3, 5, 4)


@pytest.mark.parametrize("size", [[15, 4], [-1, 2], [3, -1, 2, 2], [60], [1, 60, 1]])
def test_view(size):
    check(aten.view.default, X, size)
    check(aten._unsafe_view.default, X, size)
    check(aten.view_copy.default, X, size)


def test_view_scalar_and_empty():
    check(aten.view.default, torch.tensor(3.0), [1, 1])
    check(aten.view.default, torch.tensor([5]), [])
    check(aten.view.default, r(0, 3), [3, 0, 2])
    check(aten.view.default, r(0, 3), [-1, 6])


@pytest.mark.parametrize(
    "src,dst",
    [
        (torch.float32, torch.int32),
        (torch.float32, torch.int16),
        (torch.int16, torch.float32),
        (torch.bfloat16, torch.int16),
        (torch.int64, torch.float64),
        (torch.uint8, torch.bool),
    ],
)
def test_view_dtype(src, dst):
    x = r(3, 4, dtype=src) if src != torch.uint8 else torch.randint(0, 2, (3, 4), dtype=torch.uint8)
    check(aten.view.dtype, x, dst)


def test_simple_views():
    check(aten.t.default, r(3, 4))
    check(aten.t.default, r(3))
    check(aten.t.default, torch.tensor(2.0))
    check(aten.alias.default, X)
    check(aten.detach.default, X)
    for d0, d1 in [(0, 1), (-1, 0), (2, -2), (1, 1)]:
        check(aten.transpose.int, X, d0, d1)
    check(aten.transpose.int, torch.tensor(1.0), 0, -1)
    for p in [[2, 0, 1], [-1, -3, 1], [0, 1, 2]]:
        check(aten.permute.default, X, p)
    check(aten.permute.default, torch.tensor(1.0), [])


@pytest.mark.parametrize("size", [[3, 5, 4], [2, 3, 5, 4], [-1, 5, -1], [7, -1, -1, -1]])
def test_expand(size):
    check(aten.expand.default, X, size)
    check(aten.expand.default, r(3, 1, 4), [2, 3, 6, 4])
    check(aten.expand.default, torch.tensor(1.5), [2, 3])


def test_squeeze_unsqueeze():
    x = r(1, 3, 1, 4)
    for d in [0, -1, 4, -5, 2]:
        check(aten.unsqueeze.default, x, d)
    check(aten.squeeze.default, x)
    for d in [0, 1, -2, -1]:
        check(aten.squeeze.dim, x, d)
    check(aten.squeeze.dims, x, [0, 1, -2])
    check(aten.squeeze.dims, x, [])
    check(aten.squeeze.dim, torch.tensor(2.0), 0)
    check(aten.squeeze.dims, torch.tensor(2.0), [-1])
    check(aten.unsqueeze.default, torch.tensor(2.0), -1)


@pytest.mark.parametrize(
    "dim,start,end,step",
    [
        (0, 0, 2, 1),
        (1, -3, None, 2),
        (1, None, -1, 1),
        (2, -100, 100, 3),
        (1, 4, 2, 1),
        (-1, 1, 9223372036854775807, 1),
        (0, 5, 10, 2),
        (1, -1, None, 1),
    ],
)
def test_slice(dim, start, end, step):
    check(aten.slice.Tensor, X, dim, start, end, step)
    src = aten.slice.Tensor(X, dim, start, end, step)
    check(aten.slice_scatter.default, X, torch.randn_like(src), dim, start, end, step)
    check(
        aten.slice_backward.default,
        torch.randn_like(src),
        list(X.shape),
        dim,
        0 if start is None else start,
        9223372036854775807 if end is None else end,
        step,
    )


def test_select_narrow():
    for dim, idx in [(0, 0), (1, -1), (-1, 3), (2, -4)]:
        check(aten.select.int, X, dim, idx)
        src = torch.randn_like(X.select(dim, idx))
        check(aten.select_scatter.default, X, src, dim, idx)
        check(aten.select_backward.default, src, list(X.shape), dim, idx)
    check(aten.narrow_copy.default, X, 1, -3, 2)
    check(aten.narrow_copy.default, X, -1, 0, 4)
    with pytest.raises(IndexError):
        lower(aten.select.int)(to_jax(X), 0, 3)


def test_split_unbind():
    check(aten.split.Tensor, X, 2, 1)
    check(aten.split.Tensor, X, 7, -2)
    check(aten.split.Tensor, X, 1, 0)
    check(aten.split_with_sizes.default, X, [1, 0, 4], 1)
    check(aten.unsafe_split.Tensor, X, 3, -1)
    check(aten.unsafe_split_with_sizes.default, X, [2, 2], 2)
    check(aten.unbind.int, X, 0)
    check(aten.unbind.int, X, -1)
    check(aten.split.Tensor, r(0, 2), 0, 0)


@pytest.mark.parametrize("offset,d1,d2", [(0, 0, 1), (1, 0, 1), (-2, 0, 2), (2, -1, 0), (7, 0, 1), (-1, 2, 1)])
def test_diagonal(offset, d1, d2):
    check(aten.diagonal.default, X, offset, d1, d2)
    src = torch.randn_like(X.diagonal(offset, d1, d2))
    check(aten.diagonal_scatter.default, X, src, offset, d1, d2)
    check(aten.diagonal_backward.default, src, list(X.shape), offset, d1, d2)


@pytest.mark.parametrize(
    "size,stride,offset",
    [
        ([2, 2], [1, 2], 0),
        ([3, 4], [4, 1], 5),
        ([4, 3], [1, 4], None),
        ([2, 3, 2], [20, 4, 1], 1),
        ([5, 2], [1, 1], 0),
        ([0, 3], [3, 1], 0),
    ],
)
def test_as_strided(size, stride, offset):
    check(aten.as_strided.default, X, size, stride, offset)
    want = aten.as_strided.default(X, size, stride, offset)
    src = torch.randn(want.shape)
    overlap = len(set(want.flatten().tolist())) != want.numel()
    if not overlap:
        check(aten.as_strided_scatter.default, X, src, size, stride, offset)


def test_unfold():
    x = r(3, 7, 2)
    for dim, size, step in [(1, 3, 2), (-2, 7, 1), (0, 1, 1), (1, 2, 5), (2, 2, 1)]:
        check(aten.unfold.default, x, dim, size, step)
        g = torch.randn(x.unfold(dim, size, step).shape)
        check(aten.unfold_backward.default, g, list(x.shape), dim, size, step)
    check(aten.unfold.default, torch.tensor(3.0), 0, 1, 1)


def test_complex_views():
    z = torch.randn(3, 4, dtype=torch.complex64)
    check(aten.view_as_real.default, z)
    check(aten.view_as_complex.default, torch.randn(3, 4, 2, dtype=torch.float64))


@pytest.mark.parametrize("dim", [0, 1, -1, 2])
def test_cat_stack(dim):
    a, b, c = r(2, 3, 4), r(2, 3, 4), r(2, 3, 4)
    if dim != 2:
        check(aten.cat.default, [a, b[:, :1] if dim == 1 else b, c], dim)
    check(aten.stack.default, [a, b, c], dim)
    check(aten.stack.default, [a, b, c], -4)
    check(aten.cat.default, [r(2, 3, dtype=torch.int64), r(1, 3), r(2, 3, dtype=torch.bfloat16)], 0)
    check(aten.cat.default, [r(0), r(2, 3), r(0)], 1)
    check(aten.stack.default, [r(2, dtype=torch.int32), r(2, dtype=torch.int64)], 1)


def test_flip_roll_repeat():
    check(aten.flip.default, X, [0, -1])
    check(aten.flip.default, X, [])
    check(aten.flip.default, torch.tensor(1.0), [0])
    check(aten.roll.default, X, [2], [1])
    check(aten.roll.default, X, [-7, 3], [0, -1])
    check(aten.roll.default, X, [4], [])
    check(aten.repeat.default, X, [1, 2, 1])
    check(aten.repeat.default, r(2, 3), [2, 1, 3])
    check(aten.repeat.default, torch.tensor(2.0), [3, 2])
    check(aten.repeat.default, r(2, 3), [0, 2])


@pytest.mark.parametrize("pad", [[1, 2], [0, 0, 2, 1], [-1, 2, 1, -2], [1, 1, 1, 1, 1, 1], []])
def test_constant_pad(pad):
    check(aten.constant_pad_nd.default, X, pad, 0.5)
    check(aten.constant_pad_nd.default, r(3, 5, 4, dtype=torch.int64), pad, 7)
    check(aten.constant_pad_nd.default, r(3, 5, 4, dtype=torch.bfloat16), pad)
    check(aten.constant_pad_nd.default, X, pad, float("-inf"))


def test_pixel_and_channel_shuffle_rot90():
    x = r(2, 8, 3, 5)
    check(aten.pixel_shuffle.default, x, 2)
    check(aten.pixel_unshuffle.default, r(2, 2, 4, 6), 2)
    check(aten.pixel_unshuffle.default, r(2, 4, 6), 2)
    check(aten.channel_shuffle.default, x, 4)
    for k, dims in [(1, [0, 1]), (2, [1, 2]), (-1, [2, 0]), (3, [0, 1]), (0, [0, 1])]:
        check(aten.rot90.default, X, k, dims)


def test_copy_variants_registered():
    for op in [
        aten.permute_copy.default,
        aten.transpose_copy.int,
        aten.expand_copy.default,
        aten.slice_copy.Tensor,
        aten.select_copy.int,
        aten.split_copy.Tensor,
        aten.unbind_copy.int,
        aten.diagonal_copy.default,
        aten.as_strided_copy.default,
        aten.squeeze_copy.dims,
        aten.unsqueeze_copy.default,
        aten.t_copy.default,
        aten.alias_copy.default,
        aten.detach_copy.default,
        aten.unfold_copy.default,
    ]:
        assert lower(op) is not None
    check(aten.permute_copy.default, X, [1, 2, 0])
    check(aten.slice_copy.Tensor, X, 1, 1, -1, 2)
    check(aten.split_copy.Tensor, X, 2, 1)


def test_scatter_ops_write_through_views_like_torch():
    # x.t()[1:, 0] = v  ==  x = slice_scatter/select_scatter chain
    x = r(4, 3)
    v = torch.randn(2)
    ref = x.clone()
    ref.t()[1:, 0] = v
    fn_sel, fn_sl, fn_t = lower(aten.select_scatter.default), lower(aten.slice_scatter.default), lower(aten.t.default)

    def write(x, v):
        xt = fn_t(x)
        col = lower(aten.select.int)(xt, 1, 0)
        return fn_t(fn_sel(xt, fn_sl(col, v, 0, 1, None, 1), 1, 0))

    assert_same(run(write, to_jax([x, v]), {}), ref)


def test_tril_triu():
    for d in (0, 1, -2, 5):
        check(aten.tril.default, X, d)
        check(aten.triu.default, r(4, 3, dtype=torch.bool), d)


def test_prims_convert_element_type():
    """torch's reference decompositions (renorm's for bf16) call this prim: torch's cast rules."""
    import shardtensor.ops.creation  # noqa: F401  (registers it)

    prim = torch.ops.prims.convert_element_type.default
    x = torch.tensor([1.7, -2.5, 0.0, 3.0])
    for dtype in (torch.int64, torch.bfloat16, torch.float64, torch.bool):
        assert_same(run(lower(prim), [to_jax(x), dtype], {}), prim(x, dtype))
    z = torch.tensor([1 + 2j, -3j])
    assert_same(run(lower(prim), [to_jax(z), torch.float32], {}), prim(z, torch.float32))
