"""View ops: a view is its base's cell plus a chain of view steps, read and written through."""

from __future__ import annotations

import torch

from shardtensor.dispatch import param_moves
from shardtensor.dispatch.meta import regroup
from shardtensor.dispatch.record import plan_for, record_and_wrap, view_template
from shardtensor.dispatch.table import special
from shardtensor.graph import views
from shardtensor.ops import lookup
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.geometry import contiguous_strides

aten = torch.ops.aten


def view_op(func, args, kwargs):
    """A view op: a new tensor over the same cell, one step longer view chain (no data moves)."""
    base, lowering = args[0], lookup(func)
    if not isinstance(base, ShardedTensor) or lowering is None:
        return record_and_wrap(func, args, kwargs)
    template, refs = view_template(func, args, kwargs, lowering.static_scalars)
    if refs:  # a view with other dynamic inputs: compute it as a copy
        return record_and_wrap(func, args, kwargs)
    plan = plan_for(func, template, args, kwargs, lowering)
    made = plan.view_steps
    if made is None:
        # the plan's template holds everything a view step depends on (the base's geometry, the
        # static arguments): one step per plan, whose scatter (its inverse) is then made only once
        made = plan.view_steps = tuple(
            (
                views.ViewStep(func, tuple(args[1:]), kwargs, plan.caller, i, (plan.key, i), base.shape, meta[0]),
                ("T", tuple(meta[0]), meta[1], tuple(meta[2]), meta[3]),
                tuple(meta[2]) == contiguous_strides(meta[0]) and not meta[3],
            )
            for i, meta in enumerate(plan.outs)
        )
    cell, chain = base._cell, base._chain
    if len(made) == 1 and plan.structure == "one":
        step, sig, contiguous = made[0]
        return ShardedTensor._view(cell, chain + (step,), sig, contiguous)
    outs = [ShardedTensor._view(cell, chain + (step,), sig, contiguous) for step, sig, contiguous in made]
    return regroup(outs, plan.structure)


@special(aten.detach.default, aten.alias.default)
def alias(func, args, kwargs):
    """A new tensor over the same storage and view chain as ``args[0]`` (``detach``, ``alias``)."""
    t = args[0]
    moved = func is aten.detach.default and "_moved_parameter" in t.__dict__  # nn.Parameter(moved) in a move
    if moved:
        earlier = param_moves.parameter_for(t)
        if earlier is not None:  # a parameter two modules hold: both get the one it became
            return earlier
    sig = t._sig  # ("T", shape, dtype, strides, storage offset), when known
    contiguous = sig is not None and not sig[4] and sig[3] == contiguous_strides(sig[1])
    if sig is not None and (contiguous or t._chain):  # (else __new__ notes the cell's storage layout)
        out = ShardedTensor._view(t._cell, t._chain, sig, contiguous)
    elif sig is not None:
        out = ShardedTensor(t._cell, sig[1], sig[2], chain=t._chain, strides=sig[3], storage_offset=sig[4])
    else:
        out = ShardedTensor(
            t._cell, t.shape, t.dtype, chain=t._chain, strides=t.stride(), storage_offset=t.storage_offset()
        )
    if moved:
        param_moves.remember(t, out)
    return out
