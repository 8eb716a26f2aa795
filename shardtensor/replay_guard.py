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
``Guard(objects, args)`` takes their state; a replay asks ``guard.holds(args)`` (C-level passes
over flat lists: about 0.3 µs per parameter or module). Plain Python attributes a function reads besides these (a global ``scale = 0.5``) are
not seen: they stay captured as they were.

Example::

    with watch() as seen:
        train_step(x)
    guard = Guard(seen.objects(), (x,))
    ...
    guard.holds((x,))      # False after p.grad was set, a hook added, ...
"""
from __future__ import annotations

import contextlib
import itertools
import operator
import threading

import torch
import torch.nn.modules.module as torch_module
import torch.optim.optimizer as torch_optimizer

from shardtensor.tensor import ShardedTensor

_OURS: set = set()  # ids of the global hooks watch() registered (left out of guards)
_GLOBAL_HOOK_DICTS = (  # torch's global hook dicts (never rebound, only mutated)
    torch_module._global_forward_pre_hooks,
    torch_module._global_forward_hooks,
    torch_module._global_backward_pre_hooks,
    torch_module._global_backward_hooks,
    torch_optimizer._global_optimizer_pre_hooks,
    torch_optimizer._global_optimizer_post_hooks,
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
        """The objects whose state a replay depends on (the call's arguments apart: see ``Guard``)."""
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


class Guard:
    """The state of ``objects`` (from ``Watched.objects``) and of a call's tensor arguments ``args``,
    taken now; ``holds(args)`` says whether it is still the same.

    The check runs on every frozen call, so it is made of C-level passes over flat lists (``map``
    with attribute getters, list equality, identity tests), with torch-function handling off while
    tensor attributes are read: well under a microsecond per parameter or module. Objects are
    compared by identity (a gradient, a parameter, a storage cell), hook dicts by their contents,
    flags and hyperparameters by value. The guard holds the objects it compares, so their ids
    cannot be reused while it lives.
    """

    def __init__(self, objects, args=()):
        modules, optimizers, tensors = objects
        self.modules, self.optimizers = modules, optimizers
        self.tensors = tensors
        self.sharded = tuple(t for t in tensors if isinstance(t, ShardedTensor))
        self.containers = tuple(c for m in modules for c in (m._parameters, m._buffers, m._modules))
        self.state = self._state(args, copy=True)

    def holds(self, args=()) -> bool:
        """Whether everything is as it was when the guard was taken."""
        plain, identities, hooks = self._state(args, copy=False)
        return plain == self.state[0] and _same(identities, self.state[1]) and hooks == self.state[2]

    def _state(self, args, copy):
        """(plain values, objects compared by identity, hook dicts): copies of the hook dicts when
        taking the guard, the live dicts when checking it."""
        modules, tensors = self.modules, self.tensors
        with torch._C.DisableTorchFunctionSubclass():  # a subclass's attribute getters, at C speed
            requires_grad = list(map(_REQUIRES_GRAD, tensors))
            grads = list(map(_GRAD, tensors))
            tensor_hooks = list(map(_HOOKS, tensors))
            arg_requires_grad = [a.requires_grad for a in args]
            arg_grads = [a.grad if a.grad_fn is None else None for a in args]  # only a leaf's
            arg_hooks = [_HOOKS(a) for a in args]
        identities = grads + arg_grads + list(map(_CELL, self.sharded))
        identities += itertools.chain.from_iterable(map(dict.values, self.containers))
        plain = [torch.is_grad_enabled(), torch.is_inference_mode_enabled(), requires_grad, arg_requires_grad,
                 list(map(_TRAINING, modules)), list(map(len, self.containers))]
        for opt in self.optimizers:
            identities.append(opt.state)
            plain.append(len(opt.state))
            for group in opt.param_groups:
                identities += group["params"]
                plain.append(len(group["params"]))
                for k, v in group.items():  # hyperparameters: values; a tensor (lr=tensor): itself
                    if k != "params":
                        if type(v) in _PLAIN or (type(v) is tuple and all(type(x) in _PLAIN for x in v)):
                            plain.append(v)
                        else:
                            identities.append(v)
        hooks = [_global_hooks(d) for d in _GLOBAL_HOOK_DICTS]
        hooks += itertools.chain.from_iterable(tensor_hooks + arg_hooks)
        hooks += itertools.chain.from_iterable(map(_MODULE_HOOKS, modules))
        for opt in self.optimizers:
            hooks += (opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks)
        if copy:
            hooks = [None if h is None else dict(h) for h in hooks]
        return plain, identities, hooks


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _global_hooks(d):
    return {k: v for k, v in d.items() if k not in _OURS} if d else {}


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_GRAD = operator.attrgetter("grad")
_HOOKS = operator.attrgetter("_backward_hooks", "_post_accumulate_grad_hooks")
_CELL = operator.attrgetter("_cell")  # .data = ... gives a tensor another cell
_TRAINING = operator.attrgetter("training")
_MODULE_HOOKS = operator.attrgetter("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
