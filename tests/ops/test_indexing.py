"""Indexing lowerings (shardtensor/ops/indexing.py) against eager torch on CPU."""

import pytest
import torch

from _lowering_harness import aten, check, deferred_checks  # noqa: F401  (the deferred_checks fixture)

torch.manual_seed(0)

X = torch.randn(4, 5, 6)
T = torch.tensor  # short: index tensors are written inline


def idx(*shape, high, low=None, dtype=torch.int64):
    return torch.randint(-high if low is None else low, high, shape, dtype=dtype)


@pytest.mark.parametrize(
    "indices",
    [
        [T([0, 2, -1])],
        [None, T([[1, 0], [4, -5]])],
        [T([1, 2]), None, T([0, 5])],  # separated advanced indices -> front
        [None, T([1, 2]), T([[0], [5]])],  # adjacent, broadcast
        [T([3]), T([4]), T([5])],
        [T(1), None, T([0, 1, 2])],  # 0-d index
        [None, None, T([2, 3], dtype=torch.int32)],
        [T([], dtype=torch.int64)],
    ],
)
def test_index(indices):
    check(aten.index.Tensor, X, indices)
    check(aten._unsafe_index.Tensor, X, indices)


def test_index_bool_mask_eager():
    m = torch.rand(4, 5) > 0.5
    check(aten.index.Tensor, X, [m], jit=False)
    check(aten.index.Tensor, X, [m.to(torch.uint8)], jit=False)


@pytest.mark.parametrize("accumulate", [False, True])
def test_index_put(accumulate):
    i = T([0, 2, -1])
    check(aten.index_put.default, X, [i], torch.randn(3, 5, 6), accumulate)
    check(aten.index_put.default, X, [None, T([1, 3]), T([0, -1])], torch.randn(4, 2), accumulate)
    check(aten.index_put.default, X, [i, None, T([0, 1, 2])], torch.randn(3, 5), accumulate)
    check(aten.index_put.default, X, [i], torch.tensor(2.5), accumulate)  # broadcast value
    check(aten._unsafe_index_put.default, X, [i], torch.randn(6), accumulate)
    check(aten._index_put_impl.default, X, [i], torch.randn(6), accumulate, False)
    xi = torch.randint(0, 9, (5, 3))
    check(aten.index_put.default, xi, [T([1, 1, 4])], torch.randint(0, 9, (3, 3)), accumulate)
    if accumulate:  # duplicates accumulate
        check(aten.index_put.default, X, [T([1, 1, 1, -3])], torch.randn(4, 5, 6), True)


def test_index_select_take_put():
    for dim in [0, 1, -1]:
        check(aten.index_select.default, X, dim, idx(7, high=4, low=0))
    check(aten.index_select.default, X, 1, T(3))
    check(aten.index_select.default, torch.tensor(5.0), 0, T(0))
    check(aten.index_select.default, X, 2, T([], dtype=torch.int64))
    check(aten.take.default, X, idx(3, 4, high=120))
    for acc in (False, True):
        check(aten.put.default, X, T([0, 7, -1, 7]), torch.randn(2, 2), acc) if acc else check(
            aten.put.default, X, T([0, 7, -1, 9]), torch.randn(2, 2), acc
        )


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gather(dim):
    shape = [3, 4, 5]
    shape[dim] = 7
    i = torch.randint(0, X.shape[dim], shape)
    check(aten.gather.default, X, dim, i)
    check(aten.gather.default, X, dim, i[:2, :3, :2])  # index smaller than self in other dims
    check(aten.gather.default, torch.tensor(3.0), 0, T(0))
    check(aten.gather.default, X, dim, torch.zeros(0, 2, 2, dtype=torch.int64))


