"""Annotating tensors with shardings: ``shard``, ``mark_sharding``, ``clear_sharding``."""

from __future__ import annotations

from typing import cast

import jax
import numpy as np
import torch

from shardtensor import metrics as counters
from shardtensor import sharding as sh
from shardtensor.dtypes import to_torch, torch_to_numpy
from shardtensor.graph import views
from shardtensor.graph.execute import run_cells
from shardtensor.graph.ir import Node, Pending
from shardtensor.graph.state import STATE, locked, set_concrete, set_pending
from shardtensor.mesh import Mesh
from shardtensor.sharding import SpecLike
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.upload import cell_from_host


def shard(t: torch.Tensor | np.ndarray | np.generic | jax.Array, mesh: Mesh, partition_spec: SpecLike) -> ShardedTensor:
    """A new ShardedTensor holding ``t`` laid out over ``mesh`` as ``partition_spec``.

    ``t`` may be a torch CPU tensor, a numpy array, a jax array or a ShardedTensor. Each device
    receives only its own shard; uneven dimensions are padded invisibly.

    Example::

        mesh = st.Mesh(range(8), (4, 2), ("x", "y"))
        x = st.shard(torch.randn(10, 4), mesh, ("x", None))
    """
    _check_mesh(mesh)
    if isinstance(t, ShardedTensor):
        if _stored_on_other_mesh(t, mesh):
            t = t.detach().cpu()  # one graph cannot span two meshes: go through the host
        else:
            with torch.no_grad():
                out = cast(ShardedTensor, t.detach().clone())  # (torch's stubs say Tensor)
            out._cell.sharding = None  # the clone's annotation is replaced below
            return mark_sharding(out, mesh, partition_spec)
    if isinstance(t, torch.Tensor):
        if t.device.type != "cpu":
            raise ValueError(f"st.shard takes CPU tensors; got a tensor on {t.device}")
        host, dtype, requires_grad = torch_to_numpy(t), t.dtype, t.requires_grad
    elif isinstance(t, (np.ndarray, jax.Array, np.generic)):
        host = np.asarray(t)
        dtype, requires_grad = to_torch(host.dtype), False
    else:
        raise TypeError(f"st.shard takes a torch tensor, numpy array or jax array, not {type(t).__name__}")
    spec = _checked_spec(mesh, partition_spec, host.ndim)
    out = ShardedTensor(cell_from_host(host, mesh, spec, dtype))
    if requires_grad:
        out.requires_grad_(True)
    return out


@locked
def mark_sharding(t: ShardedTensor, mesh: Mesh, partition_spec: SpecLike) -> ShardedTensor:
    """Shard ``t`` in place over ``mesh`` as ``partition_spec`` and return it.

    The same spec again does nothing; replicated -> sharded is allowed; another non-replicated spec
    on a computed tensor is an error (clear it first). On a pending tensor (lazy mode, or inside
    ``compile``) it adds a sharding constraint to the graph instead of moving data.

    Example::

        st.mark_sharding(model.weight, mesh, ("y", None))
    """
    _check_mesh(mesh)
    if not isinstance(t, ShardedTensor):
        raise TypeError(
            "mark_sharding needs a tensor on st.device() (a ShardedTensor); "
            f"got {type(t).__name__} on {getattr(t, 'device', '?')}. Move it with t.to(st.device()) "
            "or use st.shard(t, mesh, spec)."
        )
    if t._chain:
        raise ValueError("mark_sharding on a view is not supported: mark the tensor it views instead")
    spec = _checked_spec(mesh, partition_spec, t.dim())
    cell = t._cell
    counters.increment("XlaMarkSharding")
    if cell.spec is not None:
        if cell.mesh == mesh and _same(mesh, cell.spec, spec, t.dim()):
            return t
        replicated = sh.sharding_type(cell.mesh, cell.spec, t.dim()) == sh.ShardingType.REPLICATED
        if not cell.is_pending() and not replicated:
            raise RuntimeError(
                f"Existing annotation must be cleared first: this tensor is already sharded as "
                f"{sh.sharding_string(cell.mesh, cell.spec, t.dim())}. Call st.clear_sharding(t) before "
                "marking it with another spec."
            )
    sharding = sh.named_sharding(mesh, spec, t.dim())
    ref = views.read(t)
    node = Node(lambda x: (jax.lax.with_sharding_constraint(x, sharding),), ("constraint", sharding), (ref,))
    cell.sharding = sh.ShardingSpec(mesh, spec)
    was_pending = cell.is_pending()
    set_pending(cell, Pending(node, 0))
    if not was_pending and not STATE.tracing:
        run_cells([cell])  # a computed tensor: move its data now
    return t


@locked
def clear_sharding(t: ShardedTensor) -> ShardedTensor:
    """Forget the sharding annotation of ``t`` (its data stays where it is) and return it.

    Example::

        st.clear_sharding(x); st.mark_sharding(x, mesh, ("y", None))
    """
    if not isinstance(t, ShardedTensor):
        raise TypeError(f"clear_sharding needs a ShardedTensor, got {type(t).__name__}")
    cell = t._cell
    if cell.spec is not None and not cell.is_pending():
        array = cell.value
        if tuple(array.shape) != tuple(cell.shape):  # drop the padding: it belonged to the old spec
            set_concrete(cell, array[tuple(slice(0, n) for n in cell.shape)], owned=True)
    cell.sharding = None
    return t


def _stored_on_other_mesh(t, mesh) -> bool:
    """True when ``t``'s data is sharded (not replicated) over a mesh other than ``mesh``."""
    cell = t._cell
    if cell.spec is not None and not t._chain:
        return cell.mesh != mesh and sh.sharding_type(cell.mesh, cell.spec, t.dim()) != sh.ShardingType.REPLICATED
    if cell.is_pending():
        return False
    s = getattr(cell.value, "sharding", None)
    return isinstance(s, jax.sharding.NamedSharding) and not s.is_fully_replicated and s.mesh != mesh.get_jax_mesh()


def _checked_spec(mesh, partition_spec, ndim):
    spec = tuple(tuple(e) if isinstance(e, list) else e for e in partition_spec)
    sh.normalize_spec(mesh, spec, ndim)  # raises a clear ShardingSpecError
    return spec


def _same(mesh, a, b, ndim):
    return sh.normalize_spec(mesh, a, ndim) == sh.normalize_spec(mesh, b, ndim)


def _check_mesh(mesh):
    if not isinstance(mesh, Mesh):
        raise TypeError(f"expected a st.Mesh, got {type(mesh).__name__}")
