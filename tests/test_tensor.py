"""ShardedTensor (issue 2, section 5): creation from every source, sharding annotations, properties,
conversions, repr, clone/deepcopy, torch.save, the torch device, mixing with CPU values, errors.

Every numeric result is compared with eager PyTorch on CPU.
"""

import copy
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as JaxP
from torch.testing import assert_close

import shardtensor as st
from shardtensor import sharding as shmath
from tensor_helpers import MESH_42, MESHES, SPECS_2D, check_cover, isolate_lazy_graph, mode, modes

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _isolate():
    yield
    isolate_lazy_graph()


def s(a, b):
    return slice(a, b, 1)


def by_device(x):
    return {int(sh.device.split(":")[1]): sh for sh in x.local_shards}


# =========================================================================== st.shard: every source


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("shape", [(8, 4), (7, 5), (3, 1)], ids=str)
def test_shard_torch_cpu_roundtrip(mesh_name, shape):
    mesh = MESHES[mesh_name]
    t = torch.randn(*shape)
    x = st.shard(t, mesh, SPECS_2D[mesh_name])
    assert isinstance(x, st.ShardedTensor)
    assert x.device == st.device()
    assert x.shape == t.shape and x.dtype == t.dtype
    assert_close(x.cpu(), t, rtol=0, atol=0)
    check_cover(x, t)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
    ],
    ids=str,
)
def test_shard_keeps_every_dtype_exactly(dtype):
    base = torch.tensor([[0, 1, -2, 3, 2**20 + 1], [5, -6, 7, 8, 9], [1, 0, 1, 0, 1]])
    if dtype == torch.bool:
        t = base % 2 == 1
    elif dtype == torch.uint8:
        t = base.abs().to(dtype)
    elif dtype.is_complex:
        t = torch.complex(base.float(), -base.float())
    else:
        t = base.to(dtype)
    x = st.shard(t, MESH_42, ("x", "y"))
    out = x.cpu()
    assert out.dtype == dtype
    assert torch.equal(out, t)


def test_int64_and_float64_are_exact():
    t = torch.tensor([2**62 + 1, -(2**61) - 3, 7])
    x = st.shard(t, MESH_42, ("x",))
    assert x.tolist() == t.tolist()
    assert (x + 1).tolist() == (t + 1).tolist()
    f = torch.tensor([1 / 3, 1e-300, 2.0**60 + 1], dtype=torch.float64)
    y = st.shard(f, MESH_42, ("y",))
    assert torch.equal((y * 3).cpu(), f * 3)


def test_shard_from_numpy():
    a = np.arange(35, dtype=np.int32).reshape(7, 5)
    x = st.shard(a, MESH_42, ("x", "y"))
    assert x.dtype == torch.int32 and x.shape == (7, 5)
    assert torch.equal(x.cpu(), torch.from_numpy(a))
    check_cover(x, torch.from_numpy(a))
    f = np.linspace(0, 1, 12, dtype=np.float64).reshape(3, 4)
    y = st.shard(f, MESH_42, (None, "x"))
    assert y.dtype == torch.float64
    assert torch.equal(y.cpu(), torch.from_numpy(f))


def test_shard_from_numpy_scalar_and_0d():
    x = st.shard(np.float32(2.5), MESH_42, ())
    assert x.shape == () and x.dtype == torch.float32 and x.item() == 2.5
    y = st.shard(np.array(3, dtype=np.int64), MESH_42, ())
    assert y.item() == 3 and y.dtype == torch.int64


def test_shard_from_jax_array_on_one_device():
    a = jnp.arange(30, dtype=jnp.float32).reshape(6, 5)
    x = st.shard(a, MESH_42, ("x", "y"))
    t = torch.arange(30, dtype=torch.float32).reshape(6, 5)
    assert torch.equal(x.cpu(), t)
    check_cover(x, t)
    assert x.sharding_spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"


def test_shard_from_sharded_jax_array():
    jm = MESH_42.get_jax_mesh()
    a = jax.device_put(jnp.arange(64, dtype=jnp.bfloat16).reshape(8, 8), NamedSharding(jm, JaxP("y", "x")))
    x = st.shard(a, MESH_42, ("x", None))
    assert x.dtype == torch.bfloat16
    t = torch.arange(64, dtype=torch.bfloat16).reshape(8, 8)
    assert torch.equal(x.cpu(), t)
    check_cover(x, t)


def test_shard_from_sharded_tensor_reshards_and_leaves_source():
    t = torch.randn(7, 6)
    src = st.shard(t, MESH_42, ("x", "y"))
    x = st.shard(src, MESH_42, ("y", "x"))
    assert x is not src
    assert x.sharding_spec == "{devices=[2,4]0,2,4,6,1,3,5,7}"
    assert src.sharding_spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    assert_close(x.cpu(), t)
    assert_close(src.cpu(), t)
    check_cover(x, t)
    x.add_(1)  # a new tensor, not an alias of the source
    assert_close(src.cpu(), t)
    assert_close(x.cpu(), t + 1)


def test_shard_from_pending_and_view_sharded_tensor():
    t = torch.randn(5, 6)
    src = st.shard(t, MESH_42, ("x", None))
    pending = src * 2  # lazy: not computed yet
    x = st.shard(pending, MESH_42, (None, "y"))
    assert_close(x.cpu(), t * 2)
    check_cover(x, t * 2)
    v = st.shard(src.t(), MESH_42, ("y", "x"))
    assert v.shape == (6, 5)
    assert_close(v.cpu(), t.t())
    check_cover(v, t.t())


def test_shard_from_other_mesh_sharded_tensor():
    t = torch.randn(8, 8)
    a = st.shard(t, MESHES["2x2x2"], ("x", ("y", "z")))
    b = st.shard(a, MESHES["8"], (None, "x"))
    assert_close(b.cpu(), t)
    assert b.mesh == MESHES["8"]
    check_cover(b, t)


OTHER_MESH = st.Mesh(list(reversed(range(8))), (4, 2), ("x", "y"))


@modes()
def test_in_place_op_across_two_meshes_is_refused_and_the_target_kept(eager):
    """Issue 11 §6: writing into a tensor a value computed from data sharded over another mesh raises
    at once, naming both meshes and the way out, and the target keeps its value; non-in-place ops
    across meshes raise when computed, and leave their inputs readable."""
    ta, tb = torch.randn(8, 2), torch.randn(8, 2)
    with mode(eager):
        a = st.shard(ta, MESHES["8"], ("x", None))
        b = st.shard(tb, OTHER_MESH, ("x", None))
        both = r"(?s)devices \[0\.\.7\], shape \(8,\).*devices \[7, 6, 5, 4, 3, 2, 1, 0\], shape \(4, 2\).*st\.shard"
        for write in (lambda: a.add_(b), lambda: a.mul_(b * 2 + 1), lambda: a.copy_(b), lambda: a[1:].sub_(b[1:])):
            with pytest.raises(ValueError, match=both):
                write()
            assert_close(a.cpu(), ta)
        # a foreach op whose targets are pending results of one node: the node's inputs are looked at once
        # for all targets, and an operand over the other mesh is still refused
        targets = list((a * 1).unbind(1))
        with pytest.raises(ValueError, match=both):
            torch._foreach_add_(targets, [b[:, 0] * 2, b[:, 1] * 2])
        torch._foreach_add_(targets, [a[:, 0], a[:, 1]])
        assert_close(torch.stack(targets, 1).cpu(), 2 * ta)
        with pytest.raises(ValueError, match="different meshes"):
            (a + b).cpu()
        assert_close(a.cpu(), ta)
        assert_close(b.cpu(), tb)
        a.add_(st.shard(b, a.mesh, a.partition_spec))  # the way out: reshard through the host
        a.add_(st.shard(tb, OTHER_MESH, (None, None)))  # replicated data joins any mesh
        assert_close(a.cpu(), ta + 2 * tb)
        assert a.sharding_spec == "{devices=[8,1]0,1,2,3,4,5,6,7}"


