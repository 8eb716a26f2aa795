"""Collectives across the processes of a job, as torch ops (``torch.ops.shardtensor.*``) with lowerings.

In a job of several processes each process holds its own value of a tensor: what ``.cpu()`` reads
there (a replicated tensor's local copy, which may differ from process to process; a sharded
tensor's whole value, the same everywhere). A collective combines the values of the processes of a
group, as torch.distributed's collectives combine those of ranks (a rank is a process). It lowers to
``jax.shard_map`` over the grid of devices by process, so it is part of the one program of a step;
every device of a process computes the same result.

Groups: ``groups`` is a flat list of process indices, ``group_size`` consecutive ones forming one
group, together covering every process (each process runs the same program); an empty list is one
group of all the processes in order. The public face (checked arguments, torch_xla's names) is
``shardtensor.distributed.collectives``; torch.distributed's collectives map onto these ops too.

Example::

    torch.ops.shardtensor.all_reduce(x, "sum", [], 0)             # the sum over every process
    torch.ops.shardtensor.all_gather(x, 0, [0, 1, 2, 3], 2)       # [[0, 1], [2, 3]]: pairs
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardtensor import runtime as rt
from shardtensor.ops.registry import register

REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")
_AXIS = "processes"


# --------------------------------------------------------------------------- groups


def group_rows(groups: list[int], group_size: int) -> list[list[int]]:
    """The groups as rows of process indices (an empty ``groups``: one row of every process).

    Example: ``group_rows([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]``.
    """
    if not groups:
        return [list(range(rt.process_count()))]
    return [list(groups[i : i + group_size]) for i in range(0, len(groups), group_size)]


def group_size_of(groups: list[int], group_size: int) -> int:
    """How many processes each group has."""
    return rt.process_count() if not groups else group_size


@functools.cache
def _tables(groups: tuple[int, ...], group_size: int):
    """(members, position, in_order): for each process, its group's members in group order and its
    own position there; in_order when the one group is every process in process order."""
    rows = group_rows(list(groups), group_size)
    n = rt.process_count()
    members = np.zeros((n, len(rows[0])), np.int32)
    position = np.zeros((n,), np.int32)
    for row in rows:
        for i, p in enumerate(row):
            members[p], position[p] = row, i
    return members, position, rows == [list(range(n))]


@functools.cache
def _process_mesh(devices: tuple) -> Mesh:
    return Mesh(np.array(rt.devices_by_process()), (_AXIS, "local"))


def _per_process(body, *values):
    """``body`` on each device's copy of ``values`` (their whole value), with the axis 'processes'."""
    mesh = _process_mesh(tuple(rt.jax_devices()))
    return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(*values)


def _my(table):
    return jnp.asarray(table)[lax.axis_index(_AXIS)]


def _group_values(x, members):
    """(G, *x.shape): the values of this process's group, in group order."""
    return jnp.take(lax.all_gather(x, _AXIS), _my(members), axis=0)


def _reduce(stack, op: str, dtype):
    if op == "sum":
        out = stack.sum(0)
    elif op == "avg":
        out = stack.sum(0) / stack.shape[0]
    elif op == "product":
        out = stack.prod(0)
    elif op == "min":
        out = stack.min(0)
    elif op == "max":
        out = stack.max(0)
    else:
        combine = {"band": jnp.bitwise_and, "bor": jnp.bitwise_or, "bxor": jnp.bitwise_xor}[op]
        out = functools.reduce(combine, list(stack))
    return out.astype(dtype)


_FAST = {"sum": lax.psum, "avg": lax.psum, "min": lax.pmin, "max": lax.pmax}


def _all_reduce_local(x, op: str, members, in_order: bool):
    if in_order and op in _FAST and x.dtype != jnp.bool_:
        out = _FAST[op](x, _AXIS)
        return (out / members.shape[1]).astype(x.dtype) if op == "avg" else out
    return _reduce(_group_values(x, members), op, x.dtype)


def _check_op(op: str, dtype) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}: use one of {', '.join(REDUCE_OPS)}.")
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"reduce op 'avg' needs a floating-point tensor, got {dtype}.")
    if op in ("band", "bor", "bxor") and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"reduce op {op!r} needs an integer or bool tensor, got {dtype}.")


