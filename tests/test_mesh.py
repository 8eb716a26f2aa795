"""shardtensor.mesh: Mesh validation and methods, the jax mesh, HybridMesh, the global mesh."""

import copy
import itertools
import pickle
from collections import OrderedDict
from unittest import mock

import jax
import numpy as np
import pytest
from jax.experimental import mesh_utils

import shardtensor.mesh as sm
from shardtensor.mesh import HybridMesh, Mesh, MeshError

MESH_SHAPES = [(8,), (4, 2), (2, 2, 2), (1, 8)]


# --------------------------------------------------------------------------- construction


@pytest.mark.parametrize("shape", MESH_SHAPES)
def test_meshes_of_every_tested_shape(shape):
    mesh = Mesh(range(8), shape)
    assert mesh.size() == 8
    assert mesh.mesh_shape == shape
    assert mesh.get_logical_mesh().shape == shape
    assert mesh.get_logical_mesh().reshape(-1).tolist() == list(range(8))


@pytest.mark.parametrize("ids", [list(range(8)), range(8), np.arange(8), np.arange(8).reshape(4, 2)])
def test_device_ids_as_list_range_or_array(ids):
    mesh = Mesh(ids, (4, 2), ("x", "y"))
    assert isinstance(mesh.device_ids, np.ndarray)
    assert mesh.device_ids.tolist() == list(range(8))
    assert mesh.get_logical_mesh().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_attributes_are_normalised():
    mesh = Mesh(range(8), [4, 2], ["x", "y"])
    assert mesh.mesh_shape == (4, 2) and mesh.axis_names == ("x", "y")
    assert Mesh(range(8), (8,)).axis_names is None


def test_logical_mesh_is_row_major_over_custom_ids():
    mesh = Mesh([7, 6, 5, 4, 3, 2, 1, 0], (2, 4))
    assert mesh.get_logical_mesh().tolist() == [[7, 6, 5, 4], [3, 2, 1, 0]]
    mesh.get_logical_mesh()[0, 0] = 99  # a copy: the mesh is not changed
    assert mesh.device_ids[0] == 7


def test_shape_size_and_axis_index():
    mesh = Mesh(range(8), (2, 2, 2), ("a", "b", "c"))
    assert mesh.shape() == OrderedDict([("a", 2), ("b", 2), ("c", 2)])
    assert isinstance(mesh.shape(), OrderedDict)
    assert mesh.size() == 8 and isinstance(mesh.size(), int)
    assert mesh.get_axis_name_idx("c") == 2
    assert mesh.get_axis_name_idx("z") is None


def test_unnamed_mesh_shape_is_keyed_by_index():
    mesh = Mesh(range(8), (4, 2))
    assert mesh.shape() == OrderedDict([(0, 4), (1, 2)])
    assert mesh.get_axis_name_idx("x") is None


# --------------------------------------------------------------------------- validation, in order


def test_no_devices():
    with pytest.raises(MeshError, match=r"requires XLA supported device\(s\)"):
        Mesh([], (0,))


def test_ids_must_cover_all_global_devices():
    with pytest.raises(MeshError, match=r"Number of device IDs \(4\) must match the global number of devices \(8\)"):
        Mesh(range(4), (4,))


def test_one_axis_name_per_dimension():
    with pytest.raises(MeshError, match=r"Number of axis names \(1\) must match mesh dimensions \(2\)"):
        Mesh(range(8), (4, 2), ("x",))


def test_axis_names_unique():
    with pytest.raises(MeshError, match=r"Axis names must be unique, got: \('x', 'x'\)"):
        Mesh(range(8), (4, 2), ("x", "x"))


def test_ids_match_mesh_size():
    with pytest.raises(MeshError, match=r"Number of device IDs \(8\) must match mesh size \(6\)"):
        Mesh(range(8), (3, 2))


def test_ids_unique():
    with pytest.raises(MeshError, match="Device IDs must be unique"):
        Mesh([0, 1, 2, 3, 4, 5, 6, 6], (4, 2))


def test_ids_less_than_mesh_size():
    with pytest.raises(MeshError, match=r"Device IDs must be less than mesh size \(8\)"):
        Mesh([0, 1, 2, 3, 4, 5, 6, 8], (4, 2))


def test_negative_ids_rejected():
    with pytest.raises(MeshError, match="Device IDs must be non-negative"):
        Mesh([-1, 1, 2, 3, 4, 5, 6, 7], (4, 2))


def test_mesh_shape_must_be_positive():
    with pytest.raises(MeshError, match="mesh_shape must be a tuple of positive ints"):
        Mesh(range(8), (-2, -4))