def test_shard_keeps_requires_grad():
    t = torch.randn(4, 4, requires_grad=True)
    x = st.shard(t, MESH_42, ("x", "y"))
    assert x.requires_grad and x.is_leaf
    (x * 3).sum().backward()
    assert_close(x.grad.cpu(), torch.full((4, 4), 3.0))


def test_each_device_holds_only_its_padded_shard():
    t = torch.randn(10, 3)
    x = st.shard(t, MESH_42, ("x", "y"))
    expected = {p.device_id: p for p in shmath.placements((10, 3), MESH_42, ("x", "y"))}
    for dev, shard in by_device(x).items():
        assert tuple(shard.data.shape) == tuple(expected[dev].padded_shape) == (3, 2)
        assert shard.indices == expected[dev].indices
        assert shard.replica_id == expected[dev].replica_id
    # the stored array itself is sharded: every device buffer is one padded shard, not the whole tensor
    arr = x._cell.value
    assert {tuple(b.data.shape) for b in arr.addressable_shards} == {(3, 2)}


@pytest.mark.parametrize("spec", [("x", None), (None, None)])
def test_upload_owns_its_buffers_and_the_host_tensor_stays_the_callers(spec):
    """Device buffers hold the upload's own aligned copy (which jax's CPU client keeps without a
    second copy; replicas of a wholly replicated upload may share it, read-only): later in-place
    changes of the CPU tensor do not show through, and a program that donates the upload leaves the
    host tensor and every replica right."""
    from shardtensor.tensor.upload import private_copy

    t = torch.arange(64 * 1024.0).reshape(1024, 64)  # large enough for its own 64-byte aligned block
    copy_ = private_copy(t.numpy()[3:5])
    assert copy_.ctypes.data % 64 == 0 and np.array_equal(copy_, t.numpy()[3:5]) and copy_.flags.c_contiguous
    expected = t.clone()
    x = st.shard(t, MESH_42, spec)
    t.mul_(-1)
    assert_close(x.cpu(), expected, rtol=0, atol=0)
    assert t.data_ptr() not in [b.data.unsafe_buffer_pointer() for b in x._cell.value.addressable_shards]
    x.add_(1)  # (a program that may donate the upload)
    assert_close(x.cpu(), expected + 1, rtol=0, atol=0)
    for shard in by_device(x).values():
        assert torch.equal(shard.data, (expected + 1)[shard.indices])
    assert_close(t, -expected, rtol=0, atol=0)


# =========================================================================== the issue's exact facts


