"""In-place ops that change a tensor's shape, strides or storage (squeeze_, unsqueeze_, transpose_, t_,
swapdims_, as_strided_, resize_, resize_as_, set_), plus as_strided's storage semantics and a few
special ops (nonzero_static, allclose, _unique, zero gradients, to_sparse). Each is compared with
eager torch on CPU, on sharded tensors, in lazy and eager mode: values, shapes, strides, storage
offsets, that the tensor object stays the same, that views taken before still alias it, and
gradients.
"""

import warnings

import pytest
import torch
from torch.testing import assert_close

import shardtensor as st
from shardtensor.tensor import device as torch_device
from tensor_helpers import MESH_42, MESHES, isolate_lazy_graph, mode, modes


@pytest.fixture(autouse=True)
def _isolate():
    yield
    isolate_lazy_graph()


def _same(got, want):
    assert isinstance(got, st.ShardedTensor)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.stride() == want.stride(), (got.stride(), want.stride())
    assert got.storage_offset() == want.storage_offset()
    assert_close(got.cpu(), want)


def _sharded(t, spec=("x", "y")):
    return st.shard(t.clone(), MESH_42, spec)


# --- in-place view ops ----------------------------------------------------------------------------

INPLACE_VIEWS = {
    "unsqueeze_": lambda a: a.unsqueeze_(1),
    "unsqueeze_neg": lambda a: a.unsqueeze_(-1),
    "squeeze_": lambda a: a.unsqueeze_(0).squeeze_(),
    "squeeze_dim": lambda a: a.unsqueeze_(2).squeeze_(2),
    "squeeze_dims": lambda a: a.unsqueeze_(0).unsqueeze_(2).squeeze_((0, 2)),
    "transpose_": lambda a: a.transpose_(0, 1),
    "t_": lambda a: a.t_(),
    "swapdims_": lambda a: a.swapdims_(0, 1),
    "swapaxes_": lambda a: a.swapaxes_(1, 0),
    "as_strided_": lambda a: a.as_strided_((3, 4), (4, 1), 2),
    "chain": lambda a: a.t_().unsqueeze_(0).transpose_(0, 2),
}


@modes()
@pytest.mark.parametrize("name", sorted(INPLACE_VIEWS))
def test_inplace_view_op_keeps_the_tensor_and_its_views(name, eager):
    op = INPLACE_VIEWS[name]
    t = torch.randn(4, 6)
    with mode(eager):
        x = _sharded(t)
        a = t.clone()
        before_x, before_a = x[1:3], a[1:3]  # a view taken before
        ident = id(x)
        assert op(x) is x and id(x) == ident
        op(a)
        _same(x, a)
        # writes through the changed tensor reach its storage (and the view taken before) ...
        x.mul_(2)
        a.mul_(2)
        _same(x, a)
        _same(before_x, before_a)
        st.sync()
        # ... and writes through the old view reach the changed tensor
        before_x.add_(1)
        before_a.add_(1)
        _same(x, a)
        x[0].fill_(-1)
        a[0].fill_(-1)
        _same(x, a)
        _same(before_x, before_a)


@modes()
def test_inplace_view_ops_on_a_view(eager):
    t = torch.randn(5, 6)
    with mode(eager):
        x = _sharded(t)
        a = t.clone()
        v, w = x[1:4, ::2], a[1:4, ::2]
        v.t_()
        w.t_()
        _same(v, w)
        v.unsqueeze_(0).mul_(10)
        w.unsqueeze_(0).mul_(10)
        _same(v, w)
        _same(x, a)


@modes()
def test_inplace_view_op_errors_as_torch(eager):
    with mode(eager):
        x = _sharded(torch.randn(4, 6))
        with pytest.raises(IndexError, match="Dimension out of range"):
            x.transpose_(0, 2)
        with pytest.raises(
            RuntimeError, match="t_\\(\\) expects a tensor with <= 2 dimensions|expects a tensor with <= 2"
        ):
            x.unsqueeze(0).t_()
        with pytest.raises(RuntimeError, match="out of bounds for storage"):
            x.as_strided_((5, 6), (6, 1))
        assert x.shape == (4, 6)


def test_without_the_cpp_extension_in_place_shape_changes_are_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch_device, "EXT", None)
    t = torch.randn(5, 3)
    x = _sharded(t)
    for op in (lambda v: v.t_(), lambda v: v.unsqueeze_(0), lambda v: v.resize_(2, 2)):
        with pytest.raises(RuntimeError, match="cannot be resized"):
            op(x)
    assert_close(x.cpu(), t)
    assert x.shape == t.shape


# --- autograd -------------------------------------------------------------------------------------


def _grad_of(fn, t, device):
    leaf = (t.clone() if device == "cpu" else _sharded(t)).requires_grad_()
    out = fn(leaf)
    weight = torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * (weight if device == "cpu" else weight.to(st.device()))).sum().backward()
    return leaf.grad.cpu(), type(out.grad_fn).__name__, tuple(out.shape)


