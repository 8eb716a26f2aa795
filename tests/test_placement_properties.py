"""Property tests (hypothesis): placements <-> PartitionSpec, and the piece each device holds after
``st.distribute_tensor`` against DTensor's own semantics.

DTensor's piece for a mesh coordinate is computed with DTensor's own splitting code
(``torch.distributed.tensor.placement_types.Shard._split_tensor``, applied mesh axis by mesh axis
as ``distribute_tensor`` does, ``Partial("sum")`` dividing by the axis size): it needs no process
group, where running DTensor itself on CPU would need one process per rank.
"""

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from torch.distributed.tensor import placement_types as dtensor_placements

import shardtensor as st
from shardtensor import Partial, Replicate, Shard

MESHES = [((8,), ("x",)), ((4, 2), ("x", "y")), ((2, 2, 2), ("a", "b", "c")), ((1, 8), ("p", "q"))]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@hs.composite
def layouts(draw, partial=False):
    """(mesh shape, axis names, placements, tensor shape): a dimension split by several mesh axes
    divides evenly (DTensor splits it axis by axis, shardtensor in one even split: they agree then)."""
    mesh_shape, names = draw(hs.sampled_from(MESHES))
    ndim = draw(hs.integers(1, 3))
    kinds = [Replicate()] + [Shard(d) for d in range(ndim)] + [Shard(-1)]
    if partial:
        kinds += [Partial(draw(hs.sampled_from(["sum", "avg"])))]
    placements = [draw(hs.sampled_from(kinds)) for _ in mesh_shape]
    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    if len(ops) > 1:  # one reduce op per tensor
        placements = [Partial(min(ops)) if isinstance(p, Partial) else p for p in placements]
    shape = []
    for d in range(ndim):
        axes = [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim % ndim == d]
        if len(axes) > 1:
            shape.append(int(np.prod([mesh_shape[a] for a in axes])) * draw(hs.integers(1, 2)))
        else:
            shape.append(draw(hs.integers(1, 9)))  # uneven sizes too
    return mesh_shape, names, placements, tuple(shape)


def _normalized(placements, ndim):
    return tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements)


@SETTINGS
@given(layouts())
def test_placements_to_spec_and_back(layout):
    mesh_shape, names, placements, shape = layout
    mesh = st.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    spec = st.placements_to_spec(placements, mesh, len(shape))
    assert len(spec) == len(shape)
    assert st.spec_to_placements(mesh, spec, len(shape)) == _normalized(placements, len(shape))
    unnamed = st.Mesh(range(8), mesh_shape)  # axes named by index
    assert st.spec_to_placements(unnamed, st.placements_to_spec(placements, unnamed, len(shape)), len(shape)) == (
        _normalized(placements, len(shape))
    )


def _dtensor_piece(t, mesh_shape, placements, coordinate):
    """DTensor's local tensor at ``coordinate`` after distribute_tensor(t, mesh, placements)."""
    local = t
    for axis, p in enumerate(placements):
        n = mesh_shape[axis]
        if isinstance(p, Shard):
            chunks, _ = dtensor_placements.Shard(p.dim % t.dim())._split_tensor(local, n, with_padding=False)
            local = chunks[coordinate[axis]]
        elif isinstance(p, Partial):
            local = dtensor_placements.Partial(p.reduce_op)._partition_value(local, _OneAxisMesh(n), 0)
    return local


class _OneAxisMesh:
    """What Partial._partition_value asks of a DeviceMesh: the size of one axis."""

    def __init__(self, n):
        self.n = n

    def size(self, mesh_dim=None):
        return self.n


@SETTINGS
@given(layouts(partial=True), hs.integers(0, 2**16))
def test_each_device_holds_dtensors_local_tensor(layout, seed):
    mesh_shape, names, placements, shape = layout
    mesh = st.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x = st.distribute_tensor(t, mesh, placements)
    assert x.placements == _normalized(placements, len(shape))
    shards = x.local_shards
    assert len(shards) == 8
    positions = {int(d): i for i, d in enumerate(np.asarray(mesh.device_ids).reshape(-1))}
    for s in shards:
        coordinate = np.unravel_index(positions[int(s.device.split(":")[1])], mesh_shape)
        expected = _dtensor_piece(t, mesh_shape, placements, coordinate)
        torch.testing.assert_close(s.unpadded_data, expected, rtol=0, atol=0)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(partial=True), hs.data())
def test_redistribute_keeps_the_value(layout, data):
    """From any layout (partial ones too) to any other: the same value, the placements asked for."""
    mesh_shape, names, placements, shape = layout
    mesh = st.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    ndim = len(shape)
    target = []
    for p in placements:
        choices = [Replicate()] + [Shard(d) for d in range(ndim)] + ([p] if isinstance(p, Partial) else [])
        target.append(data.draw(hs.sampled_from(choices)))
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    y = st.distribute_tensor(t, mesh, placements).redistribute(mesh, target)
    assert y.placements == _normalized(target, ndim)
    torch.testing.assert_close(y.full_tensor(), t)
