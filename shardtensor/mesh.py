"""Device meshes: `Mesh`, `HybridMesh`, the global mesh — PyTorch/XLA's API and checks.

A mesh lays out every global device (by runtime device id) in an n-d array whose axes may be
named. Partition specs (`shardtensor.sharding`) name those axes to say how a tensor is split.

Example::

    mesh = Mesh(range(8), (4, 2), ('x', 'y'))
    mesh.get_logical_mesh()   # [[0, 1], [2, 3], [4, 5], [6, 7]]
    mesh.shape()              # OrderedDict([('x', 4), ('y', 2)])
"""

from __future__ import annotations

import ast
import itertools
import math
import re
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType
from jax.sharding import Mesh as JaxMesh

from shardtensor import runtime  # jax is configured already: the package's __init__ imports runtime first


class MeshError(AssertionError, ValueError):
    """An invalid mesh. An AssertionError as in PyTorch/XLA, and a ValueError (not stripped by -O)."""


class Mesh:
    """The logical layout of all global devices.

    Args:
        device_ids: every global device id once, as a list, range or numpy array, in row-major
            order of the mesh; or the devices themselves (``st.xla_devices()``, JAX devices).
        mesh_shape: the size of each mesh axis; the product must be the device count.
        axis_names: optional unique names, one per axis.

    Example::

        mesh = Mesh(np.arange(8), (2, 2, 2), ('a', 'b', 'c'))
        mesh.size()                  # 8
        mesh.get_axis_name_idx('c')  # 2
    """

    device_ids: np.ndarray
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...] | None

    def __init__(
        self, device_ids: Iterable[int | jax.Device], mesh_shape: Sequence[int], axis_names: Sequence[str] | None = None
    ) -> None:
        mesh_shape = tuple(mesh_shape)
        ids = np.array(_as_device_ids(device_ids, mesh_shape)).reshape(-1)
        axis_names = None if axis_names is None else tuple(axis_names)
        _validate_mesh(ids, mesh_shape, axis_names)
        ids = ids.astype(np.int64)
        ids.flags.writeable = False  # the hash depends on it
        self.device_ids = ids
        self.mesh_shape = tuple(int(s) for s in mesh_shape)
        self.axis_names = axis_names
        self._jax_mesh: JaxMesh | None = None

    def size(self) -> int:
        """The number of devices in the mesh. Example: ``Mesh(range(8), (4, 2)).size() == 8``."""
        return math.prod(self.mesh_shape)

    def shape(self) -> OrderedDict:
        """Axis name (or index when unnamed) -> size.

        Example: ``Mesh(range(8), (4, 2), ('x', 'y')).shape() == OrderedDict(x=4, y=2)``.
        """
        keys = self.axis_names if self.axis_names is not None else range(len(self.mesh_shape))
        return OrderedDict(zip(keys, self.mesh_shape))

    def get_logical_mesh(self) -> np.ndarray:
        """The device ids as an array of the mesh's shape (a copy).

        Example: ``Mesh(range(4), (2, 2)).get_logical_mesh().tolist() == [[0, 1], [2, 3]]``.
        """
        return self.device_ids.reshape(self.mesh_shape).copy()

    def get_axis_name_idx(self, name: str) -> int | None:
        """The index of the axis called `name`, or None if there is none.

        Example: ``Mesh(range(8), (4, 2), ('x', 'y')).get_axis_name_idx('y') == 1``.
        """
        if self.axis_names is None or name not in self.axis_names:
            return None
        return self.axis_names.index(name)

    def get_jax_mesh(self) -> JaxMesh:
        """The same mesh as a ``jax.sharding.Mesh`` with auto axis types (cached).

        Unnamed axes are called ``'0'``, ``'1'``, ... .

        Example::

            Mesh(range(8), (4, 2), ('x', 'y')).get_jax_mesh()
            # Mesh('x': 4, 'y': 2, axis_types=(Auto, Auto))
        """
        if self._jax_mesh is None:
            devices = np.array([runtime.jax_devices()[i] for i in self.device_ids], dtype=object)
            # Auto, not jax.make_mesh's explicit default: explicit axes reject some matmuls.
            self._jax_mesh = JaxMesh(
                devices.reshape(self.mesh_shape),
                jax_axis_names(self),
                axis_types=(AxisType.Auto,) * len(self.mesh_shape),
            )
            _BY_JAX_MESH.setdefault(self._jax_mesh, self)
        return self._jax_mesh

    def __getstate__(self):
        return {**self.__dict__, "_jax_mesh": None}  # jax devices belong to this process

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.device_ids.flags.writeable = False

    def _key(self):
        return (tuple(self.device_ids.tolist()), self.mesh_shape, self.axis_names)

    def __eq__(self, other):
        if not isinstance(other, Mesh):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        ids = self.device_ids.tolist()
        shown = f"range(0, {len(ids)})" if ids == list(range(len(ids))) else str(ids)
        return f"{type(self).__name__}(device_ids={shown}, mesh_shape={self.mesh_shape}, axis_names={self.axis_names})"

    def __str__(self):
        # PyTorch/XLA's format, which `from_str` reads back.
        return (
            f"{{'device_ids': {self.device_ids.tolist()}, "
            f"'mesh_shape': {self.mesh_shape}, 'axis_names': {self.axis_names}}}"
        )

    @classmethod
    def from_str(cls, mesh_str: str) -> Mesh | None:
        """Read a mesh back from `str(mesh)`; None if the text cannot be parsed.

        Example: ``Mesh.from_str(str(mesh)) == mesh``.
        """
        try:
            fields = ast.literal_eval(mesh_str.replace("Mesh", ""))
            args = (fields["device_ids"], fields["mesh_shape"], fields["axis_names"])
        except (ValueError, SyntaxError, KeyError, TypeError):
            return None
        return cls(*args)


