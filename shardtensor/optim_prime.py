"""``prime_optimizer``: create an optimizer's state before the first step, exactly as that step would,
so that step 1 and step 2 are the same program (one compile at start-up instead of two).

torch optimizers create their state (``step``, ``exp_avg``, ``exp_avg_sq`` ...) inside the first
``step()``: on shardtensor that first step records a program that makes the zeros itself, and the
second step, which reads them, is another program. PyTorch/XLA's ``prime_optimizer`` runs a step with
zero gradients for this, which is not exact: the step count becomes 1 (bias corrections shift) and
decoupled weight decay shrinks the parameters. Here the step runs on stand-ins (zeros shaped like
the parameters, outside the model), each state entry is copied at the moment the optimizer creates
it, before any update, and the parameters get those fresh copies, laid out like themselves on the
devices; the stand-ins' update is never computed.

Exact for the optimizers whose first step creates state from shapes alone (``SUPPORTED``): the
following steps equal eager torch's. A first ``step()`` without it does the same for the parameters
that have a gradient (``prime_for_step``, from the step pre-hook of ``optim_steps``): their state is
computed in a small program before the step records, so step 1 runs step 2's program. ``SGD``
with momentum copies its first gradient into its buffer and is refused, as is any optimizer not
listed.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import _disable_current_modes

from shardtensor.annotate import shard
from shardtensor.graph import sync
from shardtensor.tensor import ShardedTensor

# torch optimizers whose first step creates state that depends on shapes only, never on gradients
SUPPORTED: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.Adagrad,
    torch.optim.ASGD,
    torch.optim.Rprop,
)

_Optimizer = TypeVar("_Optimizer")


class _FreshState(dict):
    """One parameter's state dict that keeps a copy of every entry as the optimizer first stores it."""

    def __init__(self):
        super().__init__()
        self.fresh: dict[Any, Any] = {}

    def __setitem__(self, key, value):
        if key not in self.fresh:
            with torch.no_grad():
                self.fresh[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        super().__setitem__(key, value)


def prime_optimizer(optimizer: _Optimizer) -> _Optimizer:
    """Create ``optimizer``'s state now, exactly as its first ``step()`` would, and compute it on the
    devices; returns ``optimizer``.

    Call it after building the optimizer and before the first training step: step 1 then runs the
    same program as every later step (one compile at start-up, not two), and its results equal
    eager torch's. Every parameter that requires grad gets its state (torch would skip one that never
    gets a gradient); parameters that already have state (a loaded checkpoint) keep it; the parameters'
    values and gradients are not changed. State tensors shaped like their parameter are laid out like
    it. The optimizer's step hooks run once, on stand-ins. Pending work runs first, as with
    ``st.sync()``.

    Supported: ``torch.optim`` Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adadelta, Adagrad, ASGD,
    Rprop and their subclasses, and SGD without momentum (no state); a wrapper holding the optimizer
    as ``.optimizer`` is unwrapped. Other optimizers raise ``TypeError`` (SGD's momentum buffer is its
    first gradient: no state created in advance equals it).

    Example::

        opt = st.prime_optimizer(torch.optim.AdamW(model.parameters(), capturable=True))
        step = st.compile(train_step)   # step 1 compiles the program step 2 replays
    """
    target: Any = optimizer
    while isinstance(getattr(target, "optimizer", None), torch.optim.Optimizer):
        target = target.optimizer
    if not isinstance(target, torch.optim.Optimizer):
        raise TypeError(
            "prime_optimizer expects a torch.optim.Optimizer (or a wrapper holding one as .optimizer), "
            f"got {type(optimizer).__name__}."
        )
    if isinstance(target, torch.optim.SGD) and not any(g.get("momentum", 0) for g in target.param_groups):
        return optimizer  # plain SGD keeps no state
    if not isinstance(target, SUPPORTED):
        names = ", ".join(c.__name__ for c in SUPPORTED)
        raise TypeError(
            f"prime_optimizer cannot create {type(target).__name__}'s state exactly in advance (supported: "
            f"{names}; SGD without momentum). Run its first step as usual: it compiles one more program."
        )
    pending = [
        (g, i, p)
        for g in target.param_groups
        for i, p in enumerate(g["params"])
        if p.requires_grad and not target.state.get(p)  # (a frozen parameter never gets a gradient)
    ]
    sync()  # the parameters' values are read below (their layouts)
    if pending:
        _create_state(target, pending, target.step)
        sync()
    return optimizer


def prime_for_step(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Before ``optimizer.step()`` (its pre-hook): create the state torch's step would create for the
    parameters that have a gradient and no state yet, as ``prime_optimizer`` does, without running
    the step's hooks; returns the new state tensors (those on the devices pending: the caller
    computes them in a program of their own, so that the step reads them as it reads them on every
    later step). Nothing for an optimizer not listed in ``SUPPORTED`` (by exact type: a subclass may step
    otherwise), nor for parameters off shardtensor's device.

    Example: ``fresh = prime_for_step(opt)`` (then ``run_cells([t._cell for t in fresh])``).
    """
    if type(optimizer) not in SUPPORTED or getattr(_LOCAL, "priming", False):
        return []
    pending = [
        (g, i, p)
        for g in optimizer.param_groups
        for i, p in enumerate(g["params"])
        if p.grad is not None and not optimizer.state.get(p)
    ]
    on_devices = all(isinstance(p, ShardedTensor) and isinstance(p.grad, ShardedTensor) for _, _, p in pending)
    if not pending or not on_devices:
        return []
    unhooked = getattr(type(optimizer).step, "__wrapped__", None)  # (torch's hooks: they run for the real step)
    step = functools.partial(unhooked, optimizer) if unhooked is not None else optimizer.step
    _create_state(optimizer, pending, step, read_layouts=False)
    return [v for _, _, p in pending for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]


_LOCAL = threading.local()  # .priming: a stand-in step runs (the step pre-hook must not prime again)


def _create_state(
    target: torch.optim.Optimizer, pending: list, step: Callable[[], Any], read_layouts: bool = True
) -> None:
    """Run ``step`` with stand-ins for the ``pending`` (group, index, parameter) and give each parameter
    the state entries the optimizer created for its stand-in, as first stored (laid out like their
    parameter; one whose layout XLA chooses is read back when ``read_layouts``, else left free)."""
    stand_ins = {id(p): _stand_in(p) for _, _, p in pending}
    saved_state, saved_groups = target.state, [list(g["params"]) for g in target.param_groups]
    recording: collections.defaultdict = collections.defaultdict(_FreshState)
    _LOCAL.priming = True
    try:
        target.state = recording
        for g in target.param_groups:  # (only the stand-ins step: the other parameters keep their values)
            g["params"] = [stand_ins[id(p)] for g_, _, p in pending if g_ is g]
        # (without the dispatch modes: its host work on its own fresh counters is not the call's)
        with _disable_current_modes():
            step()
    finally:
        _LOCAL.priming = False
        target.state = saved_state
        for g, params in zip(target.param_groups, saved_groups):
            g["params"] = params
    for _, _, p in pending:
        created = recording.get(stand_ins[id(p)])
        if created is not None and created.fresh:
            target.state[p] = {k: _laid_out_like(p, v, read_layouts) for k, v in created.fresh.items()}


def _stand_in(param: torch.Tensor) -> torch.Tensor:
    """Zeros shaped, typed and placed like ``param``, with a zero gradient: what the step updates."""
    with torch.no_grad():
        s = torch.zeros_like(param)
    s.grad = torch.zeros_like(param)
    return s


def _laid_out_like(param: torch.Tensor, value: Any, read_layout: bool = True) -> Any:
    """A fresh state entry: on the devices with ``param``'s layout when it has ``param``'s shape (a
    layout XLA chose is read back with ``read_layout``; without, the entry is left free, as the
    parameter: inside a step the gradient may live on another mesh than the parameter's value)."""
    if not (isinstance(param, ShardedTensor) and isinstance(value, ShardedTensor)) or value.shape != param.shape:
        return value
    mesh, spec = param.mesh, param.partition_spec
    if mesh is None or spec is None:  # XLA chose the parameter's layout: read it back
        if not read_layout:
            return value
        mesh, spec = param._layout()
    return shard(value, mesh, tuple(spec))
