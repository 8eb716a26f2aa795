"""Views and in-place ops on ShardedTensors follow torch exactly (DESIGN.md, "Storage and views"):
writes through views (and views of views) reach the base, the base's changes are seen by its views,
``detach()``/``.data`` share storage, ``p.data.copy_(q)``, BatchNorm running statistics — in lazy and
in eager mode, on sharded, uneven and replicated tensors. Every result is compared with eager torch.
"""

import copy

import pytest
import torch
from torch.testing import assert_close

import shardtensor as st
from tensor_helpers import MESH_42, MESHES, check_cover, isolate_lazy_graph, mode, modes


@pytest.fixture(autouse=True)
def _isolate():
    yield
    isolate_lazy_graph()


# layout name -> (shape, mesh, spec)
LAYOUTS = {
    "even": ((8, 4), MESHES["4x2"], ("x", "y")),
    "uneven": ((7, 5), MESHES["4x2"], ("x", "y")),
    "2x2x2": ((6, 5), MESHES["2x2x2"], (("x", "z"), "y")),
    "1x8": ((5, 9), MESHES["1x8"], ("x", "y")),
    "replicated": ((5, 5), MESHES["8"], (None, None)),
}


def _check_inplace(fn, layout, eager):
    shape, mesh, spec = LAYOUTS[layout]
    torch.manual_seed(0)
    t = torch.randn(*shape)
    with mode(eager):
        x = st.shard(t.clone(), mesh, spec)
        before = x.sharding_spec
        want = fn(t)
        got = fn(x)
        assert_close(x.cpu(), t)
        if isinstance(want, torch.Tensor):
            assert isinstance(got, st.ShardedTensor)
            assert got.shape == want.shape and got.dtype == want.dtype
            assert_close(got.cpu(), want)
        # the base keeps its sharding and its shards hold the new values
        assert x.sharding_spec == before
        assert x.partition_spec == st.P(*spec)
        check_cover(x, x.cpu())


# --- the issue's list, on every layout, in both modes -----------------------------------------------


def _t_mul(a):
    a.t().mul_(2)


def _setitem_column(a):
    a[:, 0] = 1


def _view_add(a):
    a.view(-1).add_(1)


def _diagonal_zero(a):
    a.diagonal().zero_()


def _data_copy(a):
    a.data.copy_(a.detach() * 3 - 1)


def _detach_add(a):
    a.detach().add_(5)


ISSUE_CASES = [_t_mul, _setitem_column, _view_add, _diagonal_zero, _data_copy, _detach_add]


@modes()
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fn", ISSUE_CASES, ids=lambda f: f.__name__.strip("_"))
def test_issue_view_and_inplace_cases(fn, layout, eager):
    _check_inplace(fn, layout, eager)


# --- more views, views of views, reads after writes -------------------------------------------------


def _slice_of_slice(a):
    v = a[1:]
    w = v[:, 2:]
    w.mul_(3)
    return v


def _select_add(a):
    a[1] += 5


def _t_select_fill(a):
    a.t()[2].fill_(7)


def _unsqueeze_squeeze_set(a):
    a.unsqueeze(0).squeeze(0)[0, 1] = 9


def _strided_slices(a):
    a[::2, 1:4:2] = 0


def _flat_slice(a):
    a.view(-1)[3:10].mul_(2)


def _view_sees_base(a):
    v = a.t()
    a.mul_(2)
    return v


def _row_then_base(a):
    r = a[0]
    a.add_(1)
    return r * 1


def _permute_column(a):
    a.permute(1, 0)[:, 1].sub_(3)


def _narrow(a):
    a.narrow(0, 1, 2).mul_(10)


def _unflatten_select(a):
    a.unflatten(0, (a.shape[0], 1)).select(1, 0)[2].zero_()


def _as_strided(a):
    a.as_strided((2, 2), (a.shape[1], 1)).zero_()


def _split(a):
    a.split(2)[1].mul_(2)


def _unbind(a):
    a.unbind(0)[-1].fill_(0)


def _chunk(a):
    a.chunk(2, 1)[1].neg_()


def _masked_fill(a):
    a.masked_fill_(a < 0, 1.0)


def _setitem_from_view(a):
    a[:, 1] = a[:, 2] * 2


def _setitem_row_tensor(a):
    a[2] = torch.arange(float(a.shape[1])).to(a.device)


def _clamp_slice(a):
    a[1:4].clamp_(-0.1, 0.1)


def _transposed_strided(a):
    a.transpose(0, 1)[1:3, ::2].mul_(-1)


def _out_into_view(a):
    torch.mul(a[0], 2, out=a[1])


def _swapdims_view(a):
    a.swapdims(0, 1).reshape(a.shape[1], a.shape[0])[0].zero_()