_BY_JAX_MESH: dict = {}


def mesh_for_jax_mesh(jax_mesh) -> Mesh:
    """The Mesh behind a ``jax.sharding.Mesh`` (one made by ``get_jax_mesh``, or an equivalent new one).

    Example::

        mesh_for_jax_mesh(m.get_jax_mesh()) is m   # True
    """
    found = _BY_JAX_MESH.get(jax_mesh)
    if found is None:
        ids = np.vectorize(runtime.device_id)(jax_mesh.devices).reshape(-1)
        names = tuple(jax_mesh.axis_names)
        found = Mesh(ids, tuple(jax_mesh.devices.shape), names)
        _BY_JAX_MESH[jax_mesh] = found
    return found


def jax_axis_names(mesh: Mesh) -> tuple[str, ...]:
    """The axis names the jax mesh uses: the mesh's own, or ``'0'``, ``'1'``, ... when unnamed.

    Example: ``jax_axis_names(Mesh(range(8), (4, 2))) == ('0', '1')``.
    """
    return mesh.axis_names or tuple(str(i) for i in range(len(mesh.mesh_shape)))


def _as_device_ids(device_ids, mesh_shape: tuple):
    """``device_ids`` with each runtime (JAX) device replaced by its global id; torch devices and
    device strings (``st.devices()``, ``'xla:0'``) are refused with the way to write it."""
    if isinstance(device_ids, range):
        return list(device_ids)
    if isinstance(device_ids, np.ndarray) and device_ids.dtype != object:
        return device_ids
    items = list(device_ids.reshape(-1)) if isinstance(device_ids, np.ndarray) else list(device_ids)
    torch_like = [d for d in items if isinstance(d, str) or (hasattr(d, "type") and hasattr(d, "index"))]
    if torch_like:
        count = runtime.global_runtime_device_count()
        raise MeshError(
            f"Mesh takes device ids (ints) or the runtime devices, not torch devices: got {torch_like[0]!r}. "
            "A torch device is the one logical device of SPMD mode (st.devices() is [st.device()]), not the "
            f"{count} physical devices a mesh lays out. Write st.Mesh(st.xla_devices(), {mesh_shape}) or "
            f"st.Mesh(range({count}), {mesh_shape})."
        )
    return [runtime.device_id(d) if isinstance(d, jax.Device) else d for d in items]


def _validate_mesh(ids: np.ndarray, mesh_shape: tuple, axis_names: tuple | None) -> None:
    """PyTorch/XLA's checks in PyTorch/XLA's order, with its messages and a hint each."""
    global_count = runtime.global_runtime_device_count()
    if len(ids) == 0 or global_count == 0:
        raise MeshError(
            f"This requires XLA supported device(s): a mesh needs at least one device "
            f"(got {len(ids)} device IDs; the runtime has {global_count} devices)."
        )
    if len(ids) != global_count:
        raise MeshError(
            f"Number of device IDs ({len(ids)}) must match the global number of devices "
            f"({global_count}). A mesh covers every device; e.g. use range({global_count})."
        )
    if axis_names is not None:
        if len(axis_names) != len(mesh_shape):
            raise MeshError(
                f"Number of axis names ({len(axis_names)}) must match mesh dimensions "
                f"({len(mesh_shape)}): give one name per axis of mesh_shape {mesh_shape}."
            )
        if len(set(axis_names)) != len(axis_names):
            raise MeshError(f"Axis names must be unique, got: {axis_names}")
        if not all(isinstance(name, str) for name in axis_names):
            raise MeshError(f"Axis names must be strings, got: {axis_names}")
    if not all(isinstance(s, (int, np.integer)) and s > 0 for s in mesh_shape):
        raise MeshError(f"mesh_shape must be a tuple of positive ints, got: {mesh_shape}")
    expected = math.prod(mesh_shape)
    if len(ids) != expected:
        raise MeshError(
            f"Number of device IDs ({len(ids)}) must match mesh size ({expected}); "
            f"mesh_shape {mesh_shape} holds {expected} devices."
        )
    if not np.issubdtype(ids.dtype, np.integer):
        raise MeshError(f"Device IDs must be integers, got: {ids}")
    if len(np.unique(ids)) != len(ids):
        raise MeshError(f"Device IDs must be unique, got: {ids}")
    if (ids >= expected).any():
        raise MeshError(f"Device IDs must be less than mesh size ({expected}), got: {ids}")
    if (ids < 0).any():
        raise MeshError(f"Device IDs must be non-negative, got: {ids}")


