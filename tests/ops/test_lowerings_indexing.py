"""Indexing lowerings (shardtensor/ops/indexing.py) against eager torch on CPU."""
import pytest
import torch

from lowering_testkit import aten, check, batch_checks  # noqa: F401  (autouse fixture)

torch.manual_seed(0)

X = torch.randn(4, 5, 6)
I = torch.tensor


def idx(*shape, high, low=None, dtype=torch.int64):
    return torch.randint(-high if low is None else low, high, shape, dtype=dtype)


@pytest.mark.parametrize("indices", [
    [I([0, 2, -1])],
    [None, I([[1, 0], [4, -5]])],
    [I([1, 2]), None, I([0, 5])],             # separated advanced indices -> front
    [None, I([1, 2]), I([[0], [5]])],          # adjacent, broadcast
    [I([3]), I([4]), I([5])],
    [I(1), None, I([0, 1, 2])],                # 0-d index
    [None, None, I([2, 3], dtype=torch.int32)],
    [I([], dtype=torch.int64)],
])
def test_index(indices):
    check(aten.index.Tensor, X, indices)
    check(aten._unsafe_index.Tensor, X, indices)


def test_index_bool_mask_eager():
    m = torch.rand(4, 5) > 0.5
    check(aten.index.Tensor, X, [m], jit=False)
    check(aten.index.Tensor, X, [m.to(torch.uint8)], jit=False)


@pytest.mark.parametrize("accumulate", [False, True])
def test_index_put(accumulate):
    i = I([0, 2, -1])
    check(aten.index_put.default, X, [i], torch.randn(3, 5, 6), accumulate)
    check(aten.index_put.default, X, [None, I([1, 3]), I([0, -1])], torch.randn(4, 2), accumulate)
    check(aten.index_put.default, X, [i, None, I([0, 1, 2])], torch.randn(3, 5), accumulate)
    check(aten.index_put.default, X, [i], torch.tensor(2.5), accumulate)  # broadcast value
    check(aten._unsafe_index_put.default, X, [i], torch.randn(6), accumulate)
    check(aten._index_put_impl.default, X, [i], torch.randn(6), accumulate, False)
    xi = torch.randint(0, 9, (5, 3))
    check(aten.index_put.default, xi, [I([1, 1, 4])], torch.randint(0, 9, (3, 3)), accumulate)
    if accumulate:  # duplicates accumulate
        check(aten.index_put.default, X, [I([1, 1, 1, -3])], torch.randn(4, 5, 6), True)


def test_index_select_take_put():
    for dim in [0, 1, -1]:
        check(aten.index_select.default, X, dim, idx(7, high=4, low=0))
    check(aten.index_select.default, X, 1, I(3))
    check(aten.index_select.default, torch.tensor(5.0), 0, I(0))
    check(aten.index_select.default, X, 2, I([], dtype=torch.int64))
    check(aten.take.default, X, idx(3, 4, high=120))
    for acc in (False, True):
        check(aten.put.default, X, I([0, 7, -1, 7]), torch.randn(2, 2), acc) if acc else \
            check(aten.put.default, X, I([0, 7, -1, 9]), torch.randn(2, 2), acc)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gather(dim):
    shape = [3, 4, 5]
    shape[dim] = 7
    i = torch.randint(0, X.shape[dim], shape)
    check(aten.gather.default, X, dim, i)
    check(aten.gather.default, X, dim, i[:2, :3, :2])  # index smaller than self in other dims
    check(aten.gather.default, torch.tensor(3.0), 0, I(0))
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
        check(aten.index_reduce.default, X, 1, torch.tensor([0, 4, 0, 2]), torch.randn(4, 4, 6), reduce, include_self=include_self)


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
    from lowering_testkit import assert_same, call, lower, to_jax

    assert_same(call(lower(aten.embedding_dense_backward.default), [to_jax(g), to_jax(i), 10, 3, False], {}), w.grad)


def test_embedding_renorm():
    w = torch.randn(10, 4) * 2
    i = torch.tensor([[1, 2], [2, 7]])
    for norm_type in (2.0, 1.0, 3.0, float("inf")):
        check(aten.embedding_renorm.default, w, i, 1.5, norm_type, rtol=1e-5, atol=1e-6)
