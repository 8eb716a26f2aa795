"""The entry point: what ``ShardedTensor.__torch_dispatch__`` does with one aten op.

Special handlers first (the declared table), then view ops, in-place / ``out=`` ops and functional
ops, each recorded as graph nodes (run at once in eager mode).
"""

from __future__ import annotations

import os

import torch

from shardtensor import runtime
from shardtensor.dispatch.meta import meta_outputs, regroup
from shardtensor.dispatch.mutation import mutating_op
from shardtensor.dispatch.record import record_and_wrap, zeros
from shardtensor.dispatch.table import SPECIAL
from shardtensor.dispatch.view_ops import view_op
from shardtensor.graph.state import locked
from shardtensor.ops.schema import facts
from shardtensor.tensor import backward_errors
from shardtensor.tensor import device as torch_device
from shardtensor.tensor.sharded import set_op_handler


@locked
def handle(func, args, kwargs):
    """Run (or record) the aten op ``func`` on arguments that include ShardedTensors.

    Example: ``handle(torch.ops.aten.add.Tensor, (x, y), {})`` is ``x + y``.

    An engine entry (``locked``): one op at a time over all threads, as an op reads cells other
    threads may run, and with JAX's 64-bit types on (also in backward, on autograd's threads).
    """
    try:
        special = SPECIAL.find(func)
        if special is not None:
            return special(func, args, kwargs)
        f = facts(func)
        if f.is_view:
            return view_op(func, args, kwargs)
        if f.mutated:
            return mutating_op(func, f, args, kwargs)
        return record_and_wrap(func, args, kwargs)
    except BaseException as e:
        if torch_device.CPP_GUARD or torch._C._current_autograd_node() is None:
            raise
        # Only without the C++ device guard: an exception leaving __torch_dispatch__ inside
        # backward would abort the process (torch's Python guard runs with the error still set).
        # Keep it, finish backward with zeros, and let the engine wrapper raise it afterwards.
        backward_errors.remember(e)
        return _placeholder(func, args, kwargs)


def _placeholder(func, args, kwargs):
    """Zeros shaped like ``func``'s result: what a failed op returns while backward unwinds."""
    if facts(func).mutated:
        return args[0]
    outs, structure = meta_outputs(func, args, kwargs)
    values = [None if o is None else zeros(o[0], o[1]) for o in outs]
    return regroup(values, structure)


def _refuse_in_forked_child(func, args, kwargs):
    runtime.check_not_forked(f"run {func} on a shardtensor tensor")


def _after_fork_in_child() -> None:
    # A child forked after JAX started cannot run it: every op on a ShardedTensor raises at once, before
    # taking ENGINE_LOCK (which a thread of the parent may have held at the fork) or waiting on JAX.
    if runtime.forked_after_start():
        set_op_handler(_refuse_in_forked_child)


set_op_handler(handle)
if hasattr(os, "register_at_fork"):  # after runtime's own hook, which notes whether JAX was running
    os.register_at_fork(after_in_child=_after_fork_in_child)