# --------------------------------------------------------------------------- helpers


def get_1d_mesh(axis_name: str | None = None) -> Mesh:
    """All devices on one axis, in id order.

    Example: ``get_1d_mesh('data').shape() == OrderedDict(data=8)`` on 8 devices.
    """
    count = runtime.global_runtime_device_count()
    return Mesh(range(count), (count,), None if axis_name is None else (axis_name,))


_global_mesh: Mesh | None = None


def set_global_mesh(mesh: Mesh | None) -> None:
    """Make `mesh` the process-wide default mesh (None unsets it).

    Example::

        set_global_mesh(get_1d_mesh('fsdp'))
    """
    global _global_mesh
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"set_global_mesh expects a Mesh or None, got {type(mesh).__name__}.")
    _global_mesh = mesh


def get_global_mesh() -> Mesh | None:
    """The mesh given to `set_global_mesh` (the same object), or None when unset.

    Example: ``set_global_mesh(m); get_global_mesh() is m``.
    """
    return _global_mesh


_all_devices_mesh: Mesh | None = None


def default_mesh() -> Mesh:
    """The mesh replicated tensors live on: the global mesh if set, else a 1-D mesh of all devices.

    Example: ``default_mesh().size() == global_runtime_device_count()`` with no global mesh set.
    """
    global _all_devices_mesh
    if _global_mesh is not None:
        return _global_mesh
    if _all_devices_mesh is None:
        _all_devices_mesh = get_1d_mesh()
    return _all_devices_mesh


# --------------------------------------------------------------------------- HybridMesh


class HybridMesh(Mesh):
    """A mesh over slices joined by a slower network (DCN), each slice fast inside (ICI).

    The mesh shape is ``ici_mesh_shape * dcn_mesh_shape`` (elementwise). Devices are grouped by
    ``slice_index`` (one block of the mesh per slice, blocks laid out by `dcn_mesh_shape`); inside
    a slice they follow their physical ``coords`` when the platform reports them (TPU), else id
    order. Axes are ordered by increasing network intensity (e.g. ``('data', 'fsdp', 'tensor')``).
    `device_attributes` replaces `runtime.global_runtime_device_attributes()` (for tests).

    Example::

        HybridMesh(ici_mesh_shape=(1, 4, 1), dcn_mesh_shape=(2, 1, 1),
                   axis_names=('data', 'fsdp', 'tensor')).shape()
        # OrderedDict([('data', 2), ('fsdp', 4), ('tensor', 1)])   (2 slices of 4 devices)
    """

    ici_mesh_shape: tuple[int, ...]
    dcn_mesh_shape: tuple[int, ...]

    def __init__(
        self,
        *,
        ici_mesh_shape: Sequence[int],
        dcn_mesh_shape: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
        device_attributes: list[dict] | None = None,
    ) -> None:
        ici = tuple(ici_mesh_shape)
        dcn = tuple(dcn_mesh_shape) if dcn_mesh_shape is not None else (1,) * len(ici)
        if len(ici) != len(dcn):
            raise MeshError(
                f"ici_mesh_shape {ici} and dcn_mesh_shape {dcn} must have the same length (one entry per mesh axis)."
            )
        if device_attributes is None:
            device_attributes = runtime.global_runtime_device_attributes()
        by_ordinal = {_device_ordinal(a): a for a in device_attributes}
        multislice = "slice_index" in device_attributes[0]
        if multislice and math.prod(dcn) == 1:
            raise MeshError("Provide dcn_mesh_shape to create a mesh for multislice")
        if not multislice and math.prod(dcn) > 1:
            raise MeshError("Invalid dcn_mesh_shape for single slice mesh")
        if multislice:
            layout = _multislice_device_mesh(ici, dcn, by_ordinal)
        else:
            layout = _slice_device_mesh(ici, sorted(by_ordinal), by_ordinal)
        self.ici_mesh_shape = ici
        self.dcn_mesh_shape = dcn
        super().__init__(layout.reshape(-1), tuple(i * d for i, d in zip(ici, dcn)), axis_names)