def _nonleaf_transpose(a):
    b = a * 1
    b.t_()
    b.mul_(torch.arange(24.0).reshape(6, 4).to(b.device))
    return b.unsqueeze_(1)


def _view_then_inplace_view(a):
    # an in-place view op on a view, then an in-place op on it (pytorch/pytorch#49825 breaks this
    # for devices that replay views; shardtensor makes autograd use as_strided as on CPU)
    c = a * 1
    v = c[:3, 1:4]
    v.t_()
    v.mul_(torch.arange(9.0).reshape(3, 3).to(v.device))
    return c * 1 + v.sum()


def _view_used_after(a):
    c = a * 1
    v = c[1]
    v.unsqueeze_(0)
    v.mul_(3)
    return v


def _as_strided_of_view(a):
    return (a * 1)[1:].t().as_strided((3, 3), (1, 4), 5)


@modes()
@pytest.mark.parametrize("fn", [_nonleaf_transpose, _view_then_inplace_view, _view_used_after, _as_strided_of_view])
def test_gradients_match_torch(fn, eager):
    t = torch.randn(4, 6)
    want = _grad_of(fn, t, "cpu")
    with mode(eager):
        got = _grad_of(fn, t, "st")
    assert_close(got[0], want[0])
    assert got[1:] == want[1:]


@modes()
def test_inplace_ops_on_leaves_that_require_grad_error_as_torch(eager):
    with mode(eager):
        x = _sharded(torch.randn(4, 6)).requires_grad_()
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
            x.unsqueeze_(0)
        with pytest.raises(RuntimeError, match="cannot resize variables that require grad"):
            x.resize_(2)
        assert x.shape == (4, 6)


# --- as_strided addresses storage -----------------------------------------------------------------

AS_STRIDED = {
    "contiguous": lambda a: a.as_strided((2, 3), (3, 1), 4),
    "gather": lambda a: a.as_strided((3, 2), (1, 5), 1),
    "of_transpose": lambda a: a.t().as_strided((4, 2), (2, 1), 3),
    "of_slice": lambda a: a[2:].as_strided((2, 6), (6, 1)),  # offset from the storage's start
    "of_slice_offset_default": lambda a: a[1:, 2:].as_strided((2, 2), (6, 1)),
    "of_noncontiguous_result": lambda a: a.t().clone().as_strided((3, 8), (8, 1)),
    "overlapping": lambda a: a.as_strided((5, 3), (2, 1)),
}


@modes()
@pytest.mark.parametrize("name", sorted(AS_STRIDED))
def test_as_strided_reads_and_writes_storage_as_torch(name, eager):
    fn = AS_STRIDED[name]
    t = torch.randn(4, 6)
    with mode(eager):
        x, a = _sharded(t), t.clone()
        v, w = fn(x), fn(a)
        _same(v, w)
        if name not in ("overlapping", "of_noncontiguous_result"):
            v.sub_(5)
            w.sub_(5)
            _same(x, a)


def test_empty_strided_reports_its_strides():
    e = torch.empty_strided((3, 4), (1, 3), device=st.device())
    assert e.stride() == (1, 3)
    c = torch.empty(2, 3, 4, 5, memory_format=torch.channels_last, device=st.device())
    assert c.stride() == torch.empty(2, 3, 4, 5, memory_format=torch.channels_last).stride()


# --- resize_, resize_as_, out= ---------------------------------------------------------------------

RESIZES = {
    "same": lambda a: a.resize_(4, 6),
    "reshape": lambda a: a.resize_(3, 8),
    "rank_up": lambda a: a.resize_(2, 3, 4),
    "shrink": lambda a: a.resize_(5),
    "to_empty": lambda a: a.resize_(0),
    "noncontiguous": lambda a: a.t().resize_(24),
    "offset_view": lambda a: a[1:].resize_(3, 4),
    "channels_last": lambda a: a.resize_(1, 2, 3, 4, memory_format=torch.channels_last),
}


@modes()
@pytest.mark.parametrize("name", sorted(RESIZES))
def test_resize_within_storage_is_a_view_of_it(name, eager):
    fn = RESIZES[name]
    t = torch.randn(4, 6)
    with mode(eager):
        x, a = _sharded(t), t.clone()
        v, w = fn(x), fn(a)
        _same(v, w)
        v.mul_(3)  # the resized tensor still shares the storage
        w.mul_(3)
        _same(x, a)