def test_issue_facts_x_y():
    t = torch.arange(32.0).reshape(8, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    assert x.sharding_spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    assert x.partition_spec == st.P("x", "y")
    assert x.mesh is MESH_42 or x.mesh == MESH_42
    d3 = by_device(x)[3]
    assert d3.indices == (s(2, 4), s(2, 4))
    assert tuple(d3.data.shape) == (2, 2)
    assert torch.equal(d3.data, t[2:4, 2:4])
    check_cover(x, t)


def test_issue_facts_y_x():
    t = torch.arange(32.0).reshape(8, 4)
    x = st.shard(t, MESH_42, ("y", "x"))
    assert x.sharding_spec == "{devices=[2,4]0,2,4,6,1,3,5,7}"
    d3 = by_device(x)[3]
    assert d3.indices == (s(4, 8), s(1, 2))
    assert torch.equal(d3.unpadded_data, t[4:8, 1:2])
    check_cover(x, t)


def test_issue_facts_x_none_partial_replication():
    t = torch.arange(32.0).reshape(8, 4)
    x = st.shard(t, MESH_42, ("x", None))
    assert x.sharding_spec == "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
    shards = by_device(x)
    for k in range(4):
        for replica, dev in enumerate((2 * k, 2 * k + 1)):
            assert shards[dev].indices == (s(2 * k, 2 * k + 2), s(0, 4))
            assert shards[dev].replica_id == replica
            assert torch.equal(shards[dev].data, t[2 * k : 2 * k + 2])
    check_cover(x, t)


def test_issue_facts_replicated():
    t = torch.arange(32.0).reshape(8, 4)
    x = st.shard(t, MESH_42, (None, None))
    assert x.sharding_spec == "{replicated}"
    shards = x.local_shards
    assert sorted(sh.replica_id for sh in shards) == list(range(8))
    for sh in shards:
        assert torch.equal(sh.unpadded_data, t)
    check_cover(x, t)


def test_issue_facts_16_vector_on_2x4():
    mesh = st.Mesh(range(8), (2, 4), ("x", "y"))
    t = torch.arange(16.0)
    a = st.shard(t, mesh, (("x", "y"),))
    b = st.shard(t, mesh, (("y", "x"),))
    assert a.sharding_spec == "{devices=[8]0,1,2,3,4,5,6,7}"
    assert b.sharding_spec == "{devices=[8]0,4,1,5,2,6,3,7}"
    check_cover(a, t)
    check_cover(b, t)
    # device order 0,4,1,5,...: device 4 holds the second pair of elements
    assert torch.equal(by_device(b)[4].data, t[2:4])


def test_issue_facts_10_vector_on_4_devices():
    t = torch.arange(10.0) + 1
    x = st.shard(t, MESH_42, ("x",))
    shards = by_device(x)
    expected = [s(0, 3), s(3, 6), s(6, 9), s(9, 10)]
    for k in range(4):
        for dev in (2 * k, 2 * k + 1):
            assert shards[dev].indices == (expected[k],)
            assert tuple(shards[dev].data.shape) == (3,)
    assert torch.equal(shards[6].unpadded_data, t[9:10])
    assert tuple(shards[6].unpadded_data.shape) == (1,)  # + 2 padding
    assert torch.equal(x.cpu(), t)
    check_cover(x, t)


def test_issue_facts_5_vector_on_4_devices_has_an_all_padding_shard():
    t = torch.arange(5.0) + 1
    x = st.shard(t, MESH_42, ("x",))
    shards = by_device(x)
    assert shards[0].indices == (s(0, 2),)
    assert shards[2].indices == (s(2, 4),)
    assert shards[4].indices == (s(4, 5),)
    assert tuple(shards[4].unpadded_data.shape) == (1,)
    assert tuple(shards[6].data.shape) == (2,)  # all padding
    assert shards[6].unpadded_data.numel() == 0
    assert torch.equal(x.cpu(), t)
    check_cover(x, t)


# =========================================================================== mark_sharding


def test_mark_sharding_returns_t_and_same_spec_is_a_noop():
    t = torch.randn(8, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    before = x._cell.value
    assert st.mark_sharding(x, MESH_42, ("x", "y")) is x
    assert st.mark_sharding(x, MESH_42, st.P("x", "y")) is x
    assert st.mark_sharding(x, MESH_42, (0, 1)) is x  # axis indices name the same axes
    assert x._cell.value is before  # no data moved
    assert_close(x.cpu(), t)


def test_mark_sharding_replicated_to_sharded():
    t = torch.randn(7, 5)
    x = st.shard(t, MESH_42, (None, None))
    assert st.mark_sharding(x, MESH_42, ("x", "y")) is x
    assert x.sharding_spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    assert x.partition_spec == st.P("x", "y")
    assert_close(x.cpu(), t)
    check_cover(x, t)


def test_mark_sharding_on_device_tensor_without_annotation():
    t = torch.randn(6, 4)
    x = t.to(st.device())
    st.sync()
    st.mark_sharding(x, MESH_42, (None, "x"))
    assert x.sharding_spec == "{devices=[1,4,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
    assert_close(x.cpu(), t)
    check_cover(x, t)


def test_mark_sharding_other_spec_on_computed_tensor_raises():
    t = torch.randn(8, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    with pytest.raises(RuntimeError, match="clear_sharding"):
        st.mark_sharding(x, MESH_42, ("y", "x"))
    # nothing changed
    assert x.sharding_spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    assert_close(x.cpu(), t)
    # a computed (synced) result that the user annotated counts too
    y = x * 2
    st.mark_sharding(y, MESH_42, ("y", None))
    st.sync()
    with pytest.raises(RuntimeError, match="clear_sharding"):
        st.mark_sharding(y, MESH_42, (None, "x"))


def test_mark_sharding_on_pending_tensor_adds_a_constraint():
    t = torch.randn(8, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    y = x * 2 + 1  # pending in lazy mode
    runs = st.counter_value("ExecuteReplicated") or 0
    assert st.mark_sharding(y, MESH_42, ("y", "x")) is y
    assert (st.counter_value("ExecuteReplicated") or 0) == runs  # nothing ran: a constraint was added
    assert y.sharding_spec == "{devices=[2,4]0,2,4,6,1,3,5,7}"
    assert_close(y.cpu(), t * 2 + 1)  # the value is unchanged
    assert y.sharding_spec == "{devices=[2,4]0,2,4,6,1,3,5,7}"
    check_cover(y, t * 2 + 1)


def test_mark_sharding_on_pending_annotated_tensor_with_another_spec():
    t = torch.randn(8, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    y = x + 1
    st.mark_sharding(y, MESH_42, ("y", None))
    st.mark_sharding(y, MESH_42, ("x", "y"))  # still pending: another constraint, no error
    assert_close(y.cpu(), t + 1)
    assert y.sharding_spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    check_cover(y, t + 1)


def test_mark_sharding_on_pending_uneven_tensor():
    t = torch.randn(7, 3)
    x = st.shard(t, MESH_42, (None, None))
    y = x.exp()
    st.mark_sharding(y, MESH_42, ("x", "y"))
    assert_close(y.cpu(), t.exp())
    check_cover(y, y.cpu())
    assert_close((y - 1).cpu(), t.exp() - 1)


@pytest.mark.parametrize("keep_source", [True, False])
def test_sharded_factory_then_op_in_the_same_graph_stays_sharded(keep_source):
    """Issue 11 §6: zeros marked sharded then ``+ 1``, all pending: the result is sharded like its
    source (XLA propagates the constraint), not replicated (8x the memory), also when the source
    is gone before the graph runs."""
    z = torch.zeros(16, 4, device=st.device())
    st.mark_sharding(z, MESH_42, ("x", "y"))
    y = z + 1
    if not keep_source:
        del z
    st.sync()
    assert y.sharding_spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    assert {tuple(s.data.shape) for s in y.local_shards} == {(4, 2)}
    assert_close(y.cpu(), torch.zeros(16, 4) + 1)


def test_mark_sharding_in_eager_mode():
    t = torch.randn(6, 5)
    with st.eager_mode(True):
        x = st.shard(t, MESH_42, (None, None))
        y = x * 3
        st.mark_sharding(y, MESH_42, ("x", None))
        assert y.sharding_spec == "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
        assert_close(y.cpu(), t * 3)
        check_cover(y, t * 3)
        with pytest.raises(RuntimeError, match="clear_sharding"):
            st.mark_sharding(y, MESH_42, ("y", "x"))


def test_mark_sharding_then_compute_keeps_values():
    t = torch.randn(9, 6)
    x = st.shard(t, MESH_42, (None, None))
    st.mark_sharding(x, MESH_42, ("x", "y"))
    w = torch.randn(6, 3)
    assert_close((x @ st.shard(w, MESH_42, ("y", None))).cpu(), t @ w, rtol=1e-5, atol=1e-5)


def test_mark_sharding_of_computed_tensor_emits_no_warning():
    # Moving a computed tensor's data is an ordinary operation: it must not warn the user about
    # unusable donated buffers (an implementation detail).
    x = st.shard(torch.randn(8, 4), MESH_42, (None, None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st.mark_sharding(x, MESH_42, ("x", "y"))
        x.cpu()


# =========================================================================== clear_sharding


def test_clear_sharding_then_mark_another_spec():
    t = torch.randn(8, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    assert st.clear_sharding(x) is x
    assert x.partition_spec is None
    assert x.mesh is None
    # The annotation is gone; the string is either empty (PyTorch/XLA) or the layout the data has.
    assert x.sharding_spec in ("", "{devices=[4,2]0,1,2,3,4,5,6,7}")
    assert_close(x.cpu(), t)
    st.mark_sharding(x, MESH_42, ("y", "x"))
    assert x.sharding_spec == "{devices=[2,4]0,2,4,6,1,3,5,7}"
    assert_close(x.cpu(), t)
    check_cover(x, t)


def test_clear_sharding_uneven_then_remark():
    t = torch.arange(10.0)
    x = st.shard(t, MESH_42, ("x",))
    st.clear_sharding(x)
    assert x.partition_spec is None
    assert_close(x.cpu(), t)
    assert_close((x * 2).cpu(), t * 2)
    st.mark_sharding(x, MESH_42, (("x", "y"),))
    assert x.sharding_spec == "{devices=[8]0,1,2,3,4,5,6,7}"
    assert_close(x.cpu(), t)
    check_cover(x, t)


def test_clear_sharding_on_pending_tensor():
    t = torch.randn(8, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    y = x + 1
    st.mark_sharding(y, MESH_42, ("y", None))
    st.clear_sharding(y)
    assert y.partition_spec is None and y.mesh is None
    assert_close(y.cpu(), t + 1)


def test_clear_sharding_of_a_plain_tensor_raises():
    with pytest.raises(TypeError, match="ShardedTensor"):
        st.clear_sharding(torch.ones(3))


# =========================================================================== properties


def test_properties_of_sharded_tensor():
    x = st.shard(torch.randn(8, 4), MESH_42, ("x", None))
    assert x.mesh == MESH_42
    assert x.partition_spec == st.P("x", None)
    assert isinstance(x.partition_spec, st.PartitionSpec)
    assert x.sharding_spec == "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
    shard = x.local_shards[0]
    for field in ("data", "indices", "unpadded_data", "device", "replica_id"):
        assert hasattr(shard, field)
    assert isinstance(shard.data, torch.Tensor) and shard.data.device.type == "cpu"
    assert shard.device == "CPU:0"


def test_sharding_spec_of_computed_result_reflects_xla_choice():
    t = torch.randn(8, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    y = x * 2
    assert_close(y.cpu(), t * 2)
    assert y.partition_spec is None  # not annotated by the user
    spec = y.sharding_spec  # but computed: the sharding XLA chose
    assert spec.startswith("{") and spec.endswith("}")
    assert spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"  # elementwise ops keep the layout
    check_cover(y, t * 2)


def test_sharding_spec_of_reduced_result():
    t = torch.randn(8, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    r = x.sum()
    assert_close(r.cpu(), t.sum(), rtol=1e-5, atol=1e-5)
    assert r.sharding_spec == "{replicated}"
    check_cover(r, r.cpu())


def test_local_shards_of_a_view_and_of_a_computed_tensor():
    t = torch.randn(6, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    check_cover(x.t(), t.t())
    check_cover(x[1:5], t[1:5])
    check_cover(x + 1, t + 1)


# =========================================================================== conversions


def test_conversions_to_cpu_values():
    t = torch.randn(7, 5)
    x = st.shard(t, MESH_42, ("x", "y"))
    c = x.cpu()
    assert type(c) is torch.Tensor and c.device.type == "cpu"
    assert_close(c, t, rtol=0, atol=0)
    c2 = x.to("cpu")
    assert type(c2) is torch.Tensor and c2.device.type == "cpu"
    assert_close(c2, t, rtol=0, atol=0)
    c3 = x.to("cpu", torch.float64)
    assert c3.dtype == torch.float64 and c3.device.type == "cpu"
    assert_close(c3, t.double())
    c4 = x.to(device="cpu")
    assert_close(c4, t, rtol=0, atol=0)
    n = x.numpy()
    assert isinstance(n, np.ndarray) and n.dtype == np.float32
    np.testing.assert_array_equal(n, t.numpy())
    assert x.tolist() == t.tolist()
    assert x[2, 3].item() == t[2, 3].item()
    assert x.sum().item() == pytest.approx(t.sum().item(), rel=1e-5)


def test_dtype_conversion_stays_on_device():
    t = torch.randn(4, 3)
    x = st.shard(t, MESH_42, ("x", None))
    d = x.to(torch.float64)
    assert isinstance(d, st.ShardedTensor) and d.dtype == torch.float64
    assert_close(d.cpu(), t.double())
    assert_close(x.half().cpu(), t.half())
    assert torch.equal(x.int().cpu(), t.int())


def test_item_of_uneven_single_element():
    x = st.shard(torch.tensor([4.5]), MESH_42, ("x",))
    assert x.item() == 4.5
    assert isinstance(st.shard(torch.tensor(3), MESH_42, ()).item(), int)
    assert isinstance(st.shard(torch.tensor(True), MESH_42, ()).item(), bool)
    with pytest.raises(RuntimeError, match="cannot be converted to Scalar"):
        st.shard(torch.ones(3), MESH_42, ("x",)).item()


def test_cpu_copy_is_independent_of_device_value():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        for spec in ((None,), ("x",)):
            x = st.shard(torch.zeros(8, dtype=dtype), MESH_42, spec)
            c = x.cpu()
            c.add_(1)
            assert torch.equal(x.cpu(), torch.zeros(8, dtype=dtype)), (dtype, spec)
            x.local_shards[0].data.add_(5)
            assert torch.equal(x.cpu(), torch.zeros(8, dtype=dtype)), (dtype, spec)
            if dtype != torch.bfloat16:  # torch has no numpy() for bfloat16 either
                n = x.numpy()
                n += 1
                assert torch.equal(x.cpu(), torch.zeros(8, dtype=dtype)), (dtype, spec)


@pytest.mark.parametrize(
    "how", ["to_device", "shard_replicated", "shard_sharded", "shard_uneven", "numpy", "copy_into", "model_to"]
)
def test_device_value_does_not_alias_the_cpu_source(how):
    # Uploading copies: changing the CPU source afterwards must not change the device tensor.
    t = torch.zeros(8)
    if how == "to_device":
        x = t.to(st.device())
    elif how == "shard_replicated":
        x = st.shard(t, MESH_42, (None,))
    elif how == "shard_sharded":
        x = st.shard(t, MESH_42, ("x",))
    elif how == "shard_uneven":
        t = torch.zeros(7)
        x = st.shard(t, MESH_42, ("x",))
    elif how == "numpy":
        a = np.zeros(8, dtype=np.float32)
        x = st.shard(a, MESH_42, (("x", "y"),))
        t = torch.from_numpy(a)
    elif how == "copy_into":
        x = st.shard(torch.ones(8), MESH_42, ("x",))
        x.copy_(t)
    else:
        lin = torch.nn.Linear(8, 1, bias=False)
        with torch.no_grad():
            lin.weight.zero_()
        t = lin.weight.data
        lin.to(st.device())
        x = lin.weight
    want = t.clone()
    with torch.no_grad():
        t.add_(1)
    assert torch.equal(x.detach().cpu(), want)
    assert torch.equal((x.detach() + 0).cpu(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool], ids=str)
def test_cpu_of_0d_tensor_keeps_shape(dtype):
    t = torch.tensor(1.5).to(dtype)
    x = st.shard(t, MESH_42, ())
    assert x.cpu().shape == ()
    assert torch.equal(x.cpu(), t)
    v = st.shard(torch.ones(5, dtype=dtype), MESH_42, ("x",)).sum()  # a 0-dim result, e.g. a loss
    assert v.cpu().shape == () and v.shape == ()
    assert x.tolist() == t.tolist()


def test_cpu_of_view():
    t = torch.randn(6, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    assert_close(x.t().cpu(), t.t())
    assert_close(x[:, 1].cpu(), t[:, 1])
    assert_close(x.view(-1)[3:9].cpu(), t.view(-1)[3:9])


# =========================================================================== repr


def test_repr_shows_values_and_sharding():
    t = torch.arange(12.0).reshape(3, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    r = repr(x)
    assert repr(t) in r
    assert "sharding='{devices=[4,2]0,1,2,3,4,5,6,7}'" in r
    assert str(x) == r


def test_repr_of_computed_and_grad_tensors():
    t = torch.arange(6.0).reshape(2, 3)
    x = st.shard(t, MESH_42, (None, "y")).requires_grad_()
    assert "requires_grad=True" in repr(x)
    y = x * 2
    r = repr(y)
    assert repr((t * 2).detach()) in r.replace(", grad_fn=<MulBackward0>", "")
    assert "grad_fn=<MulBackward0>" in r
    assert "sharding=" in r
    z = st.shard(torch.tensor([1, 2, 3]), MESH_42, ("x",)) + 1  # computed, never annotated
    rz = repr(z)
    assert "tensor([2, 3, 4])" in rz and "sharding='{" in rz


def test_repr_of_view():
    t = torch.arange(12).reshape(3, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    assert repr(t.t()) in repr(x.t())


# =========================================================================== clone and deepcopy


@pytest.mark.parametrize("shape", [(8, 4), (7, 5)], ids=["even", "uneven"])
def test_clone_keeps_sharding(shape):
    t = torch.randn(*shape)
    x = st.shard(t, MESH_42, ("x", "y"))
    c = x.clone()
    assert c.sharding_spec == x.sharding_spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    assert c.partition_spec == x.partition_spec
    assert_close(c.cpu(), t)
    assert c.sharding_spec == x.sharding_spec
    check_cover(c, t)
    c.add_(1)  # a copy: the source does not change
    assert_close(x.cpu(), t)
    assert_close(c.cpu(), t + 1)


@pytest.mark.parametrize("like", ["zeros_like", "ones_like", "empty_like", "randn_like"])
def test_like_factories_keep_sharding(like):
    # optimizer state made with torch.zeros_like(param) is laid out like the parameter
    t = torch.randn(10, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    y = getattr(torch, like)(x)
    assert y.partition_spec == x.partition_spec
    assert y.sharding_spec == x.sharding_spec
    if like != "randn_like":
        assert_close(y.cpu(), getattr(torch, like)(t) if like != "empty_like" else torch.zeros_like(t))


@pytest.mark.parametrize("shape", [(8, 4), (7, 5)], ids=["even", "uneven"])
def test_deepcopy_keeps_sharding(shape):
    t = torch.randn(*shape)
    x = st.shard(t, MESH_42, ("y", "x"))
    d = copy.deepcopy(x)
    assert type(d) is type(x)
    assert d.sharding_spec == x.sharding_spec == "{devices=[2,4]0,2,4,6,1,3,5,7}"
    assert d.partition_spec == x.partition_spec and d.mesh == x.mesh
    assert_close(d.cpu(), t)
    check_cover(d, t)
    d.mul_(2)
    assert_close(x.cpu(), t)
    assert_close(d.cpu(), t * 2)


def test_deepcopy_memo_grad_and_module():
    t = torch.randn(4, 4)
    x = st.shard(t, MESH_42, ("x", "y")).requires_grad_()
    x.sum().backward()
    pair = copy.deepcopy({"a": x, "b": x})
    assert pair["a"] is pair["b"]
    assert pair["a"].requires_grad and pair["a"].is_leaf
    assert_close(pair["a"].grad.cpu(), torch.ones(4, 4))
    lin = torch.nn.Linear(4, 3).to(st.device())
    st.mark_sharding(lin.weight, MESH_42, ("x", "y"))
    lin2 = copy.deepcopy(lin)
    assert isinstance(lin2.weight, torch.nn.Parameter)
    assert lin2.weight.sharding_spec == lin.weight.sharding_spec
    assert_close(lin2.weight.cpu(), lin.weight.cpu())


# =========================================================================== torch.save


_LOAD_CHECK = """
    import sys, torch
    assert "shardtensor" not in sys.modules
    def walk(a, b, path):
        if isinstance(b, torch.Tensor):
            assert type(a) is type(b), (path, type(a))  # a Parameter loads as a CPU nn.Parameter
            assert a.device.type == "cpu", (path, a.device)
            assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a, b), path
            assert a.requires_grad == b.requires_grad, (path, a.requires_grad)
        elif isinstance(b, dict):
            assert list(a) == list(b), path
            for k in b:
                walk(a[k], b[k], path + "." + str(k))
        else:
            assert a == b, path
    args = sys.argv[1:]
    for got, want in zip(args[::2], args[1::2]):
        walk(torch.load(got, weights_only=True), torch.load(want, weights_only=True), got)
    assert "shardtensor" not in sys.modules
    print("OK")
"""


def _load_elsewhere(*paths):
    """Load each (saved, expected) pair of files in a fresh interpreter that never imports shardtensor."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_LOAD_CHECK), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd="/",
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr + r.stdout


def _save_tensor(tmp_path):
    t = torch.randn(7, 5)
    x = st.shard(t, MESH_42, ("x", "y"))
    torch.save(x, tmp_path / "x.pt")
    torch.save(t, tmp_path / "x_want.pt")
    back = torch.load(tmp_path / "x.pt", weights_only=True)  # and in this process too
    assert type(back) is torch.Tensor and torch.equal(back, t)
    return tmp_path / "x.pt", tmp_path / "x_want.pt"


def _save_state_dict(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3))
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.to(st.device())
    st.mark_sharding(model[0].weight, MESH_42, ("x", "y"))
    st.mark_sharding(model[2].weight, MESH_42, (None, "x"))
    sd = model.state_dict()
    assert all(isinstance(v, st.ShardedTensor) for v in sd.values())
    extra = {
        "uneven": st.shard(torch.arange(10.0), MESH_42, ("x",)),
        "bf16": st.shard(torch.arange(6, dtype=torch.bfloat16), MESH_42, ("y",)),
        "int": st.shard(torch.tensor([2**40, -1, 3]), MESH_42, ("x",)),
        "view": st.shard(torch.arange(12.0).reshape(3, 4), MESH_42, ("x", "y")).t(),
        "step": 7,
    }
    want_extra = {
        "uneven": torch.arange(10.0),
        "bf16": torch.arange(6, dtype=torch.bfloat16),
        "int": torch.tensor([2**40, -1, 3]),
        "view": torch.arange(12.0).reshape(3, 4).t().contiguous(),
        "step": 7,
    }
    torch.save({"model": sd, **extra}, tmp_path / "ck.pt")
    torch.save({"model": want, **want_extra}, tmp_path / "ck_want.pt")
    # loading back into a model on the device
    fresh = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3)).to(st.device())
    fresh.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=True)["model"])
    for k, v in fresh.state_dict().items():
        assert isinstance(v, st.ShardedTensor), k
        assert torch.equal(v.cpu(), want[k]), k
    return tmp_path / "ck.pt", tmp_path / "ck_want.pt"


def _save_parameter(tmp_path):
    p = torch.nn.Parameter(torch.randn(3, 2))
    want = torch.nn.Parameter(p.detach().clone())
    q = torch.nn.Parameter(st.shard(p.detach(), MESH_42, ("x", None)))
    assert q.requires_grad
    torch.save({"p": q}, tmp_path / "p.pt")
    torch.save({"p": want}, tmp_path / "p_want.pt")
    return tmp_path / "p.pt", tmp_path / "p_want.pt"


def test_torch_save_writes_plain_cpu_tensors_that_load_without_shardtensor(tmp_path):
    # A tensor, a state dict holding ShardedTensors (even, uneven, bfloat16, int64, a view) and a
    # Parameter; all checked in one fresh interpreter (torch.load(weights_only=True), no shardtensor).
    _load_elsewhere(*_save_tensor(tmp_path), *_save_state_dict(tmp_path), *_save_parameter(tmp_path))


# =========================================================================== the torch device


def test_model_to_device():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    out = model.to(st.device())
    assert out is model
    for name, p in model.named_parameters():
        assert isinstance(p, st.ShardedTensor), name
        assert isinstance(p, torch.nn.Parameter), name
        assert p.requires_grad and p.is_leaf, name
        assert p.device == st.device()
        assert_close(p.cpu(), dict(ref.named_parameters())[name].detach())
        assert p.sharding_spec in ("", "{replicated}")
    x = torch.randn(5, 4)
    assert_close(model(x.to(st.device())).cpu(), ref(x), rtol=1e-5, atol=1e-5)
    for p in model.parameters():
        assert p.sharding_spec == "{replicated}"
        check_cover(p, p.cpu().detach())


class _TiedModel(torch.nn.Module):
    """An embedding and an output head holding one parameter, as a language model ties them."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)
        self.body = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.embed(ids))))


def _train(model, ids, targets, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for _ in range(steps):
        torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_tied_parameters_stay_tied_when_a_model_moves():
    # torch's Module._apply gives each module a new Parameter when the moved tensor is another type;
    # the tie must survive as it does on any torch device, or the two halves train apart
    torch.manual_seed(0)
    ref = _TiedModel()
    model = copy.deepcopy(ref).to(st.device())
    assert model.head.weight is model.embed.weight
    assert len(list(model.parameters())) == len(list(ref.parameters())) == 3
    ids, targets = torch.randint(0, 10, (4, 5)), torch.randint(0, 10, (4, 5))
    _train(ref, ids, targets)
    _train(model, ids.to(st.device()), targets.to(st.device()))
    assert model.head.weight is model.embed.weight
    for name, p in ref.named_parameters():
        assert_close(dict(model.named_parameters())[name].cpu(), p.detach(), rtol=1e-5, atol=1e-5)


def test_tied_hugging_face_embeddings_stay_tied_when_the_model_moves():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    ref = transformers.GPT2LMHeadModel(config)
    model = copy.deepcopy(ref).to(st.device())
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 64, (2, 8))
    losses = []
    for m, x in ((ref, ids), (model, ids.to(st.device()))):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for _ in range(3):
            loss = m(x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert_close(model.transformer.wte.weight.cpu(), ref.transformer.wte.weight.detach(), rtol=1e-5, atol=1e-5)


def test_a_parameter_moved_outside_a_module_move_is_a_new_tensor():
    p = torch.nn.Parameter(torch.randn(3))
    a = torch.nn.Parameter(p.to(st.device()))
    b = torch.nn.Parameter(p.to(st.device()))
    assert a is not b
    with torch.no_grad():
        a.add_(1.0)
    assert_close(b.cpu(), p.detach())
    # a CPU parameter changed after one module moved it: the next module's move takes its new value
    shared = torch.nn.Linear(3, 3)
    first, second = torch.nn.Sequential(shared), torch.nn.Sequential(torch.nn.Linear(3, 3))
    second[0].weight = shared.weight
    first.to(st.device())
    with torch.no_grad():
        second[0].weight.mul_(2.0)
    expected = second[0].weight.detach().clone()
    second.to(st.device())
    assert second[0].weight is not first[0].weight
    assert_close(second[0].weight.cpu(), expected)


def test_factories_on_device_are_replicated():
    z = torch.zeros(3, 4, device=st.device())
    o = torch.ones(2, 3, dtype=torch.int64, device=st.device())
    e = torch.empty(5, device=st.device())
    a = torch.arange(10, device=st.device())
    f = torch.full((2, 2), 7.5, device=st.device())
    i = torch.eye(3, device=st.device())
    for x in (z, o, e, a, f, i):
        assert isinstance(x, st.ShardedTensor)
        assert x.device == st.device()
    assert torch.equal(z.cpu(), torch.zeros(3, 4))
    assert torch.equal(o.cpu(), torch.ones(2, 3, dtype=torch.int64))
    assert e.shape == (5,) and e.dtype == torch.float32
    assert torch.equal(a.cpu(), torch.arange(10))
    assert torch.equal(f.cpu(), torch.full((2, 2), 7.5))
    assert torch.equal(i.cpu(), torch.eye(3))
    for x in (z, o, a, f, i):
        assert x.sharding_spec == "{replicated}"
        check_cover(x, x.cpu())


def test_factory_random_on_device():
    r = torch.randn(64, 8, device=st.device())
    assert isinstance(r, st.ShardedTensor) and r.shape == (64, 8)
    v = r.cpu()
    assert v.std().item() == pytest.approx(1.0, abs=0.2)
    assert abs(v.mean().item()) < 0.2


def test_tensor_to_device():
    t = torch.randn(5, 3)
    x = t.to(st.device())
    assert isinstance(x, st.ShardedTensor) and x.device == st.device()
    assert_close(x.cpu(), t, rtol=0, atol=0)
    assert x.sharding_spec in ("", "{replicated}")
    x.cpu()
    assert x.sharding_spec == "{replicated}"
    check_cover(x, t)
    assert_close(t.to(st.device(), torch.float64).cpu(), t.double())
    assert isinstance(t.to(device=st.device()), st.ShardedTensor)
    assert isinstance(t.to("shardtensor"), st.ShardedTensor)
    # moving a device tensor to the device is a no-op-ish copy with the same value
    assert_close(x.to(st.device()).cpu(), t)


def test_to_device_is_differentiable():
    t = torch.randn(3, requires_grad=True)
    y = t.to(st.device())
    assert y.grad_fn is not None
    (y * 2).sum().backward()
    assert_close(t.grad, torch.full((3,), 2.0))


# =========================================================================== mixing with CPU values


_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
    torch.bool,
]
_OTHERS = [
    2,
    2.5,
    True,
    torch.tensor(3),
    torch.tensor(1.5, dtype=torch.float64),
    torch.tensor(2, dtype=torch.int8),
    torch.tensor(True),
    torch.tensor(0.5, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_python_scalars_and_0d_cpu_tensors_promote_as_torch(dtype):
    t = (torch.arange(10) % 4).to(dtype).reshape(5, 2)
    x = st.shard(t, MESH_42, ("x", "y"))
    ops = {
        "add": lambda a, b: a + b,
        "div": lambda a, b: a / b,
        "max": lambda a, b: torch.maximum(a, b) if isinstance(b, torch.Tensor) else a.clamp(min=b),
    }
    cases = []
    for other in _OTHERS:
        for name, op in ops.items():
            for reverse in (False, True):
                if reverse and name == "max" and not isinstance(other, torch.Tensor):
                    continue
                try:
                    want = op(other, t) if reverse else op(t, other)
                except RuntimeError:
                    continue  # torch refuses this combination too
                got = op(other, x) if reverse else op(x, other)  # recorded lazily: one graph for all
                cases.append((name, other, reverse, got, want))
    st.sync()
    for name, other, reverse, got, want in cases:
        got = got.cpu()
        assert got.dtype == want.dtype, (name, other, reverse, got.dtype, want.dtype)
        assert_close(
            got,
            want,
            equal_nan=True,
            msg=lambda m, name=name, other=other, reverse=reverse: f"{name} {other!r} reverse={reverse}: {m}",
        )


def test_0d_cpu_tensor_in_more_ops():
    t = torch.randn(6, 4)
    x = st.shard(t, MESH_42, ("x", "y"))
    c = torch.tensor(0.25)
    assert_close(torch.where(x > 0, x, c).cpu(), torch.where(t > 0, t, c))
    assert_close(x.clamp(min=c).cpu(), t.clamp(min=c))
    assert_close(torch.lerp(x, x * 2, c).cpu(), torch.lerp(t, t * 2, c))
    y = st.shard(t.clone(), MESH_42, ("x", "y"))
    y.mul_(torch.tensor(3.0))
    assert_close(y.cpu(), t * 3)
    y.add_(2)
    assert_close(y.cpu(), t * 3 + 2)


@modes()
def test_tensor_split_at_points_held_on_the_device(eager):
    """torch requires the split points of ``tensor_split(x, tensor)`` on the CPU: points on the device
    are read back (as from CUDA); values and gradients as torch, bad points get torch's errors."""
    t = torch.randn(10, 4)
    with mode(eager):
        x = st.shard(t.clone(), MESH_42, ("x", "y")).requires_grad_()
        ref = t.clone().requires_grad_()
        for points, dim in ((torch.tensor([2, 7]), 0), (torch.tensor(3), 0), (torch.tensor([1]), 1)):
            got = torch.tensor_split(x, points.to(st.device()), dim)
            want = torch.tensor_split(ref, points, dim)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert_close(g.cpu(), w)
        sum((g * (i + 1)).sum() for i, g in enumerate(got)).backward()
        sum((w * (i + 1)).sum() for i, w in enumerate(want)).backward()
        assert_close(x.grad.cpu(), ref.grad)
        plain, points = x.detach(), torch.tensor([4]).to(st.device())
        with torch.inference_mode():  # no autograd key: reaches __torch_dispatch__
            got = torch.tensor_split(plain, points)
        assert_close(got[1].cpu(), t[4:])
        assert_close(torch.tensor_split(t, torch.tensor([4]).to(st.device()))[0], t[:4])  # CPU data, device points
        for bad, message in (
            (torch.tensor([[1]]), "zero-dimensional or one-dimensional"),
            (torch.tensor([1.5]), "long"),
        ):
            with pytest.raises(RuntimeError, match=message):
                torch.tensor_split(t, bad)
            with pytest.raises(RuntimeError, match=message):
                torch.tensor_split(x, bad.to(st.device()))


def test_new_scalar_values_do_not_recompile():
    x = st.shard(torch.randn(8, 4), MESH_42, ("x", "y"))
    (x * 0.5).cpu()
    before = st.counter_value("UncachedCompile")
    for v in (0.25, 0.125, 3.0):
        assert_close((x * v).cpu(), x.cpu() * v)
    assert st.counter_value("UncachedCompile") == before


@pytest.mark.parametrize("case", ["add", "radd", "mm", "where", "one_element", "cat", "add_", "cpu_add_", "stack"])
def test_cpu_tensor_with_dims_is_a_device_mismatch(case):
    x = st.shard(torch.randn(5, 3), MESH_42, ("x", "y"))
    c = torch.randn(5, 3)
    fns = {
        "add": lambda: x + c,
        "radd": lambda: c + x,
        "mm": lambda: x @ torch.randn(3, 3),
        "where": lambda: torch.where(x > 0, x, c),
        "one_element": lambda: x + torch.ones(1),
        "cat": lambda: torch.cat([x, c]),
        "add_": lambda: x.add_(c),
        "cpu_add_": lambda: c.add_(x),
        "stack": lambda: torch.stack([c, x]),
    }
    with pytest.raises(RuntimeError, match=r"(?s)same device.*(cpu.*shardtensor|shardtensor.*cpu)"):
        fns[case]()


def test_out_argument_on_cpu_is_a_device_mismatch():
    x = st.shard(torch.randn(5, 3), MESH_42, ("x", "y"))
    with pytest.raises(RuntimeError, match=r"(?s)same device.*cpu"):
        torch.mul(x, 2, out=torch.empty(5, 3))


def test_copy_from_cpu_into_device_tensor_is_allowed():
    t = torch.randn(5, 3)
    x = st.shard(torch.zeros(5, 3), MESH_42, ("x", "y"))
    x.copy_(t)
    assert_close(x.cpu(), t)
    assert x.sharding_spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))  # broadcast from CPU, as torch
    assert_close(x.cpu(), torch.tensor([1.0, 2.0, 3.0]).expand(5, 3))
    x[1].copy_(torch.arange(3.0))
    want = torch.tensor([1.0, 2.0, 3.0]).expand(5, 3).clone()
    want[1] = torch.arange(3.0)
    assert_close(x.cpu(), want)


# =========================================================================== errors


def test_wrong_spec_length():
    with pytest.raises(st.ShardingSpecError, match="length"):
        st.shard(torch.ones(4, 4), MESH_42, ("x",))
    x = st.shard(torch.ones(4, 4), MESH_42, ("x", "y"))
    with pytest.raises(st.ShardingSpecError, match="length"):
        st.mark_sharding(x, MESH_42, ("x", None, None))


def test_unknown_axis():
    with pytest.raises(st.ShardingSpecError, match="z"):
        st.shard(torch.ones(4, 4), MESH_42, ("x", "z"))
    x = st.shard(torch.ones(4, 4), MESH_42, (None, None))
    with pytest.raises(st.ShardingSpecError, match="w"):
        st.mark_sharding(x, MESH_42, ("w", None))
    assert x.sharding_spec == "{replicated}"


def test_axis_used_twice_and_index_out_of_range():
    with pytest.raises(st.ShardingSpecError):
        st.shard(torch.ones(4, 4), MESH_42, ("x", "x"))
    with pytest.raises(st.ShardingSpecError):
        st.shard(torch.ones(4, 4), MESH_42, (0, 5))


def test_shard_of_a_non_tensor():
    with pytest.raises(TypeError, match="list"):
        st.shard([1.0, 2.0], MESH_42, ("x",))
    with pytest.raises(TypeError):
        st.shard(3.0, MESH_42, ())


def test_shard_with_a_non_mesh():
    with pytest.raises(TypeError, match="Mesh"):
        st.shard(torch.ones(4, 4), MESH_42.get_jax_mesh(), ("x", "y"))


def test_shard_of_a_meta_tensor():
    with pytest.raises(ValueError, match="CPU"):
        st.shard(torch.ones(4, device="meta"), MESH_42, ("x",))


def test_mark_sharding_of_a_cpu_tensor():
    t = torch.ones(4, 4)
    with pytest.raises(TypeError, match=r"st\.device\(\)|st\.shard"):
        st.mark_sharding(t, MESH_42, ("x", "y"))


def test_mark_sharding_of_a_view():
    x = st.shard(torch.ones(4, 4), MESH_42, (None, None))
    with pytest.raises(ValueError, match="view"):
        st.mark_sharding(x.t(), MESH_42, ("x", "y"))


def test_invalid_spec_errors_leave_no_pending_work():
    x = st.shard(torch.ones(4, 4), MESH_42, ("x", "y"))
    with pytest.raises(st.ShardingSpecError):
        st.mark_sharding(x, MESH_42, ("x",))
    assert x.sharding_spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    assert torch.equal(x.cpu(), torch.ones(4, 4))


# =========================================================================== robustness


_BOOM_LIB = None


@pytest.fixture
def boom():
    """A test-only op whose lowering fails when its graph is compiled (unregistered afterwards)."""
    global _BOOM_LIB
    from shardtensor.ops import registry

    if _BOOM_LIB is None:
        _BOOM_LIB = torch.library.Library("st_tensor_test", "DEF")
        _BOOM_LIB.define("boom(Tensor x) -> Tensor")
        _BOOM_LIB.impl("boom", lambda x: torch.empty_like(x), "Meta")
    op = torch.ops.st_tensor_test.boom.default

    def lowering(x):
        raise ValueError("boom: this lowering always fails")

    registry.register(op)(lowering)
    yield op
    isolate_lazy_graph()
    registry._TABLE.pop(op, None)


def test_a_failing_graph_does_not_poison_later_reads(boom):
    x = st.shard(torch.ones(4, 4), MESH_42, ("x", "y"))
    bad = boom(x)  # recorded, pending
    with pytest.raises(ValueError, match="boom"):
        bad.cpu()
    # An unrelated computation must still work (and report no error of the failed graph).
    y = st.shard(torch.arange(4.0), MESH_42, ("x",))
    assert_close((y + 1).cpu(), torch.arange(4.0) + 1)
    del bad
    st.sync()


def test_failing_graph_error_is_raised_again_for_that_tensor(boom):
    x = st.shard(torch.ones(4, 4), MESH_42, ("x", "y"))
    bad = boom(x) * 2
    with pytest.raises(ValueError, match="boom"):
        bad.cpu()
    with pytest.raises(ValueError, match="boom"):
        bad.cpu()  # the failing value stays failing: no wrong value appears
    del bad


def test_cpu_index_tensors_work_with_device_tensors():
    # as with CUDA tensors, a CPU index tensor may index a device tensor (read and write)
    t = torch.arange(24.0).reshape(8, 3)
    x = st.shard(t.clone(), MESH_42, ("x", None))
    i = torch.tensor([0, 5, 7])
    assert_close(x[i].cpu(), t[i])
    x[i] = 5.0
    t[i] = 5.0
    x[torch.tensor([1, 3]), torch.tensor([0, 2])] += 1
    t[torch.tensor([1, 3]), torch.tensor([0, 2])] += 1
    assert_close(x.cpu(), t)


@pytest.mark.parametrize("eager", [False, True])
def test_data_dependent_shapes_sync_for_the_shape(eager):
    t = torch.randn(10, 3)
    with st.eager_mode(eager):
        x = st.shard(t, MESH_42, ("x", None))
        assert_close(x[x > 0].cpu(), t[t > 0])
        assert_close(torch.nonzero(x > 0).cpu(), torch.nonzero(t > 0))
        assert_close(torch.masked_select(x, x > 0).cpu(), torch.masked_select(t, t > 0))
        u = torch.tensor([3, 1, 3, 2])
        assert_close(torch.unique(u.to(st.device())).cpu(), torch.unique(u))


def test_data_dependent_shape_inside_full_graph_compile_is_a_clear_error():
    x = st.shard(torch.randn(8, 3), MESH_42, ("x", None))
    f = st.compile(lambda v: v[v > 0].sum(), full_graph=True)
    with pytest.raises(st.UnexpectedExecutionError, match="data-dependent"):
        f(x)


def test_torch_tensor_with_device_argument():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=st.device())
    assert isinstance(x, st.ShardedTensor)
    assert_close(x.cpu(), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    i = torch.tensor([1, 0], device=st.device())
    assert i.dtype == torch.int64
    assert_close(x[i].cpu(), torch.tensor([[3.0, 4.0], [1.0, 2.0]]))


def test_layout_xla_chose_on_an_unnamed_mesh():
    # jax names an unnamed mesh's axes '0', '1': they read back as axis indices
    mesh = st.Mesh(range(8), (4, 2))
    x = torch.randn(8, 4)
    c = st.shard(x, mesh, (0, 1)) * 2
    st.sync()
    assert c._layout() == (mesh, ((0,), (1,)))
    assert len(c.local_shards) == 8
    torch.testing.assert_close(c.cpu(), x * 2)
    assert "ShardedTensor" in repr(c)


def test_to_dtype_keeps_the_sharding():
    mesh = st.Mesh(range(8), (4, 2), ("x", "y"))
    lin = torch.nn.Linear(8, 16).to(st.device())
    st.mark_sharding(lin.weight, mesh, ("x", None))
    lin.to(torch.bfloat16)
    assert lin.weight.dtype == torch.bfloat16 and lin.weight.partition_spec == ("x", None)
    x = st.shard(torch.randn(8, 4), mesh, (None, "y"))
    for y in (x.to(torch.float64), x.double(), x.to(st.device()), x.clone()):
        assert y.partition_spec == (None, "y")
        torch.testing.assert_close(y.cpu(), x.cpu().to(y.dtype))


def test_copy_from_device_tensor_into_cpu_tensor_is_allowed():
    """Issue 11 §6: torch allows cpu.copy_(device): the value comes back and torch's CPU kernel writes
    it, through views, with dtype conversion and broadcasting."""
    t = torch.randn(5, 3)
    x = st.shard(t, MESH_42, ("x", "y"))
    out = torch.empty(5, 3)
    assert out.copy_(x) is out
    assert_close(out, t)
    base = torch.zeros(5, 4, dtype=torch.float64)
    base[:, 1:].copy_(x * 2)  # pending, into a strided CPU view, converted to float64
    want = torch.zeros(5, 4, dtype=torch.float64)
    want[:, 1:] = (t * 2).double()
    assert_close(base, want)
    row = torch.zeros(5, 3, dtype=torch.int32)
    row.copy_(st.shard(torch.arange(3.0), MESH_42, ("y",)))  # broadcast
    assert_close(row, torch.arange(3, dtype=torch.int32).expand(5, 3))
    with pytest.raises(RuntimeError):
        torch.empty(2, 3).copy_(x)  # torch's own shape error
    w = st.shard(t, MESH_42, ("x", None)).requires_grad_()
    host = torch.zeros(5, 3)
    host.copy_(w * 2)
    (host * 3).sum().backward()  # the gradient goes back to the device tensor
    assert_close(w.grad.cpu(), torch.full((5, 3), 6.0))


# --- a library's custom op (torch.library) ----------------------------------------------------------
@torch.library.custom_op("shardtensor_test::scale_add", mutates_args=())
def _scale_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * 2 + y  # (no device_types: torch.library registers it for every device)


@torch.library.custom_op("shardtensor_test::cpu_only", mutates_args=(), device_types="cpu")
def _cpu_only(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def test_custom_op_with_a_device_independent_kernel_runs_it():
    """transformers' grouped_mm_fallback is such an op: its kernel's torch ops run one by one."""
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    mesh = st.Mesh(range(8), (8,), ("d",))
    out = torch.ops.shardtensor_test.scale_add(st.shard(x, mesh, ("d", None)), st.shard(y, mesh, ("d", None)))
    assert isinstance(out, st.ShardedTensor)
    assert_close(out.cpu(), x * 2 + y)
    with pytest.raises(NotImplementedError, match="no lowering for .*shardtensor_test.cpu_only"):
        torch.ops.shardtensor_test.cpu_only(st.shard(x, mesh, ("d", None)))


@modes()
def test_in_place_foreach_ops_write_every_element_as_torch_does(eager):
    """A foreach op writing a list (the optimizer's ops, with their own short path): views and plain
    tensors of mixed dtypes and shapes, repeated (the second call reuses what the first worked out),
    and torch's errors for a result that cannot be written."""
    torch.manual_seed(0)
    base, other = torch.randn(4, 3), torch.randn(4, 3)
    xs = [torch.randn(3, 2), torch.randn(5, dtype=torch.float64), torch.randn(2, 2).to(torch.bfloat16)]
    ys = [torch.randn_like(x) for x in xs] + [torch.randn(4) for _ in range(3)] + [torch.randn(2, 4)]
    with mode(eager):
        sbase, sother = st.shard(base, MESH_42, ("x", None)), other.to(st.device())
        sxs = [x.to(st.device()) for x in xs] + list(sbase.unbind(1)) + [sother.t()[1:]]
        sys_ = [y.to(st.device()) for y in ys]
        tbase, tother = base.clone(), other.clone()
        txs = [x.clone() for x in xs] + list(tbase.unbind(1)) + [tother.t()[1:]]
        for _ in range(2):
            torch._foreach_mul_(sxs, 0.5)
            torch._foreach_lerp_(sxs, sys_, 0.25)
            torch._foreach_mul_(txs, 0.5)
            torch._foreach_lerp_(txs, ys, 0.25)
        for sx, tx in zip(sxs, txs):
            assert_close(sx.cpu(), tx)
        assert_close(sbase.cpu(), tbase)
        assert_close(sother.cpu(), tother)
        ints = [torch.arange(3).to(st.device())]
        with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired output type Long"):
            torch._foreach_mul_(ints, 0.5)
        assert_close(ints[0].cpu(), torch.arange(3))


@modes()
def test_foreach_ops_over_elements_that_share_memory_update_one_after_another(eager):
    """torch's foreach ops update their elements in turn: overlapping views, a tensor listed twice and
    an operand that is another element see the earlier elements' updates."""
    cases = [
        lambda b: torch._foreach_add_([b.view(-1)[0:6], b.view(-1)[3:9]], 1.0),
        lambda b: torch._foreach_mul_([b[0], b[0]], 2.0),
        lambda b: torch._foreach_add_([b[0], b[1]], [b[1], b[0]]),
        lambda b: torch._foreach_addcmul_([b[1], b[2]], [b[2], b[1]], [b[0], b[0]], 0.5),
    ]
    with mode(eager):
        for i, case in enumerate(cases):
            base = torch.arange(12.0).reshape(4, 3)
            on_device = base.to(st.device())
            for _ in range(2):  # (the second call repeats what the first worked out)
                case(base)
                case(on_device)
            assert_close(on_device.cpu(), base, msg=f"case {i}")
