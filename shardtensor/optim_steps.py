"""Optimizer step counters on the devices, so that ``st.compile`` freezes torch's default optimizers.

torch's default (non-capturable, non-fused) Adam, AdamW, NAdam, RAdam, Adamax, RMSprop, Adadelta,
ASGD and Rprop keep ``state['step']`` (NAdam's ``mu_product`` too) as a CPU tensor and compute their
bias corrections from it on the host with ``.item()``: a traced call that does this reads host state,
so it never freezes. torch's own ``capturable=True`` path computes the same math from a counter on
the parameters' device, inside the program.

So, inside an ``st.compile`` trace, an optimizer stepping parameters that all live on shardtensor's
device runs torch's capturable path: just before its ``step()`` the group's 0-d CPU state
(``step``, ``mu_product``) moves to the device and ``group['capturable']`` is set; just after,
``capturable`` goes back to the user's ``False``. What the user sees between steps is unchanged:
``param_groups`` say ``capturable=False``, and ``state_dict()`` gives the counters as CPU tensors, as
torch's default optimizer does (it loads into a plain CPU optimizer and back). Once a group's counters
are on the device, every later step of it (lazy mode too) takes the capturable path, so that no step
reads a counter back from the devices.

The capturable path's bias corrections are computed in float32 on the devices instead of float64 on
the host: the results agree with eager torch's default optimizer to float32 rounding.

Example::

    opt = torch.optim.AdamW(model.parameters())   # torch's default: capturable=False

    @st.compile
    def train_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward(); opt.step(); opt.zero_grad()
        return loss

    train_step(x, y)   # steps 3 on: a frozen replay; opt.param_groups[0]['capturable'] is still False
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from shardtensor.graph.state import STATE
from shardtensor.tensor import ShardedTensor

_INSTALLED: list = []  # the global step pre- and post-hook, once installed
_LOCAL = threading.local()  # .switched: [(group, ...)] set to capturable by this thread's step()
_HOOKED: weakref.WeakSet = weakref.WeakSet()  # optimizers given the state_dict hook


def install() -> None:
    """Install the global optimizer step hooks (once; ``st.compile``'s first trace calls it)."""
    if _INSTALLED:
        return
    pre = torch_optimizer.register_optimizer_step_pre_hook(_before_step)
    post = torch_optimizer.register_optimizer_step_post_hook(_after_step)
    _INSTALLED.extend((pre, post))


def restore_groups(optimizer: torch.optim.Optimizer | None = None) -> None:
    """Give back ``capturable=False`` to the groups this thread switched for ``optimizer`` (None: for
    every optimizer; a ``step()`` that raised skips the post-hook, and a compiled call's end calls this)."""
    switched = getattr(_LOCAL, "switched", [])
    for owner, group in switched:
        if optimizer is None or owner is optimizer:
            group["capturable"] = False
    _LOCAL.switched = [(o, g) for o, g in switched if not (optimizer is None or o is optimizer)]


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    restore_groups(optimizer)  # (left switched by a step of it that raised)
    switched = []
    for group in optimizer.param_groups:
        if not _eligible(group):
            continue
        states = [optimizer.state[p] for p in group["params"] if p in optimizer.state]
        on_device = any(isinstance(v, ShardedTensor) and v.dim() == 0 for s in states for v in s.values())
        if not (STATE.tracing or on_device):
            continue  # lazy mode, counters on the host: torch's default path (no device reads)
        for p in group["params"]:
            entries: dict = optimizer.state.get(p, {})
            for key, value in list(entries.items()):
                if type(value) is torch.Tensor and value.dim() == 0 and value.is_floating_point():
                    entries[key] = value.to(p.device)  # (torch's capturable path keeps these beside the parameter)
        group["capturable"] = True
        switched.append((optimizer, group))
    if switched and optimizer not in _HOOKED:
        optimizer.register_state_dict_post_hook(_counters_on_host)
        _HOOKED.add(optimizer)
    _LOCAL.switched = getattr(_LOCAL, "switched", []) + switched


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    restore_groups(optimizer)
    if STATE.tracing and any(_counts_on_host(optimizer, group) for group in optimizer.param_groups):
        STATE.trace_broken = STATE.trace_broken or (
            f"torch's {type(optimizer).__name__} counts its steps on the host and reads the count there (it "
            "has no capturable path): its step runs as Python each call"
        )


def _eligible(group: dict) -> bool:
    """A group torch would step on the host, whose parameters all live on shardtensor's device."""
    return (
        group.get("capturable") is False
        and not group.get("fused")
        and not group.get("differentiable")
        and bool(group["params"])
        and all(isinstance(p, ShardedTensor) for p in group["params"])
    )


def _counts_on_host(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """A group whose parameters are on the devices but whose step counters are CPU tensors that
    torch reads with .item() (an optimizer without a capturable option: Adagrad, Adafactor)."""
    if "capturable" in group or group.get("fused") or not group["params"]:
        return False
    if not all(isinstance(p, ShardedTensor) for p in group["params"]):
        return False
    states = [optimizer.state.get(p, {}) for p in group["params"]]
    return any(type(v) is torch.Tensor and v.dim() == 0 for s in states for v in s.values())


def _counters_on_host(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``state_dict()`` of a group that says ``capturable=False``: its 0-d counters as CPU tensors, as
    torch's default optimizer holds them (a plain CPU optimizer loads it)."""
    groups = state_dict["param_groups"]
    host_groups = {i for group in groups if group.get("capturable") is False for i in group["params"]}
    for index, entries in list(state_dict["state"].items()):
        if index not in host_groups:
            continue
        moved = {k: v.cpu() if isinstance(v, ShardedTensor) and v.dim() == 0 else v for k, v in entries.items()}
        state_dict["state"][index] = moved  # (a new dict: the optimizer's own state keeps its device counters)
    return state_dict
