"""``optimization_barrier``: values XLA may not look through, move across, or merge (CSE) with others.

An aten-level custom op, ``torch.ops.shardtensor.optimization_barrier(Tensor[]) -> Tensor[]``, lowered
to ``jax.lax.optimization_barrier``. Its outputs equal its inputs; its gradient is the identity. On
CPU tensors it is a copy. ``checkpoint_module`` passes the inputs and parameters of a recomputation
through it, so the recomputed forward is a different computation to XLA and is not merged back into
the original forward.

Example::

    a, b = optimization_barrier([a, b])
"""
from __future__ import annotations

import jax
import torch

from shardtensor.ops.registry import register


@torch.library.custom_op("shardtensor::optimization_barrier", mutates_args=())
def _barrier(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]  # eager CPU: the values themselves (custom ops may not alias)


@_barrier.register_fake
def _barrier_fake(tensors):
    return [torch.empty_like(t) for t in tensors]


def _barrier_backward(ctx, grads):
    return list(grads)


_barrier.register_autograd(_barrier_backward)


@register(torch.ops.shardtensor.optimization_barrier.default)
def _barrier_lowering(tensors):
    return tuple(jax.lax.optimization_barrier(tuple(tensors)))


def optimization_barrier(tensors):
    """The same values as ``tensors`` (a list or tuple), behind an XLA optimization barrier.

    Example::

        x, w = optimization_barrier([x, w])     # XLA cannot merge what follows with earlier copies
    """
    tensors = list(tensors)
    if not tensors:
        return []
    return list(torch.ops.shardtensor.optimization_barrier(tensors))
