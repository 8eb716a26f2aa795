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

Adagrad, which has no capturable path, takes its fused one the same way (``group['fused']`` set for
the step: its fused kernel reads the step count on the device). Adafactor has neither: its step
runs as Python on each call.

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

from shardtensor import optim_prime
from shardtensor.graph.execute import run_cells
from shardtensor.graph.state import STATE
from shardtensor.mesh import default_mesh
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.sharded import FIRST_TENSOR_CALLBACKS
from shardtensor.tensor.upload import Upload

_INSTALLED: list = []  # the global step pre- and post-hook, once installed
_LOCAL = threading.local()  # .switched: [(optimizer, group, flag, its value before)] this thread's step() set
_HOOKED: weakref.WeakSet = weakref.WeakSet()  # optimizers given the state_dict hook
_NO_TENSOR_LR: weakref.WeakSet = weakref.WeakSet()  # optimizers whose step read a tensor learning rate on the host


def install() -> None:
    """Install the global optimizer step hooks (once: when the process makes its first ShardedTensor)."""
    if _INSTALLED:
        return
    pre = torch_optimizer.register_optimizer_step_pre_hook(_before_step)
    post = torch_optimizer.register_optimizer_step_post_hook(_after_step)
    _INSTALLED.extend((pre, post))


FIRST_TENSOR_CALLBACKS.append(install)


def restore_groups(optimizer: torch.optim.Optimizer | None = None) -> None:
    """Give back the flags (``capturable``, ``fused``) this thread switched for ``optimizer``'s
    groups (None: for every optimizer; a ``step()`` that raised skips the post-hook, and a compiled
    call's end calls this)."""
    switched = getattr(_LOCAL, "switched", [])
    for owner, group, key, old in switched:
        if optimizer is None or owner is optimizer:
            group[key] = old
    _LOCAL.switched = [s for s in switched if not (optimizer is None or s[0] is optimizer)]


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    restore_groups(optimizer)  # (left switched by a step of it that raised)
    # (inside an st.compile trace: lazy and eager steps record as they did, Dynamo inlines the step)
    fresh = optim_prime.prime_for_step(optimizer) if STATE.tracing and not torch.compiler.is_compiling() else []
    switched = []
    for index, group in enumerate(optimizer.param_groups):
        key = _device_path(optimizer, group)
        if key is None:
            continue
        states = [optimizer.state[p] for p in group["params"] if p in optimizer.state]
        on_device = any(isinstance(v, ShardedTensor) and v.dim() == 0 for s in states for v in s.values())
        if not (STATE.tracing or on_device):
            continue  # lazy mode, counters on the host: torch's default path (no device reads)
        for p in group["params"]:
            entries: dict = optimizer.state.get(p, {})
            for name, value in list(entries.items()):
                if type(value) is torch.Tensor and value.dim() == 0 and value.is_floating_point():
                    entries[name] = value.to(p.device)  # (torch's device paths keep these beside the parameter)
                    fresh.append(entries[name])  # (moved once: before the call, as the next calls find it)
        switched.append((optimizer, group, key, group.get(key)))
        group[key] = True
        live = STATE.trace_uploads is not None and type(group.get("lr")) is float
        if live and optimizer not in _NO_TENSOR_LR:
            switched.append((optimizer, group, "lr", group["lr"]))
            group["lr"] = LiveValue(optimizer, index, "lr").tensor(group["params"])
    if fresh:  # made in a small program of its own, as if before the call: read as every later step reads it
        cells = [t._cell for t in fresh if isinstance(t, ShardedTensor)]
        run_cells(cells, note_read=False)
        for cell in cells:
            cell.mark_earlier()
    if switched and optimizer not in _HOOKED:
        optimizer.register_state_dict_post_hook(_counters_on_host)
        _HOOKED.add(optimizer)
    _LOCAL.switched = getattr(_LOCAL, "switched", []) + switched
    _LOCAL.reads_before = STATE.host_reads


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    live = any(s[0] is optimizer and s[2] == "lr" for s in getattr(_LOCAL, "switched", ()))
    if live and STATE.tracing and STATE.host_reads != getattr(_LOCAL, "reads_before", STATE.host_reads):
        # its step read the learning rate on the host (torch's single-tensor RMSprop and Adadelta,
        # Rprop's first step): later traces give it the float, as the user set it
        _NO_TENSOR_LR.add(optimizer)
    restore_groups(optimizer)
    if STATE.tracing and any(_counts_on_host(optimizer, group) for group in optimizer.param_groups):
        STATE.trace_broken = STATE.trace_broken or (
            f"torch's {type(optimizer).__name__} counts its steps on the host and reads the count there (it "
            "has no capturable path): its step runs as Python each call"
        )


