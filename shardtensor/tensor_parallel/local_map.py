"""``st.local_map``: DTensor's ``local_map`` — a torch function run on local shards, with placements.

It is ``st.shard_map`` spoken in placements: ``in_placements`` (one tuple of placements per argument)
say how each argument is split, ``out_placements`` how the results are put together. A ``Partial()``
result placement means the function's local results are partial values along that mesh axis; they are
reduced (an all-reduce at the end of the region) so the result is the full value, replicated along it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardtensor.manual import all_reduce, shard_map
from shardtensor.mesh import Mesh, default_mesh
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor_parallel.placements import Partial, Replicate, Shard, placements_to_spec

_REDUCE = ("sum", "avg", "max", "min")


def local_map(
    func: Callable,
    out_placements: Any,
    in_placements: Sequence | None = None,
    in_grad_placements: Any = None,
    device_mesh: Mesh | None = None,
    *,
    redistribute_inputs: bool = False,
) -> Callable:
    """``func`` (torch, on local shards) as a function of global tensors (DTensor's ``local_map``).

    ``out_placements``: the placements of the result (one per mesh axis), or a tuple of those, one per
    result. ``in_placements``: one tuple of placements per argument (``None`` for a non-tensor
    argument, passed as it is); by default each tensor's own (``x.placements``, replicated when it
    has no spec). ``in_grad_placements`` is accepted for DTensor's signature: gradients come from
    the region's own backward. Inputs are always moved to ``in_placements`` (inside the one program)
    whatever ``redistribute_inputs`` says.

    Example::

        mesh = st.init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
        row_parallel = st.local_map(lambda x, w: x @ w, out_placements=[st.Partial()],
                                    in_placements=([st.Shard(1)], [st.Shard(0)]), device_mesh=mesh)
        y = row_parallel(x, w)    # x @ w, the partial products summed over "tp"
    """
    del in_grad_placements, redistribute_inputs

    def mapped(*args: Any) -> Any:
        mesh = device_mesh or _mesh_of(args)
        chosen = in_placements if in_placements is not None else [_own_placements(a, mesh) for a in args]
        if len(chosen) != len(args):
            raise ValueError(f"st.local_map: {len(chosen)} in_placements for {len(args)} arguments.")
        tensor_at = [i for i, p in enumerate(chosen) if p is not None]
        for i in tensor_at:
            if not isinstance(args[i], torch.Tensor):
                raise TypeError(f"st.local_map: argument {i} has placements but is a {type(args[i]).__name__}.")
        in_specs = [placements_to_spec(chosen[i], mesh, args[i].dim()) for i in tensor_at]
        single = _is_placements(out_placements)
        outs = [_as_tuple(out_placements)] if single else [_as_tuple(p) for p in out_placements]

        def local(*tensors):
            full = list(args)
            for i, t in zip(tensor_at, tensors):
                full[i] = t
            result = func(*full)
            results = [result] if single else list(result)
            if len(results) != len(outs):
                raise ValueError(
                    f"st.local_map: the function returns {len(results)} results but out_placements describes "
                    f"{len(outs)}."
                )
            reduced = [_reduce_partials(r, p, mesh) for r, p in zip(results, outs)]
            return reduced[0] if single else tuple(reduced)

        local.__qualname__ = getattr(func, "__qualname__", "local_map")

        def out_specs(ndims):
            ranks = [ndims] if single else list(ndims)
            specs = tuple(placements_to_spec(_without_partial(p), mesh, r) for p, r in zip(outs, ranks))
            return specs[0] if single else specs

        return shard_map(local, mesh, in_specs, out_specs)(*[args[i] for i in tensor_at])

    # Dynamo cannot trace the setting up of a region on each call: under torch.compile the call is a
    # graph break and runs as it does outside (st.shard_map itself is one op under torch.compile).
    # torch.compiler.disable imports torch._dynamo (once, about 3 s) on the first st.local_map.
    return torch.compiler.disable(mapped, reason="st.local_map sets its region up in Python on each call")


def _is_placements(p) -> bool:
    """Whether ``p`` is one result's placements (not a sequence of them, one per result)."""
    return isinstance(p, (Shard, Replicate, Partial)) or all(isinstance(x, (Shard, Replicate, Partial)) for x in p)


def _as_tuple(p) -> tuple:
    return (p,) if isinstance(p, (Shard, Replicate, Partial)) else tuple(p)


def _mesh_of(args) -> Mesh:
    for a in args:
        if isinstance(a, ShardedTensor) and a.mesh is not None:
            return a.mesh
    return default_mesh()


def _own_placements(a, mesh: Mesh):
    if not isinstance(a, torch.Tensor):
        return None
    if isinstance(a, ShardedTensor) and a.mesh == mesh and a.partition_spec is not None:
        return a.placements
    return tuple(Replicate() for _ in mesh.mesh_shape)


def _without_partial(placements) -> tuple:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _reduce_partials(t, placements, mesh: Mesh):
    names = mesh.axis_names or tuple(str(i) for i in range(len(mesh.mesh_shape)))
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            if p.reduce_op not in _REDUCE:
                raise ValueError(f"st.local_map: a {p!r} result cannot be reduced in a region (use one of {_REDUCE}).")
            t = all_reduce(t, names[axis], p.reduce_op)
    return t
