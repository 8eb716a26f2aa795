"""Scatters through unevenly sharded tensors against eager torch on CPU: pdist, embedding_bag and
segment_reduce forward and backward, with the scattered (index) dimension sharded over a mesh axis it
does not divide. XLA (jax 0.10.2) pads such a scatter's indices with a valid position and keeps the
padded updates; the lowerings go through ops/indexing.write_at to avoid it."""

import math

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st

MESHES = {"8": ((8,), ("x",)), "4x2": ((4, 2), ("x", "y"))}
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _mesh(name):
    shape, names = MESHES[name]
    return st.Mesh(range(8), shape, names)


def _shard(t, mesh, sharded=True, grad=False):
    spec = ("x",) + (None,) * (t.dim() - 1) if sharded else (None,) * t.dim()
    return st.shard(t.detach().clone(), mesh, spec).requires_grad_(grad)


def _leaf(t, grad=False):
    return t.detach().clone().requires_grad_(grad)


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("n", [7, 10, 13])  # rows over 8 or 4 devices: padded; n(n-1)/2 pairs too
@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, math.inf])
def test_pdist_uneven(mesh, n, p):
    mesh = _mesh(mesh)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 3, generator=g)
    gout = torch.randn(n * (n - 1) // 2, generator=g)
    ref = _leaf(x, True)
    want = F.pdist(ref, p)
    (want * gout).sum().backward()
    sx = _shard(x, mesh, grad=True)
    got = F.pdist(sx, p)
    torch.testing.assert_close(got.cpu(), want.detach(), **TOL)
    (got * _shard(gout, mesh)).sum().backward()
    torch.testing.assert_close(sx.grad.cpu(), ref.grad, **TOL)


def _bags(n_idx, n_bags, g):
    """Sorted offsets starting at 0, with an empty bag."""
    cuts = torch.randperm(n_idx - 1, generator=g)[: n_bags - 2].sort().values + 1
    return torch.cat([torch.tensor([0]), cuts[:1], cuts]).sort().values


# (per_sample_weights: mode 'sum' only; torch's max mode does not support scale_grad_by_freq)
BAG_CASES = [
    ("sum", False, False),
    ("sum", True, False),
    ("sum", False, True),
    ("sum", True, True),
    ("mean", False, False),
    ("mean", False, True),
    ("max", False, False),
]


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("mode,psw,sgf", BAG_CASES, ids=[f"{m}{'-psw' * p}{'-freq' * f}" for m, p, f in BAG_CASES])
@pytest.mark.parametrize("padding_idx", [None, 3], ids=["", "pad"])
def test_embedding_bag_uneven(mesh, mode, psw, sgf, padding_idx):
    mesh = _mesh(mesh)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(10, 4, generator=g)  # 10 rows over 8 or 4 devices: padded
    # 15 indices (padded): 5 rows 3 times each, row 3 the padding_idx. (torch's CPU scale_grad_by_freq
    # divides by the count of another index unless all counts agree.)
    idx = torch.tensor([1, 3, 4, 7, 9]).repeat(3)[torch.randperm(15, generator=g)]
    off = _bags(15, 5, g)
    psw_t = torch.rand(15, generator=g) + 0.5 if psw else None
    gout = torch.randn(5, 4, generator=g)

    def run(weight, i, o, s):
        return F.embedding_bag(
            i, weight, o, mode=mode, per_sample_weights=s, padding_idx=padding_idx, scale_grad_by_freq=sgf
        )

    ref_w, ref_s = _leaf(w, True), (_leaf(psw_t, True) if psw else None)
    want = run(ref_w, idx, off, ref_s)
    (want * gout).sum().backward()
    sw = _shard(w, mesh, grad=True)
    ss = _shard(psw_t, mesh, grad=True) if psw else None
    got = run(sw, _shard(idx, mesh), _shard(off, mesh), ss)
    torch.testing.assert_close(got.cpu(), want.detach(), **TOL)
    (got * _shard(gout, mesh)).sum().backward()
    torch.testing.assert_close(sw.grad.cpu(), ref_w.grad, **TOL)
    if psw:
        torch.testing.assert_close(ss.grad.cpu(), ref_s.grad, **TOL)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_embedding_bag_uneven_replicated_weight(mesh):
    """Only the indices (and the bags' gradient) sharded: the weight gradient is a whole-table scatter."""
    mesh = _mesh(mesh)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(6, 3, generator=g)
    idx = torch.tensor([5, 1, 1, 0, 5, 5, 0, 1, 0])  # 9 indices over 8 or 4 devices; counts agree (above)
    off = torch.tensor([0, 2, 2, 5])
    for mode in ("sum", "mean", "max"):
        ref = _leaf(w, True)
        want = F.embedding_bag(idx, ref, off, mode=mode, scale_grad_by_freq=mode != "max")
        want.sum().backward()
        sw = _shard(w, mesh, sharded=False, grad=True)
        got = F.embedding_bag(_shard(idx, mesh), sw, _shard(off, mesh), mode=mode, scale_grad_by_freq=mode != "max")
        torch.testing.assert_close(got.cpu(), want.detach(), **TOL)
        got.sum().backward()
        torch.testing.assert_close(sw.grad.cpu(), ref.grad, **TOL)


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("n", [7, 13])
@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min", "prod"])
def test_segment_reduce_uneven(mesh, n, reduce):
    """The same segment scatters as embedding_bag's, over the data's (padded) first dimension."""
    mesh = _mesh(mesh)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 3, generator=g) - 3  # negative: a stray max(., 0) would show
    lengths = torch.tensor([2, 0, n - 5, 3])
    ref = _leaf(x, True)
    want = torch._segment_reduce(ref, reduce, lengths=lengths, unsafe=True)
    want.exp().sum().backward()
    sx = _shard(x, mesh, grad=True)
    got = torch._segment_reduce(sx, reduce, lengths=_shard(lengths, mesh, sharded=False), unsafe=True)
    torch.testing.assert_close(got.cpu(), want.detach(), equal_nan=True, **TOL)
    got.exp().sum().backward()
    torch.testing.assert_close(sx.grad.cpu(), ref.grad, equal_nan=True, **TOL)