def test_checks_run_in_pytorch_xla_order():
    # Several problems at once: the first check in PyTorch/XLA's order reports.
    with pytest.raises(MeshError, match="global number of devices"):
        Mesh([0, 0, 9], (2, 2), ("x", "x", "z"))
    with pytest.raises(MeshError, match="Number of axis names"):
        Mesh([0] * 8, (3, 2), ("x", "x", "z"))
    with pytest.raises(MeshError, match="Axis names must be unique"):
        Mesh([0] * 8, (3, 2), ("x", "x"))
    with pytest.raises(MeshError, match="must match mesh size"):
        Mesh([0] * 8, (3, 2), ("x", "y"))
    with pytest.raises(MeshError, match="must be unique"):
        Mesh([9] * 8, (4, 2), ("x", "y"))


def test_mesh_error_is_assertion_and_value_error():
    assert issubclass(MeshError, AssertionError) and issubclass(MeshError, ValueError)
    with pytest.raises(AssertionError):
        Mesh(range(4), (4,))
    with pytest.raises(ValueError):
        Mesh(range(4), (4,))


# --------------------------------------------------------------------------- identity and text


def test_equality_and_hash():
    a = Mesh(range(8), (4, 2), ("x", "y"))
    b = Mesh(np.arange(8), [4, 2], ["x", "y"])
    assert a == b and hash(a) == hash(b)
    assert a != Mesh(range(8), (4, 2), ("x", "z"))
    assert a != Mesh(range(8), (2, 4), ("x", "y"))
    assert a != Mesh(list(reversed(range(8))), (4, 2), ("x", "y"))
    assert len({a, b}) == 1


def test_device_ids_cannot_be_mutated():
    mesh = Mesh(range(8), (8,))
    with pytest.raises(ValueError):
        mesh.device_ids[0] = 5


def test_repr_is_readable():
    assert repr(Mesh(range(8), (4, 2), ("x", "y"))) == (
        "Mesh(device_ids=range(0, 8), mesh_shape=(4, 2), axis_names=('x', 'y'))"
    )
    assert repr(Mesh([1, 0, 2, 3, 4, 5, 6, 7], (8,))) == (
        "Mesh(device_ids=[1, 0, 2, 3, 4, 5, 6, 7], mesh_shape=(8,), axis_names=None)"
    )


def test_str_is_pytorch_xla_format_and_round_trips():
    mesh = Mesh(range(8), (4, 2), ("x", "y"))
    assert str(mesh) == "{'device_ids': [0, 1, 2, 3, 4, 5, 6, 7], 'mesh_shape': (4, 2), 'axis_names': ('x', 'y')}"
    assert Mesh.from_str(str(mesh)) == mesh
    assert Mesh.from_str("Mesh" + str(mesh)) == mesh
    unnamed = Mesh(range(8), (2, 2, 2))
    assert Mesh.from_str(str(unnamed)) == unnamed


@pytest.mark.parametrize("text", ["not a mesh", "{'device_ids': [0]}", "{1: 2", "[1, 2]"])
def test_from_str_gives_none_on_unparsable_text(text):
    assert Mesh.from_str(text) is None


def test_from_str_still_validates():
    with pytest.raises(MeshError):
        Mesh.from_str("{'device_ids': [0, 1], 'mesh_shape': (2,), 'axis_names': None}")


def test_pickle_and_deepcopy():
    mesh = Mesh(range(8), (2, 4), ("a", "b"))
    mesh.get_jax_mesh()
    for twin in (pickle.loads(pickle.dumps(mesh)), copy.deepcopy(mesh)):
        assert twin == mesh and hash(twin) == hash(mesh)
        assert not twin.device_ids.flags.writeable
        assert twin.get_jax_mesh() == mesh.get_jax_mesh()
    hybrid = HybridMesh(ici_mesh_shape=(4, 2))
    assert pickle.loads(pickle.dumps(hybrid)).ici_mesh_shape == (4, 2)


# --------------------------------------------------------------------------- jax mesh


def test_jax_mesh_named_auto_and_ordered_by_id():
    mesh = Mesh([7, 6, 5, 4, 3, 2, 1, 0], (4, 2), ("x", "y"))
    jmesh = mesh.get_jax_mesh()
    assert isinstance(jmesh, jax.sharding.Mesh)
    assert jmesh.axis_names == ("x", "y")
    assert dict(jmesh.shape) == {"x": 4, "y": 2}
    assert jmesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
    assert np.vectorize(lambda d: d.id)(jmesh.devices).tolist() == mesh.get_logical_mesh().tolist()
    assert mesh.get_jax_mesh() is jmesh  # cached


def test_jax_mesh_unnamed_axes():
    assert Mesh(range(8), (2, 2, 2)).get_jax_mesh().axis_names == ("0", "1", "2")


# --------------------------------------------------------------------------- helpers, global mesh


