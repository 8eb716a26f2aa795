"""Replicated inputs living on another mesh: copied onto a program's mesh once, and kept there.

A program runs on one mesh. A replicated input that lives on another one (typically parameters
moved with ``model.to(st.device())`` before any global mesh was set: they land on the 1-D mesh of
all devices, while the batch is sharded over the user's mesh) is copied onto the program's mesh
(``program.to_mesh``, counted as ``ReplicateToGraphMesh``). ``keep_moved`` stores that copy back into
the input's cell, so the next call finds it there and copies nothing: the value is the same,
replicated, on the same devices. ``warn_repeated_copy`` says once, with what to do, when one tensor is copied a second
time (a cell with the user's sharding on another mesh keeps its own array, a tensor read by programs
on two meshes in turn moves back and forth).

``renamed`` gives an array the program's name for a layout equivalent to its own (``P(None)`` and
``P()`` both replicate a vector; jax compiles a program per name): the same buffers, no copy.
"""

from __future__ import annotations

import warnings
import weakref

import jax

from shardtensor.graph import checks, inflight
from shardtensor.graph.ir import Cell
from shardtensor.graph.program import describe_mesh, mesh_of


class MeshCopyWarning(UserWarning):
    """Inputs of a program are copied onto its mesh on every call (``ReplicateToGraphMesh``)."""


def keep_moved(cell: Cell | None, before, moved, mesh) -> bool:
    """Note that ``before``, the replicated array of ``cell``, was copied as ``moved`` onto ``mesh`` (a
    program's), and give the cell that copy, so later programs on that mesh read it without a copy;
    True if it was kept. Copying that same array (or the copy kept) again warns
    (``warn_repeated_copy``).

    Only a cell that still holds ``before`` and carries no sharding of the user's (that names its
    mesh) takes it; a run in flight that computed ``before`` answers for the copy too. The copy
    belongs to the cell alone: a later program that overwrites the cell may donate it.

    Example::

        for i, before in program.moved:
            keep_moved(leaf_cells[i], before, arrays[i], program.mesh)
    """
    if cell is None:
        return False
    last = _last_copied.get(cell)
    if last is not None and last() is before:  # this very array was copied, or is such a copy
        warn_repeated_copy(cell, before, mesh)
    if cell.sharding is not None or cell.value is not before:
        _last_copied[cell] = weakref.ref(before)
        return False
    _follow_copy(before, moved)
    cell.value = moved
    cell._leaf = None
    cell.owned = True
    cell.layout = None  # an in-place update keeps the layout the data has now
    _last_copied[cell] = weakref.ref(moved)
    return True


# cell -> the array of its last copy onto another mesh, as it was if the copy was not kept, else
# the copy it kept: copying that same array again is a copy on every call (weak: keeps nothing alive)
_last_copied: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_warned = False


def warn_repeated_copy(cell: Cell, before, mesh) -> None:
    """Warn (once per process) that ``cell``, whose replicated array ``before`` is not on ``mesh``,
    was copied onto that mesh again.

    Example::

        warn_repeated_copy(cell, cell.value, program.mesh)
    """
    global _warned
    if _warned:
        return
    _warned = True
    source = mesh_of(before)
    where = f"on {describe_mesh(source)}" if source is not None else "on one device"
    site = inflight.user_site()
    text = (
        f"shardtensor: a replicated tensor of shape {tuple(cell.shape)} and dtype {cell.dtype} living "
        f"{where} was copied onto {describe_mesh(mesh)}, the mesh of a program reading it, again "
        "(ReplicateToGraphMesh): such a copy is repeated on every call. Create or move the tensors "
        "onto the mesh the computation uses: call st.set_global_mesh(mesh) before "
        "model.to(st.device()) or before uploading, or give them that mesh "
        "(st.mark_sharding(t, mesh, (None,) * t.dim()) keeps one replicated). A tensor that programs "
        "on two meshes read in turn is copied each time."
    )
    if site is None:
        warnings.warn(text, MeshCopyWarning, stacklevel=2)
    else:
        warnings.warn_explicit(text, MeshCopyWarning, site[0], site[1])


def renamed(cell: Cell, array, sharding):
    """``array`` (``cell``'s value) under ``sharding`` when that names the same layout, sharing its
    buffers (no copy), or None when the layouts differ. The cell takes it, so later calls find it
    as it is (an XLA-chosen output may say ``P(None)`` where an upload says ``P()``: a frozen replay
    taking one must not trace again for the other).

    Example::

        renamed(cell, x, NamedSharding(mesh, P()))   # x was NamedSharding(mesh, P(None))
    """
    if not isinstance(sharding, jax.sharding.Sharding) or not array.sharding.is_equivalent_to(sharding, array.ndim):
        return None
    shards = [s.data for s in array.addressable_shards]
    moved = jax.make_array_from_single_device_arrays(array.shape, sharding, shards)
    if cell.value is array:
        _follow_copy(array, moved)
        cell.value = moved
        cell._leaf = None
    return moved


def _follow_copy(array, copy) -> None:
    """A cell that held ``array`` now holds ``copy``: a run in flight or an unread failed check that
    answers for ``array`` answers for ``copy`` too."""
    inflight.follow_copy(array, copy)
    checks.follow_copy(array, copy)
