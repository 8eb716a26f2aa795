"""Collectives over named mesh axes, for the inside of a manual region (``st.shard_map``).

Inside a region each device holds its local block of every tensor; these ops combine the blocks of
the devices along some mesh axes (``axes``: one or more axis names), as ``jax.lax``'s collectives do.
They lower to those collectives, so they only make sense while the region's function is lowered
under ``jax.shard_map``; the public face (``st.manual.*``) refuses to run them elsewhere. Sizes the
result shape depends on (``size``: the number of devices along ``axes``) are arguments, so the fake
kernels know shapes without a mesh.

Example::

    torch.ops.shardtensor.axis_reduce(x, "tp", "sum")            # lax.psum(x, "tp")
    torch.ops.shardtensor.axis_all_gather(x, "tp", 0, 4)          # lax.all_gather(x, "tp", tiled=True)
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from shardtensor.ops.registry import register

AXIS_REDUCE_OPS = ("sum", "avg", "max", "min")


def _outside(name: str):
    return RuntimeError(
        f"shardtensor::{name} is a collective over mesh axes: it runs only inside a manual region "
        "(st.shard_map / st.local_map), on the region's local tensors."
    )


def _names(axes: str):
    names = tuple(axes.split(","))
    return names if len(names) != 1 else names[0]


@torch.library.custom_op("shardtensor::axis_reduce", mutates_args=())
def axis_reduce(x: torch.Tensor, axes: str, reduce_op: str) -> torch.Tensor:
    """The ``reduce_op`` (sum, avg, max, min) of ``x`` over the devices along ``axes``."""
    raise _outside("axis_reduce")


@axis_reduce.register_fake
def _axis_reduce_fake(x, axes, reduce_op):
    return torch.empty_like(x)


@register(torch.ops.shardtensor.axis_reduce.default)
def _axis_reduce_lowering(x, axes, reduce_op):
    names = _names(axes)
    if reduce_op == "sum":
        return lax.psum(x, names)
    if reduce_op == "avg":
        return lax.pmean(x, names).astype(x.dtype)
    return (lax.pmax if reduce_op == "max" else lax.pmin)(x, names)


@torch.library.custom_op("shardtensor::axis_all_gather", mutates_args=())
def axis_all_gather(x: torch.Tensor, axes: str, dim: int, size: int) -> torch.Tensor:
    """The blocks of the ``size`` devices along ``axes``, concatenated along ``dim`` in axis order."""
    raise _outside("axis_all_gather")


@axis_all_gather.register_fake
def _axis_all_gather_fake(x, axes, dim, size):
    shape = list(x.shape)
    shape[dim] *= size
    return x.new_empty(shape)


@register(torch.ops.shardtensor.axis_all_gather.default)
def _axis_all_gather_lowering(x, axes, dim, size):
    return lax.all_gather(x, _names(axes), axis=dim, tiled=True)


@torch.library.custom_op("shardtensor::axis_reduce_scatter", mutates_args=())
def axis_reduce_scatter(x: torch.Tensor, axes: str, dim: int, size: int) -> torch.Tensor:
    """The sum of ``x`` over the devices along ``axes``, split along ``dim``: each keeps its part."""
    raise _outside("axis_reduce_scatter")


@axis_reduce_scatter.register_fake
def _axis_reduce_scatter_fake(x, axes, dim, size):
    shape = list(x.shape)
    shape[dim] //= size
    return x.new_empty(shape)


@register(torch.ops.shardtensor.axis_reduce_scatter.default)
def _axis_reduce_scatter_lowering(x, axes, dim, size):
    return lax.psum_scatter(x, _names(axes), scatter_dimension=dim, tiled=True)


@torch.library.custom_op("shardtensor::axis_all_to_all", mutates_args=())
def axis_all_to_all(x: torch.Tensor, axes: str, split_dim: int, concat_dim: int, size: int) -> torch.Tensor:
    """``x`` split along ``split_dim`` into ``size`` parts, part i sent to device i along ``axes``; what
    each receives is concatenated along ``concat_dim``."""
    raise _outside("axis_all_to_all")


@axis_all_to_all.register_fake
def _axis_all_to_all_fake(x, axes, split_dim, concat_dim, size):
    shape = list(x.shape)
    shape[split_dim] //= size
    shape[concat_dim] *= size
    return x.new_empty(shape)


@register(torch.ops.shardtensor.axis_all_to_all.default)
def _axis_all_to_all_lowering(x, axes, split_dim, concat_dim, size):
    return lax.all_to_all(x, _names(axes), split_dim, concat_dim, tiled=True)


@torch.library.custom_op("shardtensor::axis_ppermute", mutates_args=())
def axis_ppermute(x: torch.Tensor, axes: str, pairs: list[int]) -> torch.Tensor:
    """Device ``pairs[2i]`` (its index along ``axes``) sends its ``x`` to device ``pairs[2i + 1]``; a
    device no one sends to receives zeros."""
    raise _outside("axis_ppermute")


@axis_ppermute.register_fake
def _axis_ppermute_fake(x, axes, pairs):
    return torch.empty_like(x)


@register(torch.ops.shardtensor.axis_ppermute.default)
def _axis_ppermute_lowering(x, axes, pairs):
    return lax.ppermute(x, _names(axes), list(zip(pairs[::2], pairs[1::2])))


@torch.library.custom_op("shardtensor::axis_index", mutates_args=())
def axis_index(like: torch.Tensor, axes: str) -> torch.Tensor:
    """This device's index along ``axes`` (an int64 scalar); ``like`` only places the result."""
    raise _outside("axis_index")


@axis_index.register_fake
def _axis_index_fake(like, axes):
    return like.new_empty((), dtype=torch.int64)


@register(torch.ops.shardtensor.axis_index.default)
def _axis_index_lowering(like, axes):
    return lax.axis_index(_names(axes)).astype(jnp.int64)
