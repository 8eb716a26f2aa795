"""``optimization_barrier``: values XLA may not look through, move across, or merge (CSE) with others.

An aten-level custom op, ``torch.ops.shardtensor.optimization_barrier(Tensor[] tensors, Tensor[]
after) -> Tensor[]``, lowered to ``jax.lax.optimization_barrier``. Its outputs equal ``tensors``; its
gradient is the identity. On CPU tensors it is a copy. ``checkpoint_module`` passes the inputs and
parameters of a recomputation through it, so the recomputed forward is a different computation to
XLA and is not merged back into the original forward.

``after`` orders the outputs after other values (the gradients that start a recomputation): they
go through the barrier too, so its outputs exist only once ``after`` does. XLA:GPU/TPU keep barriers
until the schedule is made, but XLA:CPU removes them before scheduling, and its scheduler then runs
a recomputation as early as its inputs allow — in the forward pass, which keeps every recomputed
activation alive. So on CPU each floating-point output also gets a true data dependency on
``after``: it adds ``-0.0`` computed from them (``-(|s| * 0)`` with ``s`` a finite sum of
``after``; each sum of a sharded value costs a scalar all-reduce). Adding ``-0.0`` leaves every
value (``-0.0``, inf and NaN included) exactly as it was, and XLA cannot fold a float ``* 0`` away.

Example::

    a, b = optimization_barrier([a, b])
    x, w = optimization_barrier([x, w], after=[grad])   # x and w exist only once grad does
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from shardtensor.ops.registry import register


@torch.library.custom_op("shardtensor::optimization_barrier", mutates_args=())
def _barrier(tensors: list[torch.Tensor], after: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]  # eager CPU: the values themselves (custom ops may not alias)


@_barrier.register_fake
def _barrier_fake(tensors, after):
    return [torch.empty_like(t) for t in tensors]


def _barrier_setup_context(ctx, inputs, output):
    ctx.n_after = len(inputs[1])


def _barrier_backward(ctx, grads):
    return list(grads), [None] * ctx.n_after


_barrier.register_autograd(_barrier_backward, setup_context=_barrier_setup_context)


@register(torch.ops.shardtensor.optimization_barrier.default)
def _barrier_lowering(tensors, after):
    # on GPU and TPU the barrier itself orders the schedule
    return tuple(jax.lax.optimization_barrier((tuple(tensors), tuple(after)))[0])


@register(torch.ops.shardtensor.optimization_barrier.default, platform="cpu")
def _barrier_lowering_cpu(tensors, after):
    values = jax.lax.optimization_barrier((tuple(tensors), tuple(after)))[0]
    if not after:
        return tuple(values)
    s = sum(jnp.sum(a, dtype=jnp.float32) for a in after)
    minus_zero = -(jnp.abs(jnp.where(jnp.isfinite(s), s, 0.0)) * 0.0)
    return tuple(v + minus_zero.astype(v.dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v for v in values)


def optimization_barrier(tensors, after=()):
    """The same values as ``tensors`` (a list or tuple), behind an XLA optimization barrier.

    ``after`` (gradients, say) makes the results depend on those values too, so that XLA computes
    with them only once ``after`` exists; their own values are not changed.

    Example::

        x, w = optimization_barrier([x, w])     # XLA cannot merge what follows with earlier copies
        x, = optimization_barrier([x], after=[grad_out])
    """
    tensors = list(tensors)
    if not tensors:
        return []
    return list(torch.ops.shardtensor.optimization_barrier(tensors, [a.detach() for a in after]))