def test_get_1d_mesh():
    mesh = sm.get_1d_mesh()
    assert mesh.mesh_shape == (8,) and mesh.axis_names is None
    named = sm.get_1d_mesh("data")
    assert named.axis_names == ("data",) and named.shape() == OrderedDict(data=8)


def test_global_mesh_identity():
    previous = sm.get_global_mesh()
    try:
        sm.set_global_mesh(None)
        assert sm.get_global_mesh() is None
        mesh = Mesh(range(8), (1, 8), ("data", "model"))
        sm.set_global_mesh(mesh)
        assert sm.get_global_mesh() is mesh
        with pytest.raises(TypeError, match="expects a Mesh"):
            sm.set_global_mesh((1, 8))
    finally:
        sm.set_global_mesh(previous)


# --------------------------------------------------------------------------- HybridMesh


def _two_slices_of_v4_8():
    """PyTorch/XLA's mocked attributes: 2 slices, names and coords scrambled on purpose."""
    slots = [
        (2, 0, 0, 0),
        (1, 1, 0, 0),
        (0, 0, 1, 0),
        (3, 1, 1, 0),
        (4, 0, 0, 1),
        (7, 1, 0, 1),
        (6, 0, 1, 1),
        (5, 1, 1, 1),
    ]
    return [{"coords": [x, y, 0], "core_on_chip": 0, "slice_index": s, "name": f"TPU:{n}"} for n, x, y, s in slots]


def test_hybrid_mesh_orders_scrambled_tpu_slices_as_pytorch_xla():
    with mock.patch("shardtensor.runtime.global_runtime_device_attributes", _two_slices_of_v4_8):
        mesh = HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(2, 1))
    assert mesh.get_logical_mesh().tolist() == [[2, 1], [0, 3], [4, 7], [6, 5]]
    assert mesh.mesh_shape == (4, 2)
    assert (mesh.ici_mesh_shape, mesh.dcn_mesh_shape) == ((2, 2), (2, 1))


def test_hybrid_mesh_attributes_can_be_injected():
    mesh = HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(2, 1), device_attributes=_two_slices_of_v4_8())
    assert mesh.get_logical_mesh().tolist() == [[2, 1], [0, 3], [4, 7], [6, 5]]


def test_hybrid_mesh_slices_on_the_data_axis():
    # PyTorch/XLA's docstring example: 2 slices of v4-8, ici (1, 4, 1), dcn (2, 1, 1).
    mesh = HybridMesh(
        ici_mesh_shape=(1, 4, 1),
        dcn_mesh_shape=(2, 1, 1),
        axis_names=("data", "fsdp", "tensor"),
        device_attributes=_two_slices_of_v4_8(),
    )
    assert mesh.shape() == OrderedDict([("data", 2), ("fsdp", 4), ("tensor", 1)])
    logical = mesh.get_logical_mesh()
    assert sorted(logical[0].reshape(-1).tolist()) == [0, 1, 2, 3]  # slice 0 on data=0
    assert sorted(logical[1].reshape(-1).tolist()) == [4, 5, 6, 7]


def test_hybrid_mesh_needs_dcn_shape_for_multislice():
    with pytest.raises(ValueError, match="Provide dcn_mesh_shape to create a mesh for multislice"):
        HybridMesh(ici_mesh_shape=(4, 2), device_attributes=_two_slices_of_v4_8())


def test_hybrid_mesh_rejects_dcn_shape_for_single_slice():
    with pytest.raises(ValueError, match="Invalid dcn_mesh_shape for single slice mesh"):
        HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(2, 1))


def test_hybrid_mesh_slice_count_must_match_dcn():
    with pytest.raises(MeshError, match=r"Number of slices 2 must equal the product of dcn_mesh_shape \(4, 1\)"):
        HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(4, 1), device_attributes=_two_slices_of_v4_8())


def test_hybrid_mesh_shape_lengths_must_match():
    with pytest.raises(MeshError, match="must have the same length"):
        HybridMesh(ici_mesh_shape=(4, 2), dcn_mesh_shape=(1,))


def test_hybrid_mesh_on_cpu_is_row_major():
    mesh = HybridMesh(ici_mesh_shape=(4, 2), axis_names=("x", "y"))
    assert mesh == Mesh(range(8), (4, 2), ("x", "y"))
    assert HybridMesh(ici_mesh_shape=(2, 4), dcn_mesh_shape=(1, 1)).get_logical_mesh().tolist() == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]


def test_hybrid_mesh_keyword_only():
    with pytest.raises(TypeError):
        HybridMesh((4, 2))


