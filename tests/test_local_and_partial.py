"""DTensor's to_local / from_local and Partial values over shardtensor (one process: its block is the
whole tensor; tests/test_multihost.py runs them with two processes), each compared with plain torch."""

import pytest
import torch

import shardtensor as st
from shardtensor import Partial, Replicate, Shard


def _mesh42():
    return st.init_device_mesh("cpu", (4, 2), mesh_dim_names=("x", "y"))


def test_to_local_is_the_whole_value_in_one_process_with_autograd():
    t = torch.randn(8, 6)
    x = st.distribute_tensor(t, _mesh42(), [Shard(0), Shard(1)]).requires_grad_(True)
    local = x.to_local()
    assert type(local) is torch.Tensor and local.device.type == "cpu"
    torch.testing.assert_close(local, t, rtol=0, atol=0)
    (local**2).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), 2 * t)


def test_from_local_round_trip_shapes_and_errors():
    mesh = _mesh42()
    t = torch.arange(30.0).reshape(5, 6)  # uneven over x
    for placements in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Replicate(), Replicate()]):
        x = st.ShardedTensor.from_local(t, mesh, placements)
        assert x.shape == t.shape and x.placements == tuple(placements)
        torch.testing.assert_close(x.full_tensor(), t, rtol=0, atol=0)
        torch.testing.assert_close(x.to_local(), t, rtol=0, atol=0)
    assert st.from_local(t, mesh, [Shard(0), Replicate()], shape=(5, 6), stride=(6, 1)).shape == (5, 6)
    assert st.from_local(torch.ones(2, dtype=torch.int64), mesh).dtype == torch.int64
    with pytest.raises(ValueError, match=r"has shape \(5, 6\).*block of shape \(7, 6\) of the global shape \(7, 6\)"):
        st.from_local(t, mesh, [Shard(0), Replicate()], shape=(7, 6))
    with pytest.raises(ValueError, match="contiguously"):
        st.from_local(t, mesh, [Shard(0), Replicate()], stride=(1, 5))
    with pytest.raises(TypeError, match="CPU torch.Tensor"):
        st.from_local(st.distribute_tensor(t, mesh), mesh)
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        st.from_local(t, mesh, [Shard(0)])


def test_from_local_gradient_reaches_the_local_tensor():
    local = torch.randn(8, 4, requires_grad=True)
    x = st.from_local(local, _mesh42(), [Shard(0), Replicate()])
    (x * x).sum().backward()
    torch.testing.assert_close(local.grad, 2 * local.detach())


def test_partial_from_local_resolves_on_read_and_redistributes_by_all_reduce():
    mesh = _mesh42()
    local = torch.randn(8, 6)
    p = st.from_local(local, mesh, [Partial(), Replicate()])  # one process: its summand is the value
    assert p.placements == (Partial(), Replicate()) and p.device_mesh == mesh
    torch.testing.assert_close(p.to_local(), local, rtol=0, atol=0)
    torch.testing.assert_close(p.full_tensor(), local, rtol=0, atol=0)
    torch.testing.assert_close((p * 2).cpu(), local * 2)  # an op reads the value
    for target in ([Replicate(), Replicate()], [Shard(0), Replicate()], [Shard(1), Shard(0)]):
        y = p.redistribute(mesh, target)
        assert y.placements == tuple(target)
        torch.testing.assert_close(y.full_tensor(), local, rtol=0, atol=0)


def test_partial_sum_and_avg_against_torch_sums():
    mesh = _mesh42()
    t = torch.randn(4, 6)
    # DTensor's distribute_tensor(t, mesh, [Partial()]): each device along x holds t / 4
    p = st.distribute_tensor(t, mesh, [Partial(), Shard(1)])
    pieces = {(s.indices[1].start, s.device): s.unpadded_data for s in p.local_shards}
    for piece in pieces.values():
        assert piece.shape == (4, 3)
    summed = sum(s.unpadded_data for s in p.local_shards if s.indices[1].start == 0)
    torch.testing.assert_close(summed, t[:, :3])  # the 4 summands of the first column block
    torch.testing.assert_close(p.redistribute(mesh, [Replicate(), Replicate()]).full_tensor(), t)
    a = st.distribute_tensor(t, mesh, [Replicate(), Partial("avg")])
    assert all(torch.equal(s.unpadded_data, t) for s in a.local_shards)
    torch.testing.assert_close(a.redistribute(mesh, [Replicate(), Shard(0)]).full_tensor(), t)
    b = st.from_local(t, mesh, [Partial("avg"), Shard(-1)])  # one process: its summand is the mean
    torch.testing.assert_close(b.to_local(), t)
    b01 = b.redistribute(mesh, [Shard(-2), Shard(-1)])
    assert b01.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(b01.full_tensor(), t)
    # two partial axes, one reduced at a time
    q = st.distribute_tensor(t, mesh, [Partial(), Partial()])
    q1 = q.redistribute(mesh, [Partial(), Shard(0)])
    assert q1.placements == (Partial(), Shard(0))
    torch.testing.assert_close(q1.full_tensor(), t)
    torch.testing.assert_close(q1.redistribute(mesh, [Replicate(), Shard(0)]).full_tensor(), t)
    assert q.redistribute(mesh, [Partial(), Partial()]) is q
    # a partial axis kept, another axis moving: the summands are laid out anew, none reduced
    r = st.distribute_tensor(t, mesh, [Partial(), Replicate()]).redistribute(mesh, [Partial(), Shard(0)])
    assert r.placements == (Partial(), Shard(0))
    torch.testing.assert_close(r.full_tensor(), t)
    u = torch.randn(5, 3)  # uneven over x
    torch.testing.assert_close(
        st.distribute_tensor(u, mesh, [Partial(), Replicate()]).redistribute(mesh, [Shard(0), Shard(1)]).full_tensor(),
        u,
    )


