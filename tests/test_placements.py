"""DTensor's placements over shardtensor: Shard/Replicate/Partial <-> PartitionSpec, distribute_tensor,
and a ShardedTensor's .placements, .device_mesh, .full_tensor() and .redistribute()."""

import warnings

import pytest
import torch

import shardtensor as st
from shardtensor import P, Partial, Replicate, Shard


def _mesh(shape, names):
    return st.init_device_mesh("cpu", shape, mesh_dim_names=names)


# (mesh shape, axis names, placements, spec) for a 3-D tensor, both ways
ROUND_TRIPS = [
    ((8,), ("x",), [Shard(0)], P("x", None, None)),
    ((8,), ("x",), [Replicate()], P(None, None, None)),
    ((8,), ("x",), [Shard(2)], P(None, None, "x")),
    ((4, 2), ("x", "y"), [Shard(0), Replicate()], P("x", None, None)),
    ((4, 2), ("x", "y"), [Replicate(), Shard(1)], P(None, "y", None)),
    ((4, 2), ("x", "y"), [Shard(1), Shard(0)], P("y", "x", None)),
    ((4, 2), ("x", "y"), [Shard(0), Shard(0)], P(("x", "y"), None, None)),
    ((2, 2, 2), ("a", "b", "c"), [Shard(0), Replicate(), Shard(2)], P("a", None, "c")),
    ((2, 2, 2), ("a", "b", "c"), [Shard(1), Replicate(), Shard(1)], P(None, ("a", "c"), None)),
    ((2, 2, 2), ("a", "b", "c"), [Shard(2), Shard(2), Shard(2)], P(None, None, ("a", "b", "c"))),
    ((2, 2, 2), ("a", "b", "c"), [Replicate()] * 3, P(None, None, None)),
]


@pytest.mark.parametrize("shape, names, placements, spec", ROUND_TRIPS)
def test_conversions_both_ways(shape, names, placements, spec):
    mesh = _mesh(shape, names)
    assert st.placements_to_spec(placements, mesh, 3) == spec
    assert st.spec_to_placements(mesh, spec, 3) == tuple(placements)


def test_negative_dim_and_unnamed_mesh():
    mesh = st.Mesh(range(8), (4, 2))
    assert st.placements_to_spec([Shard(-1), Shard(0)], mesh, 2) == P(1, 0)
    assert st.spec_to_placements(mesh, (None, (0, 1)), 2) == (Shard(1), Shard(1))


def test_reprs_and_equality():
    assert repr(Shard(1)) == "Shard(dim=1)" and repr(Replicate()) == "Replicate()" and repr(Partial()) == "Partial(sum)"
    assert Shard(1) == Shard(1) and Shard(1) != Shard(0) and Replicate() == Replicate() and Partial() != Partial("max")
    assert len({Shard(0), Shard(0), Replicate()}) == 2  # frozen: hashable
    assert Shard(0).is_shard(0) and not Shard(0).is_shard(1) and Replicate().is_replicate() and Partial().is_partial()


def test_errors():
    mesh = _mesh((4, 2), ("x", "y"))
    with pytest.raises(st.ShardingSpecError, match="partial value exists only as a partial tensor"):
        st.placements_to_spec([Partial(), Replicate()], mesh, 2)
    with pytest.raises(st.ShardingSpecError, match="out of range for a tensor with 2"):
        st.placements_to_spec([Shard(2), Replicate()], mesh, 2)
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        st.placements_to_spec([Shard(0)], mesh, 2)
    with pytest.raises(TypeError, match="st.Shard"):
        st.placements_to_spec([0, Replicate()], mesh, 2)
    with pytest.raises(st.ShardingSpecError, match="_StridedShard"):
        st.spec_to_placements(mesh, (("y", "x"), None), 2)  # minor axis first: not plain placements
    with pytest.raises(st.ShardingSpecError):
        st.spec_to_placements(mesh, ("z", None), 2)
    with pytest.raises(ValueError, match="reduce_op"):
        Partial("mean")
    with pytest.raises(TypeError, match="int dimension"):
        Shard("0")
    with pytest.raises(TypeError, match="st.Mesh"):
        st.distribute_tensor(torch.ones(4), "not a mesh", [Replicate()])