def _device_path(optimizer: torch.optim.Optimizer, group: dict) -> str | None:
    """The flag that moves a group torch would step on the host onto the devices, whose parameters
    all live on shardtensor's device: ``capturable`` (Adam and the others that have it), ``fused``
    (Adagrad, whose fused kernel reads its step count on the device); None: none."""
    if group.get("differentiable") or group.get("fused") or not group["params"]:
        return None
    if not all(isinstance(p, ShardedTensor) for p in group["params"]):
        return None
    if group.get("capturable") is False:
        return "capturable"
    if type(optimizer) in _FUSED_ON_DEVICE and all(p.is_floating_point() for p in group["params"]):
        return "fused"
    return None


# optimizers without a capturable path whose fused one runs on the devices: Adagrad's kernel reads its
# step count there; SGD's takes a learning rate held in a tensor (``LiveValue``) without reading it
_FUSED_ON_DEVICE = (torch.optim.Adagrad, torch.optim.SGD)


class LiveValue:
    """A hyperparameter of an optimizer's group (its learning rate) that a frozen ``st.compile``
    replay reads anew on each call: a schedule stepped between calls changes it without running the
    step's Python. Inside a trace the group's step takes it as a 0-d tensor on the devices made from
    the float (torch's optimizers accept a tensor learning rate on their device paths); the trace
    notes that tensor as an upload of this value (``STATE.trace_uploads``), and the replay uploads
    the value it finds then (the same array while it is the same number).

    Example: ``group["lr"] = LiveValue(opt, 0, "lr").tensor(group["params"])`` (for the step only).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, index: int, key: str):
        self._optimizer = weakref.ref(optimizer)
        self.index, self.key = index, key
        self._last: tuple = (None, None, None)  # (the number, the sharding, its array)

    def group(self) -> dict | None:
        opt = self._optimizer()
        return None if opt is None or self.index >= len(opt.param_groups) else opt.param_groups[self.index]

    def tensor(self, params) -> ShardedTensor:
        """The value as a 0-d tensor on the devices (float64 for float64 parameters, else float32),
        noted as an upload of it."""
        group = self.group()
        assert group is not None and STATE.trace_uploads is not None
        dtype = torch.float64 if all(p.dtype == torch.float64 for p in params) else torch.float32
        how = Upload(dtype, (), default_mesh(), None)
        uploaded = how.tensor(torch.tensor(group[self.key], dtype=dtype))
        STATE.trace_uploads.append((self, how, uploaded._cell))
        return uploaded

    def array(self, how: Upload, sharding=None):
        """The value now, uploaded (the last array again while the number is the same), placed with
        ``sharding`` (the traced call's)."""
        group = self.group()
        value = group.get(self.key) if group is not None else None
        if type(value) is not float:
            raise RuntimeError(f"the optimizer {self.key} a compiled step reads is gone or no longer a float")
        last, placed, array = self._last
        if last is None or last.hex() != value.hex() or placed is not sharding:
            array = how.array(torch.tensor(value, dtype=how.dtype), sharding)
            self._last = (value, sharding, array)
        return array


def _counts_on_host(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """A group whose parameters are on the devices but whose step counters are CPU tensors that
    torch reads with .item() (an optimizer without a capturable option: Adagrad, Adafactor)."""
    if "capturable" in group or group.get("fused") or not group["params"]:
        return False
    if not all(isinstance(p, ShardedTensor) for p in group["params"]):
        return False
    states = [optimizer.state.get(p, {}) for p in group["params"]]
    return any(type(v) is torch.Tensor and v.dim() == 0 for s in states for v in s.values())


def _on_host(group: dict) -> bool:
    """Whether torch keeps this group's counters on the host (as its flags say: not capturable, not
    fused)."""
    return group.get("capturable") is False or ("capturable" not in group and not group.get("fused"))


def _counters_on_host(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``state_dict()`` of a group torch steps on the host: its 0-d counters as CPU tensors, as
    torch's default optimizer holds them (a plain CPU optimizer loads it)."""
    groups = state_dict["param_groups"]
    host_groups = {i for group in groups if _on_host(group) for i in group["params"]}
    for index, entries in list(state_dict["state"].items()):
        if index not in host_groups:
            continue
        moved = {k: v.cpu() if isinstance(v, ShardedTensor) and v.dim() == 0 else v for k, v in entries.items()}
        state_dict["state"][index] = moved  # (a new dict: the optimizer's own state keeps its device counters)
    return state_dict