def test_partial_redistribute_is_an_all_reduce_or_a_reduce_scatter():
    mesh = st.init_device_mesh("cpu", (8,), mesh_dim_names=("x",))
    t = torch.randn(16, 4)
    p = st.distribute_tensor(t, mesh, [Partial()])

    def collectives(y):
        return {kind: c.count for kind, c in st.explain(y).collectives.items() if c.count}

    assert collectives(p.redistribute(mesh, [Replicate()])) == {"all-reduce": 1}
    assert collectives(p.redistribute(mesh, [Shard(0)])) == {"reduce-scatter": 1}
    # 4 columns over 8 devices: XLA's padded layout, an all-reduce and a slice
    assert collectives(p.redistribute(mesh, [Shard(1)])) == {"all-reduce": 1}
    torch.testing.assert_close(p.redistribute(mesh, [Shard(0)]).full_tensor(), t)
    del p  # (its value is pending, as any lazy result: one pending graph uses one mesh)
    mesh42 = _mesh42()
    a = st.distribute_tensor(t, mesh42, [Partial("avg"), Shard(1)])
    y = a.redistribute(mesh42, [Shard(0), Shard(1)])
    assert collectives(y) == {"reduce-scatter": 1}
    torch.testing.assert_close(y.full_tensor(), t)


def test_partial_in_lazy_step_compile_and_autograd():
    mesh = _mesh42()
    t = torch.randn(8, 6)
    p = st.distribute_tensor(t, mesh, [Partial(), Replicate()]).requires_grad_(True)
    with st.step():
        y = p.redistribute(mesh, [Shard(0), Replicate()]) * 3
    torch.testing.assert_close(y.cpu(), t * 3)
    y.sum().backward()
    torch.testing.assert_close(p.grad.cpu(), torch.full_like(t, 3.0))

    @st.compile
    def doubled(a):
        return a.redistribute(mesh, [Replicate(), Replicate()]) * 2

    q = st.distribute_tensor(t, mesh, [Partial(), Replicate()])
    torch.testing.assert_close(doubled(q).cpu(), t * 2)


def test_partial_in_place_change_and_errors():
    mesh = _mesh42()
    t = torch.ones(4, 2)
    p = st.distribute_tensor(t, mesh, [Partial(), Replicate()])
    p.add_(1)  # the value changed: an ordinary tensor now
    assert Partial() not in p.placements
    torch.testing.assert_close(p.cpu(), t + 1)
    with pytest.raises(NotImplementedError, match="Partial\\('max'\\) is not supported"):
        st.distribute_tensor(t, mesh, [Partial("max"), Replicate()])
    with pytest.raises(ValueError, match="mix Partial reduce ops"):
        st.distribute_tensor(t, mesh, [Partial(), Partial("avg")])
    with pytest.raises(TypeError, match="floating-point"):
        st.distribute_tensor(torch.ones(4, dtype=torch.int32), mesh, [Partial(), Replicate()])
    with pytest.raises(TypeError, match="floating-point"):
        st.from_local(torch.ones(4, dtype=torch.int32), mesh, [Partial("avg"), Replicate()])
    q = st.distribute_tensor(t, mesh, [Partial(), Replicate()])
    with pytest.raises(st.ShardingSpecError, match="keeps its reduce op"):
        q.redistribute(mesh, [Partial("avg"), Replicate()])
    with pytest.raises(st.ShardingSpecError, match="becomes partial only"):
        st.distribute_tensor(t, mesh).redistribute(mesh, [Replicate(), Partial()])
    with pytest.raises(ValueError, match="its own mesh"):
        q.redistribute(st.init_device_mesh("cpu", (8,)), [Replicate()])
    scalar = st.distribute_tensor(torch.tensor(3.0), mesh, [Partial(), Replicate()])
    assert scalar.to_local().shape == () and scalar.redistribute(mesh, [Replicate(), Replicate()]).item() == 3.0
    ints = st.from_local(torch.arange(4), mesh, [Partial(), Replicate()])  # a sum of integers is exact
    assert ints.dtype == torch.int64 and ints.cpu().tolist() == [0, 1, 2, 3]