def _device_ordinal(attributes: dict) -> int:
    """A device's runtime id: its ``id``, or the number in its name (``'TPU:3'`` -> 3)."""
    if "id" in attributes:
        return int(attributes["id"])
    match = re.search(r"(\d+)$", attributes["name"])
    if match is None:
        raise MeshError(f"device attributes {attributes} have no 'id' and a name that does not end in a number")
    return int(match.group(1))


def _multislice_device_mesh(ici: tuple, dcn: tuple, by_ordinal: dict) -> np.ndarray:
    """One ICI block per slice (slices in slice_index order), blocks arranged as `dcn`: jax's
    ``create_hybrid_device_mesh``, given each slice's devices already laid out by PyTorch/XLA's
    rule (``_slice_device_mesh``; jax's own per-slice layout differs for some TPU kinds)."""
    slices = defaultdict(list)
    for ordinal in sorted(by_ordinal):
        slices[by_ordinal[ordinal]["slice_index"]].append(ordinal)
    if len(slices) != math.prod(dcn):
        raise MeshError(f"Number of slices {len(slices)} must equal the product of dcn_mesh_shape {dcn}")
    laid_out = [
        _LaidOut(int(ordinal), key)
        for key in sorted(slices)
        for ordinal in _slice_device_mesh(ici, slices[key], by_ordinal).reshape(-1)
    ]
    blocks = mesh_utils.create_hybrid_device_mesh(ici, dcn, laid_out)
    return np.vectorize(lambda d: d.id, otypes=[np.int64])(blocks)


class _LaidOut:
    """A device as jax's mesh helpers see it, already in its slice's order: a platform and kind
    they have no layout rule for, so each slice keeps the order given."""

    platform = device_kind = "laid out"

    def __init__(self, ordinal: int, slice_index):
        self.id, self.slice_index = ordinal, slice_index


def _slice_device_mesh(ici: tuple, ordinals: list, by_ordinal: dict) -> np.ndarray:
    """The devices of one slice as an array of shape `ici`, physically laid out where possible."""
    if math.prod(ici) != len(ordinals):
        raise MeshError(f"Number of devices {len(ordinals)} must equal the product of mesh_shape {ici}")
    physical = _physical_mesh(ordinals, by_ordinal)
    if physical is not None:
        assigned = _assign_to_torus(physical, ici)
        if assigned is not None:
            return assigned
    # No coordinates (CPU, GPU) or no clean mapping: plain id order.
    return np.array(ordinals).reshape(ici)


def _physical_mesh(ordinals: list, by_ordinal: dict) -> np.ndarray | None:
    """Ordinals placed at their ``coords`` (plus a core axis when chips have several cores).

    None when devices lack coords or the coords do not fill a box exactly once.
    """
    attributes = [by_ordinal[o] for o in ordinals]
    if not all("coords" in a for a in attributes):
        return None
    positions = [tuple(a["coords"]) for a in attributes]
    if len({a.get("core_on_chip", 0) for a in attributes}) > 1:
        positions = [p + (a.get("core_on_chip", 0),) for p, a in zip(positions, attributes)]
    if len({len(p) for p in positions}) != 1:
        return None
    origin = np.min(positions, axis=0)
    extent = tuple(int(e) for e in np.max(positions, axis=0) - origin + 1)
    if math.prod(extent) != len(ordinals) or len(set(positions)) != len(positions):
        return None
    physical = np.empty(extent, dtype=np.int64)
    for position, ordinal in zip(positions, ordinals):
        physical[tuple(np.subtract(position, origin))] = ordinal
    return physical


def _assign_to_torus(physical: np.ndarray, logical_shape: tuple) -> np.ndarray | None:
    """Map logical axes onto whole physical axes, the most network-intensive (last) first.

    Each logical axis takes the largest set of still-free physical axes whose sizes multiply to
    its size (first such set in combination order), as JAX's ``create_device_mesh`` does for an
    N-d torus. None when some logical axis cannot be made of whole physical axes.
    """
    free = list(physical.shape)
    assignment: list[tuple[int, ...]] = [()] * len(logical_shape)
    for axis in reversed(range(len(logical_shape))):
        axes = _first_axes_with_product(free, logical_shape[axis])
        if axes is None:
            if logical_shape[axis] > 1:
                return None
            axes = ()
        assignment[axis] = axes
        for i in axes:
            free[i] = 0  # taken
    order = [i for axes in assignment for i in axes]
    order += [i for i in range(physical.ndim) if i not in order]  # leftover axes have size 1
    return physical.transpose(order).reshape(logical_shape)


def _first_axes_with_product(free: list, size: int) -> tuple[int, ...] | None:
    for count in range(len(free), 0, -1):
        for axes in itertools.combinations(range(len(free)), count):
            if math.prod(free[i] for i in axes) == size:
                return axes
    return None