def _unique_index(shape, dim, n):
    """Scatter index without duplicates along ``dim`` (so 'set' is deterministic)."""
    moved = list(shape)
    moved.append(moved.pop(dim % len(shape)))
    rows = [torch.randperm(n)[: moved[-1]] for _ in range(torch.Size(moved[:-1]).numel())]
    return torch.stack(rows).reshape(moved).movedim(-1, dim)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter(dim):
    shape = [3, 4, 5]
    shape[dim] = 3
    i = _unique_index(shape, dim, X.shape[dim])
    src = torch.randn(4, 5, 6)
    check(aten.scatter.src, X, dim, i, src)
    check(aten.scatter.value, X, dim, i, 1.5)
    dup = torch.randint(0, X.shape[dim], shape)
    check(aten.scatter_add.default, X, dim, dup, src)
    check(aten.scatter.reduce, X, dim, dup, src, reduce="add")
    check(aten.scatter.reduce, X, dim, dup, src, reduce="multiply")
    check(aten.scatter.value_reduce, X, dim, dup, 2.0, reduce="multiply")
    check(aten.scatter.value, torch.randint(0, 5, (4, 5, 6)), dim, i, 7)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(reduce, include_self):
    i = torch.randint(0, 5, (4, 3, 6))
    src = torch.randn(4, 3, 6)
    check(aten.scatter_reduce.two, X, 1, i, src, reduce, include_self=include_self)
    xi, si = torch.randint(-20, 20, (4, 5)), torch.randint(-20, 20, (4, 5))
    check(aten.scatter_reduce.two, xi, 0, torch.randint(0, 4, (4, 5)), si, reduce, include_self=include_self)


def test_scatter_reduce_nan():
    x = torch.tensor([1.0, 2.0, float("nan"), 4.0])
    src = torch.tensor([float("nan"), 5.0, 1.0, 0.0])
    i = torch.tensor([0, 1, 2, 3])
    for red in ("amax", "amin"):
        check(aten.scatter_reduce.two, x, 0, i, src, red)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_index_add_copy_fill(dim):
    n = X.shape[dim]
    i = torch.randint(0, n, (3,))
    shape = list(X.shape)
    shape[dim] = 3
    src = torch.randn(shape)
    check(aten.index_add.default, X, dim, i, src)
    check(aten.index_add.default, X, dim, i, src, alpha=-2.5)
    perm = torch.randperm(n)[:3]
    check(aten.index_copy.default, X, dim, perm, src)
    check(aten.index_fill.int_Scalar, X, dim, i, -1.5)
    check(aten.index_fill.int_Tensor, X, dim, i, torch.tensor(3.0))
    check(aten.index_add.default, torch.randint(0, 5, (4, 5, 6)), dim, i, torch.randint(0, 5, shape), alpha=3)


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
def test_index_reduce(reduce):
    for include_self in (True, False):
        check(
            aten.index_reduce.default,
            X,
            1,
            torch.tensor([0, 4, 0, 2]),
            torch.randn(4, 4, 6),
            reduce,
            include_self=include_self,
        )


def test_masked_scatter():
    mask = torch.rand(4, 5, 6) > 0.4
    check(aten.masked_scatter.default, X, mask, torch.randn(200))
    check(aten.masked_scatter.default, X, mask[:1, :, :1], torch.randn(4, 5, 6))  # broadcast mask
    check(aten.masked_scatter.default, torch.randn(5, 6), torch.rand(4, 5, 6) > 0.5, torch.randn(130))  # broadcast self
    g = torch.randn(4, 5, 6)
    check(aten.masked_scatter_backward.default, g, mask, [7, 30])


def test_embedding_and_backward():
    w = torch.randn(10, 4)
    i = torch.randint(0, 10, (3, 5))
    check(aten.embedding.default, w, i)
    check(aten.embedding.default, w, torch.tensor(3))
    g = torch.randn(3, 5, 4)
    i[0, :2] = 2
    for pad in (-1, 2):
        for freq in (False, True):
            check(aten.embedding_dense_backward.default, g, i, 10, pad, freq)
    check(aten.embedding_dense_backward.default, g.to(torch.bfloat16), i, 10, -1, False, rtol=2e-2, atol=1e-2)