@modes()
@pytest.mark.parametrize(
    "spec, shape, kept",
    [
        (("x", "y"), (8, 6), True),  # same rank, every sharded dim has an element per shard
        (("x", "y"), (8, 1, 4), False),  # rank changed: replicated
        (("x", None), (2, 30), False),  # 2 rows over 4 shards: replicated
    ],
)
def test_resize_growing_keeps_old_values_first_and_decides_sharding(spec, shape, kept, eager):
    t = torch.randn(4, 6)
    with mode(eager):
        x, a = _sharded(t, spec), t.clone()
        ident = id(x)
        x.resize_(*shape)
        a.resize_(*shape)
        assert id(x) == ident and x.shape == a.shape and x.stride() == a.stride()
        assert_close(x.cpu().reshape(-1)[:24], t.reshape(-1))
        assert x.untyped_storage().nbytes() == a.untyped_storage().nbytes()
        if kept:
            assert x.partition_spec == st.P(*spec)
        else:
            assert x.partition_spec == st.P(*(None,) * len(shape))
        x.fill_(2)
        assert_close(x.cpu(), torch.full(shape, 2.0))
        st.sync()
        assert_close(x.cpu(), torch.full(shape, 2.0))


@modes()
def test_resize_growing_a_view_with_offset(eager):
    t = torch.randn(4, 6)
    with mode(eager):
        x = _sharded(t)
        v = x[2:]
        v.resize_(4, 6)
        assert v.storage_offset() == 12 and v.shape == (4, 6) and v.stride() == (6, 1)
        assert_close(v.cpu().reshape(-1)[:12], t[2:].reshape(-1))
        assert_close(x.cpu(), t)  # the old storage is not changed


@modes()
def test_resize_as_and_out_resize(eager):
    t = torch.randn(4, 6)
    with mode(eager):
        x, a = _sharded(t), t.clone()
        x.resize_as_(torch.empty(2, 2, device=st.device()))
        a.resize_as_(torch.empty(2, 2))
        _same(x, a)
        out = torch.empty(0, device=st.device())
        torch.add(_sharded(t), 1, out=out)
        _same(out, t + 1)
        out = torch.empty(3, device=st.device())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.mul(_sharded(t), 2, out=out)
        assert any("was resized" in str(w.message) for w in caught)
        _same(out, t * 2)


# --- set_ -------------------------------------------------------------------------------------------


@modes()
def test_set_shares_the_source(eager):
    t = torch.randn(4, 6)
    with mode(eager):
        x, a = _sharded(t), t.clone()
        y, b = torch.randn(3).to(st.device()), torch.randn(3)
        ident = id(y)
        y.set_(x.t())
        b.set_(a.t())
        assert id(y) == ident
        _same(y, b)
        y.add_(1)
        b.add_(1)
        _same(x, a)
        y.set_()
        b.set_()
        _same(y, b)
        with pytest.raises(RuntimeError, match="set_ with a Storage"):
            y.set_(x, 2, (2, 2), (1, 2))
        with pytest.raises(RuntimeError):
            y.set_(x.double())


# --- special ops ------------------------------------------------------------------------------------


@modes()
@pytest.mark.parametrize("size, fill", [(10, -1), (3, 7), (0, -1)])
def test_nonzero_static(size, fill, eager):
    t = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0], [0.0, 0.0, 3.0], [0.0, 4.0, 0.0]])
    with mode(eager):
        x = st.shard(t, MESH_42, ("x", None))
        # (strides as torch's meta kernel gives them, which are CUDA's (1, size), not CPU's)
        for got, want in (
            (torch.nonzero_static(x, size=size, fill_value=fill), torch.nonzero_static(t, size=size, fill_value=fill)),
            (
                torch.nonzero_static(torch.tensor(2.0).to(st.device()), size=2),
                torch.nonzero_static(torch.tensor(2.0), size=2),
            ),
        ):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert_close(got.cpu(), want)


@modes()
def test_allclose_returns_a_python_bool(eager):
    t = torch.randn(8, 4)
    with mode(eager):
        x = st.shard(t, MESHES["8"], ("x", None))
        assert torch.allclose(x, x + 1e-9) is True
        assert torch.allclose(x, x + 1) is False
        assert torch.allclose(x[:1], x) is torch.allclose(t[:1], t)
        nan = torch.tensor([float("nan")])
        assert torch.allclose(nan.to(st.device()), nan.to(st.device()), equal_nan=True) is True


@modes()
def test_unique_ops_run_on_the_host(eager):
    t = torch.tensor([3, 1, 3, 2, 1, 5, 3, 0])
    with mode(eager):
        x = st.shard(t, MESHES["8"], ("x",))
        for got, want in zip(
            torch.ops.aten._unique.default(x, True, True), torch.ops.aten._unique.default(t, True, True)
        ):
            _same(got, want)


@modes()
def test_sgn_backward_uses_zero_tensors(eager):
    t = torch.randn(8, 4)
    with mode(eager):
        x = st.shard(t, MESH_42, ("x", "y")).requires_grad_()
        torch.sgn(x).sum().backward()
        assert_close(x.grad.cpu(), torch.zeros(8, 4))


def test_to_sparse_is_a_clear_error():
    x = _sharded(torch.randn(4, 6))
    with pytest.raises(NotImplementedError, match=r"torch.sparse_coo.*\.cpu\(\)\.to_sparse\(\)"):
        x.to_sparse()
    with pytest.raises(NotImplementedError, match="torch.sparse_csr"):
        x.to_sparse_csr()