def test_distribute_full_tensor_and_redistribute():
    mesh = _mesh((4, 2), ("x", "y"))
    t = torch.randn(8, 6)
    x = st.distribute_tensor(t, mesh, [Shard(0), Shard(1)])
    assert x.placements == (Shard(0), Shard(1)) and x.device_mesh == mesh
    assert x.partition_spec == P("x", "y")
    full = x.full_tensor()
    assert type(full) is torch.Tensor
    torch.testing.assert_close(full, t, rtol=0, atol=0)
    for target in ([Replicate(), Replicate()], [Replicate(), Shard(0)], [Shard(1), Shard(1)], [Shard(1), Replicate()]):
        y = x.redistribute(mesh, target)
        assert y.placements == tuple(target)
        torch.testing.assert_close(y.full_tensor(), t, rtol=0, atol=0)
        assert {s.unpadded_data.shape for s in y.local_shards} == {tuple(t[s.indices].shape) for s in y.local_shards}
    torch.testing.assert_close((x.redistribute(mesh, [Replicate(), Shard(0)]) * 2).cpu(), t * 2)
    assert x.placements == (Shard(0), Shard(1))  # redistribute made a new tensor
    with pytest.raises(st.ShardingSpecError, match="Redistribute it"):
        x.redistribute(mesh, [Partial(), Replicate()])


def test_redistribute_to_another_mesh_and_defaults():
    t = torch.arange(16.0).reshape(4, 4)
    x = st.distribute_tensor(t, _mesh((4, 2), ("x", "y")), [Shard(0), Replicate()])
    mesh8 = _mesh((8,), ("z",))
    y = x.redistribute(mesh8, [Shard(1)])
    assert y.device_mesh == mesh8 and y.placements == (Shard(1),)
    torch.testing.assert_close(y.full_tensor(), t, rtol=0, atol=0)
    assert x.redistribute().placements == (Shard(0), Replicate())
    assert st.distribute_tensor(t, mesh8).placements == (Replicate(),)


def test_placements_of_shard_and_computed_tensors():
    mesh = _mesh((2, 2, 2), ("a", "b", "c"))
    x = st.shard(torch.ones(4, 8), mesh, (None, ("a", "c")))
    assert x.placements == (Shard(1), Replicate(), Shard(1))
    y = x * 3  # XLA chose its layout: derived from the jax array
    assert y.device_mesh.mesh_shape == (2, 2, 2)
    assert len(y.placements) == 3
    torch.testing.assert_close(y.full_tensor(), torch.full((4, 8), 3.0))


def test_redistribute_keeps_autograd():
    t = torch.randn(8, 4)
    mesh = _mesh((4, 2), ("x", "y"))
    x = st.distribute_tensor(t, mesh, [Shard(0), Shard(1)]).requires_grad_(True)
    y = x.redistribute(mesh, [Replicate(), Shard(0)])
    assert y.requires_grad and y.placements == (Replicate(), Shard(0))
    (y * y).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), 2 * t)


def test_full_tensor_keeps_autograd():
    t = torch.randn(8, 4)
    x = st.distribute_tensor(t, _mesh((8,), ("x",)), [Shard(0)]).requires_grad_(True)
    (x.full_tensor() ** 2).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), 2 * t)


def test_local_shard_renamed_with_deprecated_alias():
    from shardtensor.tensor import LocalShard

    x = st.shard(torch.ones(8), _mesh((8,), ("x",)), ("x",))
    assert all(isinstance(s, LocalShard) for s in x.local_shards) and st.LocalShard is LocalShard
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from shardtensor.tensor import Shard as OldShard
        from shardtensor.tensor.sharded import Shard as OlderShard
    assert OldShard is LocalShard and OlderShard is LocalShard
    # (a package's `from ... import` looks the name up twice: hasattr, then getattr)
    assert {(w.category, str(w.message).split(" was")[0]) for w in caught} == {
        (DeprecationWarning, "shardtensor.tensor.Shard"),
        (DeprecationWarning, "shardtensor.tensor.sharded.Shard"),
    }
    assert st.Shard is Shard and st.Shard is not LocalShard


def test_redistribute_inside_compile_and_a_lazy_step():
    mesh = _mesh((4, 2), ("x", "y"))
    t = torch.randn(8, 6)
    x = st.distribute_tensor(t, mesh, [Shard(0), Shard(1)])

    @st.compile
    def twice_replicated_over_x(a):
        return a.redistribute(mesh, [Replicate(), Shard(0)]) * 2

    y = twice_replicated_over_x(x)
    assert y.placements == (Replicate(), Shard(0))
    torch.testing.assert_close(y.full_tensor(), t * 2)
    with st.step():
        z = (x + 1).redistribute(mesh, [Shard(1), Replicate()])
    assert z.placements == (Shard(1), Replicate())
    torch.testing.assert_close(z.full_tensor(), t + 1)