def test_single_slice_tpu_follows_coords():
    # One slice of 8 chips at scrambled 2x4 coords: each logical row is a physical row.
    coords = {0: (1, 3), 1: (0, 0), 2: (1, 0), 3: (0, 1), 4: (1, 1), 5: (0, 2), 6: (1, 2), 7: (0, 3)}
    attributes = [{"name": f"TPU:{i}", "coords": [x, y, 0]} for i, (x, y) in coords.items()]
    mesh = HybridMesh(ici_mesh_shape=(2, 4), device_attributes=attributes)
    by_position = {c: i for i, c in coords.items()}
    # Logical axis 1 (size 4, assigned first) takes physical y; axis 0 takes physical x.
    assert mesh.get_logical_mesh().tolist() == [[by_position[(x, y)] for y in range(4)] for x in range(2)]


# --- the layouts against jax.experimental.mesh_utils -----------------------------------------------
class _JaxDevice:
    """What jax's mesh helpers read of a device."""

    def __init__(self, attributes, platform="tpu"):
        self.id, self.coords = attributes["id"], tuple(attributes["coords"])
        self.core_on_chip, self.slice_index = attributes.get("core_on_chip", 0), attributes.get("slice_index", 0)
        self.platform, self.device_kind = platform, attributes["device_kind"]


def _tpu_slice(extent, kind, cores=1, slice_index=None, first_id=0):
    """Attributes of one TPU slice: chips on an ``extent`` grid, ids in (z, y, x, core) order; a
    ``slice_index`` only when given (a multislice job)."""
    out = []
    for z, y, x, c in itertools.product(*(range(n) for n in reversed(extent)), range(cores)):
        out.append(
            {
                "id": first_id + len(out),
                "name": f"TPU:{first_id + len(out)}",
                "coords": [x, y, z],
                "core_on_chip": c,
                "device_kind": kind,
            }
        )
        if slice_index is not None:
            out[-1]["slice_index"] = slice_index
    return out


@pytest.mark.parametrize("extent", [(2, 2, 1), (2, 2, 2), (4, 2, 2), (4, 4, 4)])
def test_slice_layout_is_jax_torus_assignment(extent):
    # A kind without a special rule in jax (TPU v4): jax's create_device_mesh and the slice layout
    # (a mesh covers the 8 simulated devices, so larger slices are laid out directly) agree for
    # every logical shape that maps onto whole physical axes.
    attributes = _tpu_slice(extent, "TPU v4")
    n = len(attributes)
    shapes = [(n,), (n // 2, 2), (2, n // 2), (n // 4, 2, 2), (2, n // 4, 2), (1, n // 2, 2)]
    for shape in shapes:
        ours = sm._slice_device_mesh(shape, [a["id"] for a in attributes], {a["id"]: a for a in attributes})
        try:
            jax_mesh = mesh_utils.create_device_mesh(shape, [_JaxDevice(a) for a in attributes])
            theirs = np.vectorize(lambda d: d.id)(jax_mesh)
        except NotImplementedError:  # no whole physical axes for some logical axis: id order
            theirs = np.arange(n).reshape(shape)
        assert ours.tolist() == theirs.tolist(), shape


def test_slice_layout_keeps_pytorch_xla_order_where_jax_has_a_kind_rule():
    # TPU v3-8 (2x2 chips, 2 cores each): jax applies its tray ring order to 8 v3 devices; PyTorch/XLA
    # lays the devices out by their coordinates (x, y, core), and so does HybridMesh.
    attributes = _tpu_slice((2, 2, 1), "TPU v3", cores=2)
    ours = HybridMesh(ici_mesh_shape=(8,), device_attributes=attributes).get_logical_mesh()
    theirs = np.vectorize(lambda d: d.id)(mesh_utils.create_device_mesh((8,), [_JaxDevice(a) for a in attributes]))
    by_coords = sorted(attributes, key=lambda a: (a["coords"][0], a["coords"][1], a["core_on_chip"]))
    assert ours.tolist() == [a["id"] for a in by_coords] == [0, 1, 4, 5, 2, 3, 6, 7]
    assert theirs.tolist() == [0, 1, 2, 3, 6, 7, 4, 5]


def test_multislice_blocks_are_jax_hybrid_mesh():
    attributes = _tpu_slice((2, 2, 1), "TPU v4", slice_index=0) + _tpu_slice(
        (2, 2, 1), "TPU v4", slice_index=1, first_id=4
    )
    for ici, dcn in (((1, 4), (2, 1)), ((2, 2), (1, 2)), ((4, 1), (2, 1))):
        ours = HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn, device_attributes=attributes).get_logical_mesh()
        theirs = mesh_utils.create_hybrid_device_mesh(ici, dcn, [_JaxDevice(a) for a in attributes])
        assert ours.tolist() == np.vectorize(lambda d: d.id)(theirs).tolist(), (ici, dcn)
