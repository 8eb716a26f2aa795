"""Annotating tensors with shardings: ``shard``, ``mark_sharding``, ``clear_sharding``."""

from __future__ import annotations

from typing import TypeVar, cast, overload

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

_M = TypeVar("_M", bound=torch.nn.Module)


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
            return _mark_tensor(out, mesh, partition_spec)
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


@overload
def mark_sharding(t: torch.Tensor, mesh: Mesh, partition_spec: SpecLike) -> ShardedTensor: ...
@overload
def mark_sharding(t: _M, mesh: Mesh, partition_spec: SpecLike) -> _M: ...


def mark_sharding(
    t: torch.Tensor | torch.nn.Module, mesh: Mesh, partition_spec: SpecLike
) -> ShardedTensor | torch.nn.Module:
    """Shard ``t`` in place over ``mesh`` as ``partition_spec`` and return it.

    The same spec again does nothing; replicated -> sharded is allowed; another non-replicated spec
    on a computed tensor is an error (clear it first). On a pending tensor (lazy mode, or inside
    ``compile``) it adds a sharding constraint to the graph instead of moving data.

    ``t`` may also be an ``nn.Module`` on ``st.device()``: every parameter whose number of
    dimensions equals ``len(partition_spec)`` is marked with it, the others (biases under a 2-d
    spec, say) and the buffers stay as they are; a module with no such parameter is an error.

    Example::

        st.mark_sharding(model.weight, mesh, ("y", None))
        st.mark_sharding(model, mesh, ("y", None))   # every 2-d parameter of model
    """
    _check_mesh(mesh)
    if isinstance(t, torch.nn.Module):
        return _mark_module(t, mesh, partition_spec)
    if not isinstance(t, ShardedTensor):
        raise TypeError(_not_on_device("mark_sharding", t, module_too=True))
    return _mark_tensor(t, mesh, partition_spec)


def _not_on_device(what: str, t, module_too: bool = False) -> str:
    """Why ``t`` cannot be marked, and what to write instead."""
    if isinstance(t, torch.Tensor):
        return (
            f"{what} needs a tensor on st.device() (a ShardedTensor); got a tensor on {t.device}. Move it "
            "with t = t.to(st.device()), or make a sharded copy with st.shard(t, mesh, spec)."
        )
    return (
        f"{what} takes a tensor on st.device() (a ShardedTensor){' or an nn.Module' if module_too else ''}; "
        f"got {type(t).__name__}."
    )


def _mark_module(module: torch.nn.Module, mesh: Mesh, partition_spec: SpecLike):
    """``mark_sharding`` of each parameter of ``module`` whose rank is ``len(partition_spec)``."""
    name = type(module).__name__
    params = list(module.named_parameters())
    off_device = [(n, p) for n, p in params if not isinstance(p, ShardedTensor)]
    if off_device:
        n, p = off_device[0]
        raise TypeError(
            f"mark_sharding({name}, ...): its parameter {n!r} is on {p.device}, not on st.device(). Move the "
            f"module first: model.to(st.device()), then st.mark_sharding(model, mesh, spec)."
        )
    rank = len(tuple(partition_spec))
    chosen = [p for _, p in params if p.dim() == rank]
    if not chosen:
        ranks = sorted({p.dim() for _, p in params})
        raise ValueError(
            f"mark_sharding({name}, mesh, {tuple(partition_spec)!r}): the spec has {rank} entries, and no "
            f"parameter has {rank} dimensions (they have {ranks}), so nothing would be sharded. Give a spec "
            "with one entry per dimension, or mark the parameters one by one (st.mark_sharding(model.fc.weight, ...))."
        )
    for p in chosen:
        _mark_tensor(p, mesh, partition_spec)
    return module


@locked
def _mark_tensor(t: ShardedTensor, mesh: Mesh, partition_spec: SpecLike) -> ShardedTensor:
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
        raise TypeError(_not_on_device("clear_sharding", t))
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
