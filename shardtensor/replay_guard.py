"""What a frozen ``st.compile`` replay takes for granted about the Python world, and a cheap check
that it still holds.

A frozen replay runs the captured program instead of the function's Python. That is exact only
while everything the Python would look at is as it was when the trace was captured: the gradients
present on entry (absent, or the same tensors), ``requires_grad``, hooks (module forward / pre /
backward hooks, tensor hooks, the global ones), which parameters, buffers and submodules a module
holds and whether it is training, each optimizer's parameter groups and hyperparameters, grad mode.

``watch()`` is active while a trace runs and notes the objects that matter: the modules called (a
global forward pre-hook, registered only for the trace, counting the tracing thread's calls), the
optimizers stepped (a global optimizer pre-hook, likewise), the parameters an op read.
``snapshot(objects)`` reduces their state to a tuple of plain values; a replay compares
the tuple taken now with the one taken at capture (``==`` on ints, bools, floats: a few µs for a
small model). Plain Python attributes a function reads besides these (a global ``scale = 0.5``) are
not seen: they stay captured as they were.

Example::

    with watch() as seen:
        train_step(x)
    keep = []
    state = snapshot(seen.objects(), (x,), keep)
    ...
    snapshot(seen.objects(), (x,)) == state      # False after p.grad was set, a hook added, ...
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.modules.module as torch_module
import torch.optim.optimizer as torch_optimizer

from shardtensor.tensor import ShardedTensor

_OURS: set = set()  # ids of the global hooks watch() registered (left out of snapshots)
_GLOBAL_HOOKS = (
    lambda: torch_module._global_forward_pre_hooks,
    lambda: torch_module._global_forward_hooks,
    lambda: torch_module._global_backward_pre_hooks,
    lambda: torch_module._global_backward_hooks,
    lambda: torch_optimizer._global_optimizer_pre_hooks,
    lambda: torch_optimizer._global_optimizer_post_hooks,
)
_PLAIN = (int, float, bool, str, type(None))


class Watched:
    """The objects a trace touched: modules called, optimizers stepped, leaf tensors needing grad."""

    def __init__(self):
        self.modules: dict = {}  # id -> module, in call order
        self.optimizers: dict = {}
        self.tensors: dict = {}

    def note_tensor(self, t) -> None:
        """An op read ``t``: remember it if it is a parameter (an ``nn.Parameter``, used by a module
        or not; other tensors made inside the call are new objects each time)."""
        if id(t) not in self.tensors and isinstance(t, torch.nn.Parameter):
            self.tensors[id(t)] = t

    def objects(self) -> tuple:
        """The objects whose state a replay depends on (the call's arguments apart: see ``snapshot``)."""
        tensors = dict(self.tensors)
        for m in self.modules.values():
            for p in m._parameters.values():
                if p is not None:
                    tensors.setdefault(id(p), p)
        for opt in self.optimizers.values():
            for group in opt.param_groups:
                for p in group["params"]:
                    tensors.setdefault(id(p), p)
        return tuple(self.modules.values()), tuple(self.optimizers.values()), tuple(tensors.values())


_WATCHING = threading.local()  # .seen: the Watched of the trace running on this thread, or None
_OPTIMIZER_HOOK: list = []  # the global optimizer pre-hook, once installed


def _module_called(module, args):
    seen = getattr(_WATCHING, "seen", None)
    if seen is not None:
        seen.modules.setdefault(id(module), module)


def _optimizer_stepped(optimizer, args, kwargs):
    seen = getattr(_WATCHING, "seen", None)
    if seen is not None:
        seen.optimizers.setdefault(id(optimizer), optimizer)


@contextlib.contextmanager
def watch():
    """Note the modules called and the optimizers stepped by this thread inside the block.

    The module hook is registered for the block only (a global forward hook takes every module
    call off torch's fast path); the optimizer hook stays once installed (``step()`` has no fast
    path, and removing it could change the dict another thread's ``step()`` is iterating).
    """
    seen = Watched()
    if not _OPTIMIZER_HOOK:
        handle = torch_optimizer.register_optimizer_step_pre_hook(_optimizer_stepped)
        _OPTIMIZER_HOOK.append(handle)
        _OURS.add(handle.id)
    handle = torch_module.register_module_forward_pre_hook(_module_called)
    _OURS.add(handle.id)
    outer, _WATCHING.seen = getattr(_WATCHING, "seen", None), seen
    try:
        yield seen
    finally:
        _WATCHING.seen = outer
        handle.remove()
        _OURS.discard(handle.id)


def snapshot(objects, args=(), keep: list | None = None) -> tuple:
    """A tuple of plain values describing what a replay depends on: the state of ``objects`` (from
    ``Watched.objects``) and of the call's tensor arguments ``args`` (a new tensor each call is
    fine: their storage is not part of it). ``keep``, if given, receives the objects behind the ids
    in it: holding them keeps those ids from being reused."""
    modules, optimizers, tensors = objects
    if keep is None:
        keep = []
    state = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    for hooks in _GLOBAL_HOOKS:
        d = hooks()
        state.append(tuple(k for k in d if k not in _OURS) if d else ())
    for m in modules:
        state.append((m.training, tuple(m._forward_pre_hooks), tuple(m._forward_hooks),
                      tuple(m._backward_pre_hooks), tuple(m._backward_hooks),
                      tuple(map(id, m._parameters.values())), tuple(map(id, m._buffers.values())),
                      tuple(map(id, m._modules.values()))))
        keep += m._parameters.values()
        keep += m._buffers.values()
        keep += m._modules.values()
    for opt in optimizers:
        for group in opt.param_groups:
            state.append(tuple(map(id, group["params"])))
            state.append(tuple(_value(v, keep) for k, v in group.items() if k != "params"))
        keep.append(opt.state)
        state.append((id(opt.state), len(opt.state), tuple(opt._optimizer_step_pre_hooks),
                      tuple(opt._optimizer_step_post_hooks)))
    for t in tensors:
        cell = getattr(t, "_cell", None)  # .data = ... gives a tensor another cell
        keep.append(cell)
        state.append((id(cell), _tensor_state(t, keep)))
    for t in args:
        state.append(_tensor_state(t, keep) if t.grad_fn is None else t.requires_grad)
    return tuple(state)


def _tensor_state(t, keep):
    """A leaf tensor's requires_grad, its gradient's storage (or None) and its hooks."""
    grad = t.grad
    if grad is None:
        grad_id = None
    else:
        grad_id = id(grad._cell) if isinstance(grad, ShardedTensor) else id(grad)
        keep.append(grad._cell if isinstance(grad, ShardedTensor) else grad)
    hooks, post = t._backward_hooks, t._post_accumulate_grad_hooks
    return t.requires_grad, grad_id, tuple(hooks) if hooks else (), tuple(post) if post else ()


def _value(v, keep):
    """A hyperparameter as a plain comparable value (a tensor or other object: its identity)."""
    if type(v) in _PLAIN:
        return v
    if type(v) is tuple:
        return tuple(_value(x, keep) for x in v)
    keep.append(v)
    return ("object", id(v), getattr(v, "_version", None))