def test_embedding_backward_matches_autograd():
    w = torch.randn(10, 4, requires_grad=True)
    i = torch.randint(0, 10, (2, 7))
    out = torch.nn.functional.embedding(i, w, padding_idx=3)
    g = torch.randn_like(out)
    out.backward(g)
    from _lowering_harness import assert_same, lower, run, to_jax

    assert_same(run(lower(aten.embedding_dense_backward.default), [to_jax(g), to_jax(i), 10, 3, False], {}), w.grad)


def test_embedding_renorm():
    w = torch.randn(10, 4) * 2
    i = torch.tensor([[1, 2], [2, 7]])
    for norm_type in (2.0, 1.0, 3.0, float("inf")):
        check(aten.embedding_renorm.default, w, i, 1.5, norm_type, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------- bool: add is or, mul is and
def test_bool_scatters_and_index_adds():
    b = torch.rand(6, 5) > 0.5
    src = torch.rand(6, 5) > 0.5
    dup = torch.randint(0, 6, (6, 5))
    check(aten.scatter_add.default, b, 0, dup, src)
    check(aten.scatter.reduce, b, 0, dup, src, reduce="add")
    check(aten.scatter.reduce, b, 0, dup, src, reduce="multiply")
    for reduce in ("sum", "prod", "amax", "amin"):
        for include_self in (True, False):
            check(aten.scatter_reduce.two, b, 0, dup, src, reduce, include_self=include_self)
    i = torch.tensor([0, 3, 3, 5])
    check(aten.index_add.default, b, 0, i, torch.rand(4, 5) > 0.5)
    check(aten.index_put.default, b, [i], torch.rand(4, 5) > 0.5, True)
    check(aten.index_put.default, b, [i], torch.tensor(True), True)
    check(aten.put.default, b, torch.tensor([1, 1, 7, 29]), torch.tensor([True, False, True, True]), True)


def test_bool_mean_reductions_raise_like_torch():
    from _lowering_harness import lower, to_jax

    b = torch.rand(6, 5) > 0.5
    with pytest.raises(RuntimeError, match="not implemented for 'Bool'"):
        lower(aten.scatter_reduce.two)(
            to_jax(b), 0, to_jax(torch.zeros(2, 5, dtype=torch.int64)), to_jax(b[:2]), "mean"
        )
    with pytest.raises(RuntimeError, match="not implemented for 'Bool'"):
        lower(aten.index_reduce.default)(to_jax(b), 0, to_jax(torch.tensor([0, 1])), to_jax(b[:2]), "amax")


# ------------------------------------------------ uneven shardings (padded storage) of scatter indices
def _mesh():
    import shardtensor as st

    return st, st.Mesh(range(8), (4, 2), ("x", "y"))


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("sharded", ["index", "src", "self"])
def test_sharded_uneven_scatter_reduce(reduce, sharded):
    """XLA pads an unevenly sharded scatter index with 0 (a valid position) and its updates with 0 or
    the broadcast value; for anything but set / add of real updates that wrote into row 0."""
    st, mesh = _mesh()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 5, generator=g) - 3  # negative: a stray max(., 0) would show
    index = torch.randint(1, 10, (5, 5), generator=g)  # row 0 never targeted
    src = torch.randn(5, 5, generator=g)
    args = {"self": x, "index": index, "src": src}
    sh = {k: st.shard(v.clone(), mesh, ("x", None) if k == sharded else (None, None)) for k, v in args.items()}
    for include_self in (True, False):
        want = x.scatter_reduce(0, index, src, reduce, include_self=include_self)
        got = sh["self"].scatter_reduce(0, sh["index"], sh["src"], reduce, include_self=include_self)
        torch.testing.assert_close(got.cpu(), want)