def _fill_diagonal(a):
    a.fill_diagonal_(3.0)


def _mul_by_other_view(a):
    a[1:3].mul_(a[3:5])


def _addcmul_strided(a):
    f = a.view(-1)
    f[::3][:10].addcmul_(f[1::3][:10], f[2::3][:10], value=0.5)


def _index_fill(a):
    a.index_fill_(0, torch.tensor([1, 3]).to(a.device), -1.0)


def _index_add_assign(a):
    idx = torch.tensor([0, 2]).to(a.device)
    a[idx] = a[idx] + 1


def _mask_assign(a):
    a[a > 0] = 0.0


def _view_of_view_chain(a):
    v = a.view(-1).view(a.shape[1], a.shape[0]).t()
    v[1:3].add_(1)
    w = v.t()[0]
    w.mul_(2)
    return v


MORE_CASES = [
    _slice_of_slice,
    _select_add,
    _t_select_fill,
    _unsqueeze_squeeze_set,
    _strided_slices,
    _flat_slice,
    _view_sees_base,
    _row_then_base,
    _permute_column,
    _narrow,
    _unflatten_select,
    _as_strided,
    _split,
    _unbind,
    _chunk,
    _masked_fill,
    _setitem_from_view,
    _setitem_row_tensor,
    _clamp_slice,
    _transposed_strided,
    _out_into_view,
    _swapdims_view,
    _fill_diagonal,
    _mul_by_other_view,
    _addcmul_strided,
    _index_fill,
    _index_add_assign,
    _mask_assign,
    _view_of_view_chain,
]


@pytest.mark.parametrize("fn", MORE_CASES, ids=lambda f: f.__name__.strip("_"))
def test_more_views_and_inplace(fn):
    _check_inplace(fn, "uneven", eager=False)


def _all_more_cases(a):
    outs = []
    for fn in MORE_CASES:
        if fn is _mask_assign:
            continue  # tested on its own (a lowering of its own, not views)
        out = fn(a)
        if out is not None:
            outs.append(out.clone().reshape(-1))
    return torch.cat(outs)


@pytest.mark.parametrize(
    "layout, eager",
    [("uneven", True), ("2x2x2", False), ("1x8", False)],
    ids=["uneven-eager", "2x2x2-lazy", "1x8-lazy"],
)
def test_more_views_and_inplace_chained(layout, eager):
    # every case above, one after the other on the same tensor (one graph in lazy mode)
    _check_inplace(_all_more_cases, layout, eager)


# --- copies are copies: contiguous(), reshape() and flatten() of non-contiguous views ---------------


def _t_contiguous(a):
    a.t().contiguous().add_(1)


def _t_reshape(a):
    a.t().reshape(-1).add_(1)


def _column_contiguous(a):
    a[:, 0].contiguous().mul_(0)


def _t_flatten(a):
    a.t().flatten().zero_()


def _expand_contiguous(a):
    a[:1].expand(3, a.shape[1]).contiguous().zero_()


def _clone_view(a):
    a.t().clone().zero_()


COPY_CASES = [_t_contiguous, _t_reshape, _column_contiguous, _t_flatten, _expand_contiguous, _clone_view]


@modes()
@pytest.mark.parametrize("fn", COPY_CASES, ids=lambda f: f.__name__.strip("_"))
def test_copies_of_noncontiguous_views_do_not_write_back(fn, eager):
    _check_inplace(fn, "uneven", eager)


