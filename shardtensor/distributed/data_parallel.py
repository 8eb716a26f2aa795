"""Data parallelism across processes, PyTorch/XLA's way: ``optimizer_step`` averages the gradients
over the processes (``reduce_gradients``), then steps the optimizer (``xm.optimizer_step``).

Each process holds a replicated copy of the model and computes the gradients of its own part of the
batch; the average is recorded into the step's lazy program (one all-reduce for the small gradients
of a dtype, one for each large one; no execution in between), so the step still runs as one program.

Example::

    model = Model().to(st.device())                       # the same seed in every process
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn(model(x_of_this_process), y_of_this_process).backward()
    st.optimizer_step(opt)                               # the mean gradient over every process, then step
    st.sync()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardtensor import runtime as rt
from shardtensor.distributed.collectives import REDUCE_SUM, all_reduce, process_groups
from shardtensor.distributed.host_collectives import rendezvous
from shardtensor.graph import sync


def _gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients of the optimizer's parameters, each once, in parameter order."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    seen: set[int] = set()
    grads = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and id(p.grad) not in seen:
                seen.add(id(p.grad))
                grads.append(p.grad)
    return grads


def reduce_gradients(
    optimizer: torch.optim.Optimizer, groups: Sequence[Sequence[int]] | None = None, pin_layout: bool = True
) -> None:
    """Replace each gradient of the optimizer's parameters by its mean over the processes of its group
    (all of them by default), in place and lazily (torch_xla's ``xm.reduce_gradients``). With one
    process it does nothing.

    torch_xla divides by the number of all processes even when ``groups`` is given; here the mean
    is over the group, which is what a group of data-parallel replicas needs.

    Example::

        loss.backward(); st.reduce_gradients(opt); st.clip_grad_norm_(model.parameters(), 1.0); opt.step()
    """
    _average_gradients(optimizer, groups, pin_layout)


def _average_gradients(optimizer, groups, pin_layout) -> bool:
    """`reduce_gradients`; True when it recorded an all-reduce over every process."""
    grads = _gradients(optimizer)
    flat, size = process_groups(groups, "reduce_gradients")
    count = size if flat else rt.process_count()
    if count == 1 or not grads:
        return False
    all_reduce(REDUCE_SUM, grads, scale=1.0 / count, groups=groups, pin_layout=pin_layout)
    return count == rt.process_count()


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    barrier: bool = False,
    optimizer_args: Mapping[str, Any] | None = None,
    groups: Sequence[Sequence[int]] | None = None,
    pin_layout: bool = True,
    gradients_reduce: bool = True,
) -> Any:
    """Average the gradients over the processes (`reduce_gradients`, unless ``gradients_reduce`` is
    False), then ``optimizer.step(**optimizer_args)``; returns what ``step`` returns (torch_xla's
    ``xm.optimizer_step``). Everything is recorded into the lazy program of the step.

    ``barrier=True`` then runs the step (``st.sync``, which is what torch_xla's ``mark_step`` does
    here) and, unlike torch_xla, waits until every process has done it: the program ends with the
    all-reduce of every process, so waiting for it waits for all of them; when the step had no such
    collective (groups of processes, no gradients, or ``gradients_reduce=False``) a host
    `rendezvous` completes the wait.

    Example::

        loss.backward()
        st.optimizer_step(opt)          # then st.sync(), or let MpDeviceLoader / st.step() do it
        opt.zero_grad()
    """
    met = gradients_reduce and _average_gradients(optimizer, groups, pin_layout)
    loss = optimizer.step(**(optimizer_args or {}))
    if barrier:
        sync(wait=True)
        if rt.process_count() > 1 and not met:  # else the all-reduce over every process made each wait for all
            rendezvous("shardtensor.optimizer_step")
    return loss