def _split_size(x: torch.Tensor, dim: int, parts: int, what: str) -> int:
    if x.shape[dim] % parts:
        raise ValueError(
            f"{what}: dimension {dim} of a tensor of shape {tuple(x.shape)} does not split into {parts} "
            "equal parts (one per process of the group)."
        )
    return x.shape[dim] // parts


def _cpu_only_alone(name: str, groups: list[int], group_size: int) -> None:
    if group_size_of(groups, group_size) != 1:
        raise RuntimeError(
            f"shardtensor.{name} on a CPU tensor in a job of several processes: move the tensor to "
            "st.device(), or use torch.distributed with gloo for CPU tensors."
        )


# --------------------------------------------------------------------------- the ops


@torch.library.custom_op("shardtensor::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, reduce_op: str, groups: list[int], group_size: int) -> torch.Tensor:
    """The reduction (``reduce_op`` of REDUCE_OPS) of ``x`` over the processes of each group."""
    _check_op(reduce_op, x.dtype)
    _cpu_only_alone("all_reduce", groups, group_size)
    return x.clone()


@all_reduce.register_fake
def _all_reduce_fake(x, reduce_op, groups, group_size):
    _check_op(reduce_op, x.dtype)
    return torch.empty_like(x)


@register(torch.ops.shardtensor.all_reduce.default)
def _all_reduce_lowering(x, reduce_op, groups, group_size):
    members, _, in_order = _tables(tuple(groups), group_size)
    return _per_process(lambda v: _all_reduce_local(v, reduce_op, members, in_order), x)


@torch.library.custom_op("shardtensor::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, groups: list[int], group_size: int) -> torch.Tensor:
    """The values of ``x`` of the processes of each group, concatenated along ``dim`` in group order."""
    _cpu_only_alone("all_gather", groups, group_size)
    return x.clone()


@all_gather.register_fake
def _all_gather_fake(x, dim, groups, group_size):
    shape = list(x.shape)
    shape[dim] *= group_size_of(groups, group_size)
    return x.new_empty(shape)


@register(torch.ops.shardtensor.all_gather.default)
def _all_gather_lowering(x, dim, groups, group_size):
    members, _, in_order = _tables(tuple(groups), group_size)

    def local(v):
        if in_order:
            return lax.all_gather(v, _AXIS, axis=dim, tiled=True)
        return jnp.concatenate(list(_group_values(v, members)), axis=dim)

    return _per_process(local, x)


@torch.library.custom_op("shardtensor::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, reduce_op: str, dim: int, groups: list[int], group_size: int) -> torch.Tensor:
    """The reduction of ``x`` over each group, split along ``dim`` into one part per member: each
    process keeps the part at its position in its group."""
    _check_op(reduce_op, x.dtype)
    _cpu_only_alone("reduce_scatter", groups, group_size)
    return x.clone()


@reduce_scatter.register_fake
def _reduce_scatter_fake(x, reduce_op, dim, groups, group_size):
    _check_op(reduce_op, x.dtype)
    shape = list(x.shape)
    shape[dim] = _split_size(x, dim, group_size_of(groups, group_size), "reduce_scatter")
    return x.new_empty(shape)


@register(torch.ops.shardtensor.reduce_scatter.default)
def _reduce_scatter_lowering(x, reduce_op, dim, groups, group_size):
    members, position, in_order = _tables(tuple(groups), group_size)
    size = members.shape[1]

    def local(v):
        if in_order and reduce_op in ("sum", "avg") and v.dtype != jnp.bool_:
            out = lax.psum_scatter(v, _AXIS, scatter_dimension=dim, tiled=True)
            return (out / size).astype(v.dtype) if reduce_op == "avg" else out
        reduced = _reduce(_group_values(v, members), reduce_op, v.dtype)
        chunk = v.shape[dim] // size
        return lax.dynamic_slice_in_dim(reduced, _my(position) * chunk, chunk, axis=dim)

    return _per_process(local, x)


@torch.library.custom_op("shardtensor::all_to_all", mutates_args=())
def all_to_all(x: torch.Tensor, split_dim: int, concat_dim: int, groups: list[int], group_size: int) -> torch.Tensor:
    """``x`` split along ``split_dim`` into one part per member of the group; part i goes to the member
    at position i, and each process concatenates what it receives along ``concat_dim`` in group order."""
    _cpu_only_alone("all_to_all", groups, group_size)
    return x.clone()


@all_to_all.register_fake
def _all_to_all_fake(x, split_dim, concat_dim, groups, group_size):
    size = group_size_of(groups, group_size)
    shape = list(x.shape)
    shape[split_dim] = _split_size(x, split_dim, size, "all_to_all")
    shape[concat_dim] *= size
    return x.new_empty(shape)


@register(torch.ops.shardtensor.all_to_all.default)
def _all_to_all_lowering(x, split_dim, concat_dim, groups, group_size):
    members, position, in_order = _tables(tuple(groups), group_size)
    size = members.shape[1]

    def local(v):
        if in_order:
            return lax.all_to_all(v, _AXIS, split_dim, concat_dim, tiled=True)
        chunk = v.shape[split_dim] // size
        start = _my(position) * chunk
        parts = [lax.dynamic_slice_in_dim(w, start, chunk, axis=split_dim) for w in _group_values(v, members)]
        return jnp.concatenate(parts, axis=concat_dim)

    return _per_process(local, x)


@torch.library.custom_op("shardtensor::broadcast", mutates_args=())
def broadcast(x: torch.Tensor, src: int, groups: list[int], group_size: int) -> torch.Tensor:
    """The value of ``x`` of the member at position ``src`` of each group (its group rank)."""
    _cpu_only_alone("broadcast", groups, group_size)
    return x.clone()


@broadcast.register_fake
def _broadcast_fake(x, src, groups, group_size):
    size = group_size_of(groups, group_size)
    if not 0 <= src < size:
        raise ValueError(f"broadcast: src {src} is not a position in a group of {size} processes.")
    return torch.empty_like(x)


@register(torch.ops.shardtensor.broadcast.default)
def _broadcast_lowering(x, src, groups, group_size):
    members, _, _ = _tables(tuple(groups), group_size)
    # gathered, not a masked sum: a sum would turn the source's -0.0 into 0.0
    return _per_process(lambda v: _group_values(v, members)[src], x)


@torch.library.custom_op("shardtensor::collective_permute", mutates_args=())
def collective_permute(x: torch.Tensor, pairs: list[int]) -> torch.Tensor:
    """Process ``pairs[2i]`` sends its ``x`` to process ``pairs[2i + 1]``; a process no one sends to
    receives zeros."""
    if rt.process_count() != 1:
        _cpu_only_alone("collective_permute", [], 0)
    return x.clone() if (0, 0) in zip(pairs[::2], pairs[1::2]) else torch.zeros_like(x)


@collective_permute.register_fake
def _collective_permute_fake(x, pairs):
    return torch.empty_like(x)


@register(torch.ops.shardtensor.collective_permute.default)
def _collective_permute_lowering(x, pairs):
    perm = list(zip(pairs[::2], pairs[1::2]))
    return _per_process(lambda v: lax.ppermute(v, _AXIS, perm), x)


# --------------------------------------------------------------------------- gradients


def _setup(ctx, inputs, output):
    ctx.args = inputs[1:]


def _all_reduce_backward(ctx, grad):
    op, groups, size = ctx.args
    if op not in ("sum", "avg"):
        raise RuntimeError(f"all_reduce with reduce op {op!r} has no gradient (only 'sum' and 'avg' have).")
    return all_reduce(grad, op, groups, size), None, None, None


def _all_gather_backward(ctx, grad):
    dim, groups, size = ctx.args
    return reduce_scatter(grad, "sum", dim, groups, size), None, None, None


def _reduce_scatter_backward(ctx, grad):
    op, dim, groups, size = ctx.args
    if op not in ("sum", "avg"):
        raise RuntimeError(f"reduce_scatter with reduce op {op!r} has no gradient (only 'sum' and 'avg' have).")
    gathered = all_gather(grad, dim, groups, size)
    return (gathered / group_size_of(groups, size) if op == "avg" else gathered), None, None, None, None


def _all_to_all_backward(ctx, grad):
    split_dim, concat_dim, groups, size = ctx.args
    return all_to_all(grad, concat_dim, split_dim, groups, size), None, None, None, None


def _collective_permute_backward(ctx, grad):
    (pairs,) = ctx.args
    return collective_permute(grad, [p for pair in zip(pairs[1::2], pairs[::2]) for p in pair]), None


for _op, _backward in (
    (all_reduce, _all_reduce_backward),
    (all_gather, _all_gather_backward),
    (reduce_scatter, _reduce_scatter_backward),
    (all_to_all, _all_to_all_backward),
    (collective_permute, _collective_permute_backward),
):
    _op.register_autograd(_backward, setup_context=_setup)