def test_view_metadata_matches_torch():
    t = torch.randn(6, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    views = {
        "t": lambda a: a.t(),
        "column": lambda a: a[:, 1],
        "strided": lambda a: a[::2],
        "expand": lambda a: a[:1].expand(3, 4),
        "diagonal": lambda a: a.diagonal(),
        "permute_3d": lambda a: a.view(2, 3, 4).permute(2, 0, 1),
        "view": lambda a: a.view(4, 6),
    }
    for name, f in views.items():
        v, w = f(x), f(t)
        assert v.shape == w.shape, name
        assert v.stride() == w.stride(), (name, v.stride(), w.stride())
        assert v.is_contiguous() == w.is_contiguous(), name
        assert v.storage_offset() == w.storage_offset(), name


@modes()
def test_view_of_noncontiguous_tensor_errors_as_torch(eager):
    x = st.shard(torch.randn(6, 4), MESH_42, ("x", "y"))
    with mode(eager), pytest.raises(RuntimeError, match="view size is not compatible"):
        x.t().view(-1)


@modes()
def test_inplace_view_ops_change_the_tensor_in_place(eager):
    # t_, unsqueeze_ ... change the shape of the same tensor object, as in torch (more in
    # test_resize.py, which also checks the clear error when the C++ extension is missing)
    t = torch.randn(5, 3)
    with mode(eager):
        x = st.shard(t.clone(), MESH_42, ("x", "y"))
        a = t.clone()
        for op in (lambda v: v.t_(), lambda v: v.unsqueeze_(0)):
            assert op(x) is x
            op(a)
        assert x.shape == a.shape and x.stride() == a.stride()
        assert_close(x.cpu(), a)


# --- detach(), .data and parameters ---------------------------------------------------------------


@modes()
def test_detach_shares_storage_both_ways(eager):
    t = torch.randn(7, 5)
    with mode(eager):
        x = st.shard(t.clone(), MESH_42, ("x", "y"))
        d = x.detach()
        d.add_(1)
        assert_close(x.cpu(), t + 1)
        x.mul_(2)
        assert_close(d.cpu(), (t + 1) * 2)
        x.data.sub_(3)
        assert_close(d.cpu(), (t + 1) * 2 - 3)
        assert d.sharding_spec == x.sharding_spec


@modes()
def test_detach_inplace_bumps_version_for_autograd(eager):
    t = torch.randn(4, 4, requires_grad=True)
    with mode(eager):
        x = st.shard(t.detach(), MESH_42, ("x", "y")).requires_grad_()
        y = x.sigmoid()
        y.detach().zero_()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


@modes()
def test_param_data_copy(eager):
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 6)
    with mode(eager):
        dev = copy.deepcopy(lin).to(st.device())
        st.mark_sharding(dev.weight, MESH_42, ("x", "y"))
        q = torch.randn(6, 5)
        lin.weight.data.copy_(q)
        dev.weight.data.copy_(st.shard(q, MESH_42, ("y", None)))  # another layout: p keeps its own
        assert_close(dev.weight.cpu(), lin.weight.detach())
        assert dev.weight.sharding_spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"
        check_cover(dev.weight, q)
        dev.weight.data.copy_(q * 2)  # from a CPU tensor
        assert_close(dev.weight.cpu(), q * 2)
        with torch.no_grad():
            dev.weight.mul_(0.5)
            dev.bias.copy_(lin.bias)
        assert_close(dev.weight.cpu(), q)
        assert dev.weight.requires_grad and dev.weight.is_leaf
        x = torch.randn(3, 5)
        assert_close(dev(x.to(st.device())).cpu(), lin(x), rtol=1e-5, atol=1e-5)


@modes()
def test_param_data_assignment(eager):
    with mode(eager):
        p = torch.nn.Parameter(torch.zeros(6, 4).to(st.device()))
        q = st.shard(torch.arange(24.0).reshape(6, 4), MESH_42, ("x", "y"))
        p.data = q
        assert_close(p.detach().cpu(), torch.arange(24.0).reshape(6, 4))
        assert p.sharding_spec == q.sharding_spec
        p.data.mul_(2)  # shares storage with q, as in torch
        assert_close(q.cpu(), torch.arange(24.0).reshape(6, 4) * 2)


@modes()
def test_optimizer_style_updates_through_views(eager):
    # foreach-free SGD with momentum on a sharded parameter, as torch.optim does it
    torch.manual_seed(0)
    w = torch.randn(7, 5)
    g = torch.randn(7, 5)
    with mode(eager):
        p = torch.nn.Parameter(st.shard(w.clone(), MESH_42, ("x", "y")))
        p.grad = st.shard(g, MESH_42, ("x", "y"))
        ref = torch.nn.Parameter(w.clone())
        ref.grad = g.clone()
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, foreach=False)
        opt_ref = torch.optim.SGD([ref], lr=0.1, momentum=0.9, foreach=False)
        for _ in range(3):
            opt.step()
            opt_ref.step()
        assert_close(p.detach().cpu(), ref.detach())
        assert p.sharding_spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"


# --- BatchNorm running statistics -------------------------------------------------------------------

BN_LAYOUTS = {
    "even": ((8, 3, 4, 4), ("x", None, None, "y")),
    "uneven": ((6, 3, 5, 5), ("x", None, "y", None)),
    "replicated": ((4, 3, 3, 3), (None, None, None, None)),
}


@pytest.mark.parametrize(
    "layout, momentum, eager",
    [(layout, 0.1, eager) for layout in BN_LAYOUTS for eager in (False, True)] + [("uneven", None, False)],
    ids=[f"{layout}-{m}" for layout in BN_LAYOUTS for m in ("lazy", "eager")] + ["uneven-cumulative-lazy"],
)
def test_batchnorm_running_stats(layout, momentum, eager):
    shape, spec = BN_LAYOUTS[layout]
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(3, momentum=momentum)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    with mode(eager):
        dev = copy.deepcopy(bn).to(st.device())
        for step in range(3):
            inp = torch.randn(*shape) * (step + 1) + step
            out = bn(inp)
            got = dev(st.shard(inp, MESH_42, spec))
            assert_close(got.cpu(), out, rtol=1e-4, atol=1e-4)
            assert_close(dev.running_mean.cpu(), bn.running_mean, rtol=1e-5, atol=1e-5)
            assert_close(dev.running_var.cpu(), bn.running_var, rtol=1e-5, atol=1e-5)
            assert dev.num_batches_tracked.item() == bn.num_batches_tracked.item()
        bn.eval()
        dev.eval()
        inp = torch.randn(*shape)
        assert_close(dev(st.shard(inp, MESH_42, spec)).cpu(), bn(inp), rtol=1e-4, atol=1e-4)
        assert_close(dev.running_mean.cpu(), bn.running_mean, rtol=1e-5, atol=1e-5)


