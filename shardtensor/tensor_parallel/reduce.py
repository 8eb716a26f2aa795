"""The reduction of a partial tensor's summands as explicit collectives: ``psum`` over a mesh axis
that becomes ``Replicate()``, ``psum_scatter`` (a reduce-scatter instruction) over one that becomes
``Shard(d)``, run per device with ``jax.shard_map`` — the op ``torch.ops.shardtensor.partial_reduce``
with its lowering, registered into the lowering table like any op.

Left to XLA (a sum under a sharding constraint), a ``Partial`` -> ``Shard(d)`` is an all-reduce and a
slice, which only XLA's GPU and TPU pipelines rewrite into a reduce-scatter; written out here it is a
reduce-scatter on every platform. ``plan`` says when the layouts fit this (the other placements
unchanged, the target dimension split by that one axis, even sizes); otherwise the caller lets XLA do
it.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence

import jax
import torch
from jax import lax

from shardtensor import sharding as sh
from shardtensor.mesh import Mesh
from shardtensor.ops.registry import register
from shardtensor.tensor_parallel.placements import Partial, Placement, Shard


def plan(
    mesh: Mesh, source: Sequence[Placement], target: Sequence[Placement], summand_spec: tuple, out_spec: tuple, shape
) -> str | None:
    """The layout string for ``partial_reduce`` (summands laid out as ``summand_spec`` -> the value
    of ``shape`` laid out as ``out_spec``), or None when explicit collectives do not fit."""
    scatter: list[tuple[int, int | None]] = []  # (mesh axis, target dim or None for Replicate)
    for axis, (src, dst) in enumerate(zip(source, target)):
        if isinstance(src, Partial):
            if isinstance(dst, Shard):
                if sum(isinstance(p, Shard) and p.dim == dst.dim for p in target) != 1:
                    return None  # another axis splits that dimension too: leave the order to XLA
                scatter.append((axis, dst.dim))
            elif not isinstance(dst, Partial):
                scatter.append((axis, None))
        elif src != dst:
            return None  # a data axis moves too: XLA's resharding
    partial_axes = [a for a, p in enumerate(source) if isinstance(p, Partial)]
    reduced = [i for i, a in enumerate(partial_axes) if not isinstance(target[a], Partial)]
    full = tuple(mesh.mesh_shape[a] for a in partial_axes) + tuple(shape)
    out = tuple(mesh.mesh_shape[a] for a in partial_axes if isinstance(target[a], Partial)) + tuple(shape)
    if tuple(sh.padded_shape(full, mesh, summand_spec)) != full or tuple(sh.padded_shape(out, mesh, out_spec)) != out:
        return None  # uneven: the padded layout is XLA's
    op = next(p.reduce_op for p in source if isinstance(p, Partial))
    return json.dumps(
        {
            "mesh": [
                [int(i) for i in mesh.device_ids],
                [int(n) for n in mesh.mesh_shape],
                None if mesh.axis_names is None else list(mesh.axis_names),
            ],
            "in": _plain(summand_spec),
            "out": _plain(out_spec),
            "hidden": len(partial_axes),
            "reduced": reduced,
            "steps": scatter,
            "op": op,
        }
    )


def _plain(spec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _spec(entries) -> tuple:
    return tuple(tuple(e) if isinstance(e, list) else e for e in entries)


@torch.library.custom_op("shardtensor::partial_reduce", mutates_args=())
def partial_reduce(summands: torch.Tensor, layout: str) -> torch.Tensor:
    """The summands (hidden leading dims, see ``partial``) reduced over the hidden dims ``layout``
    names, laid out as its ``out`` spec (on a CPU tensor: the plain sum)."""
    d = json.loads(layout)
    total = summands.sum(dim=tuple(d["reduced"]), dtype=summands.dtype) if d["reduced"] else summands.clone()
    if d["op"] == "avg":
        total = total / math.prod(summands.shape[i] for i in d["reduced"])
    return total


@partial_reduce.register_fake
def _partial_reduce_fake(summands, layout):
    reduced = set(json.loads(layout)["reduced"])
    return summands.new_empty([n for i, n in enumerate(summands.shape) if i not in reduced])


@functools.cache
def _parsed(layout: str):
    d = json.loads(layout)
    ids, shape, names = d["mesh"]
    mesh = Mesh(ids, tuple(shape), None if names is None else tuple(names))
    return mesh, d


@register(torch.ops.shardtensor.partial_reduce.default)
def _partial_reduce_lowering(summands, layout):
    mesh, d = _parsed(layout)
    in_spec, out_spec = _spec(d["in"]), _spec(d["out"])
    names = sh.jax_axis_names(mesh)
    h, reduced = d["hidden"], set(d["reduced"])
    kept = h - len(reduced)
    count = math.prod(mesh.mesh_shape[a] for a, _ in d["steps"])

    def local(s):
        s = s.reshape(tuple(n for i, n in enumerate(s.shape) if i not in reduced))  # (each reduced dim is 1)
        for axis, dim in d["steps"]:
            if dim is None:
                s = lax.psum(s, names[axis])
            else:
                s = lax.psum_scatter(s, names[axis], scatter_dimension=kept + dim, tiled=True)
        return (s / count).astype(s.dtype) if d["op"] == "avg" else s

    return jax.shard_map(
        local,
        mesh=mesh.get_jax_mesh(),
        in_specs=sh.to_jax_spec(mesh, in_spec, len(in_spec)),
        out_specs=sh.to_jax_spec(mesh, out_spec, len(out_spec)),
        check_vma=False,
    )(summands)
