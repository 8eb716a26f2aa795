"""Sharding facts and hints for lowerings, without knowing the mesh they will run on.

A lowering is a function of jax values; inside a graph the values carry the (abstract) mesh of their
inputs, so a lowering can still read the mesh size or constrain a value's layout. These serve only
to avoid places where XLA's SPMD partitioner (jax 0.10.2) gives wrong results, never for speed:

* a scatter whose index dimension is sharded unevenly: the partitioner pads the indices with a valid
  position and keeps the padded updates (garbage, or the broadcast value), so they are combined into
  the operand ('set' alone is masked). ``ops/indexing.write_at`` pads the flattened index dimension to
  a multiple of the mesh size itself (with dropped positions), so every sharding of it is even;
* convolutions: see ``ops/conv.py`` for the layouts the partitioner gets wrong or aborts on; there
  operands and results are given a layout it handles (``constrain``).

Outside a mesh (concrete arrays, a graph on one device) these do nothing.

Example::

    n = mesh_size(index)                   # 8 inside a graph over a (4, 2) mesh, else None
    x = constrain(x, (MESH, None, FREE))   # batch over every mesh axis, channels whole, rest free
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _mesh(x):
    try:
        mesh = jax.typeof(x).sharding.mesh
    except (AttributeError, TypeError):
        return None
    return mesh if mesh.axis_names else None


def mesh_size(*values):
    """Devices in the mesh the first of ``values`` that has one lives on (None: no mesh)."""
    for v in values:
        mesh = _mesh(v) if isinstance(v, jax.Array) else None
        if mesh is not None:
            return mesh.size
    return None


FREE = "free"  # ``constrain``: this dim is left to XLA's sharding propagation
MESH = "mesh"  # ``constrain``: this dim is split over every axis of the mesh


def constrain(x, layout):
    """``x`` constrained to ``layout``: one entry per leading dim, the last entry repeated for the
    remaining dims; an entry is None (unsharded), ``FREE`` (left to XLA) or ``MESH`` (split over all
    mesh axes, in order). Outside a mesh ``x`` is returned as is.

    Example: ``constrain(x, (FREE, None))`` keeps every dim but the first unsharded."""
    if not hasattr(x, "ndim") or x.ndim == 0:
        return x
    mesh = _mesh(x)
    if mesh is None:
        return x
    entries = tuple(layout[min(d, len(layout) - 1)] for d in range(x.ndim))
    table = {None: None, FREE: P.UNCONSTRAINED, MESH: tuple(mesh.axis_names)}
    spec = P(*(table[e] for e in entries))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