def test_sharded_uneven_index_reduce_and_constant_scatters():
    st, mesh = _mesh()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 10, generator=g) - 3
    index = torch.tensor([1, 4, 4, 9, 2])  # 5 entries over 4 devices: padded
    source = torch.randn(6, 5, generator=g)
    sx, si = st.shard(x.clone(), mesh, (None, None)), st.shard(index, mesh, ("x",))
    ss = st.shard(source, mesh, (None, "x"))
    for reduce in ("mean", "prod", "amax", "amin"):
        for include_self in (True, False):
            want = x.index_reduce(1, index, source, reduce, include_self=include_self)
            torch.testing.assert_close(sx.index_reduce(1, si, ss, reduce, include_self=include_self).cpu(), want)
    i2 = torch.randint(1, 6, (5, 3), generator=g)
    si2 = st.shard(i2, mesh, ("x", None))
    torch.testing.assert_close(sx.scatter(0, si2, 2.5, reduce="add").cpu(), x.scatter(0, i2, 2.5, reduce="add"))
    torch.testing.assert_close(
        sx.scatter(0, si2, 2.5, reduce="multiply").cpu(), x.scatter(0, i2, 2.5, reduce="multiply")
    )
    xt = x.t().contiguous()
    acc = st.shard(xt.clone(), mesh, (None, None))
    acc.index_put_((si,), torch.tensor(1.5), accumulate=True)
    torch.testing.assert_close(acc.cpu(), xt.index_put((index,), torch.tensor(1.5), accumulate=True))
    ids = torch.tensor([3, 3, 7, 1, 3])
    gw = torch.ops.aten.embedding_dense_backward(
        st.shard(torch.ones(5, 3), mesh, ("x", None)), st.shard(ids, mesh, ("x",)), 10, -1, True
    )
    torch.testing.assert_close(gw.cpu(), torch.ops.aten.embedding_dense_backward(torch.ones(5, 3), ids, 10, -1, True))


def test_sharded_uneven_index_add_put_and_index_put():
    """The flattened, padded scatter (write_at) with window dims, separated index arrays, put, bool."""
    st, mesh = _mesh()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 7, 5, generator=g)
    sx = st.shard(x.clone(), mesh, ("x", None, None))  # 6 rows over 4 devices: a window dim, padded
    i = torch.tensor([6, 0, 6, 3, 2])
    src = torch.randn(6, 5, 5, generator=g) + 4
    ssrc = st.shard(src, mesh, (None, "x", None))
    torch.testing.assert_close(sx.index_add(1, st.shard(i, mesh, ("x",)), ssrc * 2).cpu(), x.index_add(1, i, src * 2))
    r, c = torch.tensor([[0, 5, 5], [2, 1, 5]]), torch.tensor([4, 0, 4])  # separated by a slice: batch dims in front
    vals = torch.randn(2, 3, 7, generator=g)
    got = torch.ops.aten.index_put(
        sx,
        [st.shard(r, mesh, (None, "x")), None, st.shard(c, mesh, ("x",))],
        st.shard(vals, mesh, (None, "x", None)) + 1,
        True,
    )
    torch.testing.assert_close(got.cpu(), torch.ops.aten.index_put(x, [r, None, c], vals + 1, True))
    flat = torch.tensor([0, 209, 17, 17, -3])
    sp = torch.randn(5, generator=g)
    got = sx.put(st.shard(flat, mesh, ("x",)), st.shard(sp, mesh, ("x",)) - 2, accumulate=True)
    torch.testing.assert_close(got.cpu(), x.put(flat, sp - 2, accumulate=True))
    b = torch.rand(6, 5, generator=g) > 0.5
    bi, bs = torch.randint(0, 6, (5, 5), generator=g), torch.rand(5, 5, generator=g) > 0.5
    sb = st.shard(b.clone(), mesh, (None, "x"))
    for reduce in ("sum", "prod", "amax", "amin"):
        got = sb.scatter_reduce(0, st.shard(bi, mesh, ("x", None)), st.shard(bs, mesh, ("x", None)), reduce)
        torch.testing.assert_close(got.cpu(), b.scatter_reduce(0, bi, bs, reduce))