@modes()
def test_batchnorm_running_stats_with_backward(eager):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.BatchNorm2d(3), torch.nn.ReLU())
    with mode(eager):
        dev = copy.deepcopy(model).to(st.device())
        inp = torch.randn(6, 2, 5, 5)
        model(inp).square().mean().backward()
        dev(st.shard(inp, MESH_42, ("x", None, None, None))).square().mean().backward()
        assert_close(dev[1].running_mean.cpu(), model[1].running_mean, rtol=1e-5, atol=1e-5)
        assert_close(dev[1].running_var.cpu(), model[1].running_var, rtol=1e-5, atol=1e-5)
        assert_close(dev[1].weight.grad.cpu(), model[1].weight.grad, rtol=1e-4, atol=1e-4)
        assert_close(dev[0].weight.grad.cpu(), model[0].weight.grad, rtol=1e-4, atol=1e-4)


# --- in-place ops follow torch's checks --------------------------------------------------------------


@modes()
def test_select_write_after_slice_write_on_row_sharded_tensor(eager):
    # x[1:] *= 3 then x[1] += 5, rows sharded over a (4, 2) mesh: one lazy graph holds a
    # dynamic-update-slice followed by a scatter into the same rows.
    for spec in (("x", None), ("x", "y"), (None, "y"), (("x", "y"), None)):
        t = torch.arange(32.0).reshape(8, 4)
        with mode(eager):
            x = st.shard(t.clone(), MESH_42, spec)
            x[1:].mul_(3)
            x[1].add_(5)
            t[1:].mul_(3)
            t[1].add_(5)
            assert_close(x.cpu(), t, msg=lambda m, spec=spec: f"spec {spec}: {m}")


@modes()
def test_inplace_dtype_and_broadcast_checks(eager):
    with mode(eager):
        i = st.shard(torch.arange(8).reshape(4, 2), MESH_42, ("x", "y"))
        with pytest.raises(RuntimeError, match="can't be cast|not possible"):
            i.add_(1.5)
        assert torch.equal(i.cpu(), torch.arange(8).reshape(4, 2))
        f = st.shard(torch.zeros(4, 2), MESH_42, ("x", "y"))
        f.add_(i)  # int into float: allowed
        assert_close(f.cpu(), torch.arange(8.0).reshape(4, 2))
        f.add_(st.shard(torch.tensor([1.0, 2.0]), MESH_42, ("y",)))  # broadcast into self
        assert_close(f.cpu(), torch.arange(8.0).reshape(4, 2) + torch.tensor([1.0, 2.0]))
        with pytest.raises(RuntimeError):
            st.shard(torch.zeros(2), MESH_42, ("y",)).add_(f)  # cannot broadcast self up


@modes()
def test_inplace_on_int_and_bool_views(eager):
    t = torch.arange(35).reshape(7, 5)
    with mode(eager):
        x = st.shard(t.clone(), MESH_42, ("x", "y"))
        x[:, 0] = 1
        x.t()[1].mul_(3)
        x[2:5] //= 2
        t[:, 0] = 1
        t.t()[1].mul_(3)
        t[2:5] //= 2
        assert torch.equal(x.cpu(), t)
        b = st.shard(torch.zeros(5, 3, dtype=torch.bool), MESH_42, ("x", None))
        b[1] = True
        b.t()[2].logical_not_()
        want = torch.zeros(5, 3, dtype=torch.bool)
        want[1] = True
        want.t()[2].logical_not_()
        assert torch.equal(b.cpu(), want)


def test_writes_through_view_as_real_and_conj():
    mesh = st.Mesh(range(8), (4, 2), ("x", "y"))
    z = torch.randn(4, 3, dtype=torch.complex64)
    s, ref = st.shard(z.clone(), mesh, ("x", None)), z.clone()
    torch.view_as_real(s).mul_(2)
    torch.view_as_real(ref).mul_(2)
    torch.view_as_real(s)[..., 1] = 0
    torch.view_as_real(ref)[..., 1] = 0
    torch.testing.assert_close(s.cpu(), ref)
