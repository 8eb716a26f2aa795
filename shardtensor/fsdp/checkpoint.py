"""``checkpoint_module``: gradient checkpointing that really recomputes inside one XLA program.

Built on ``torch.utils.checkpoint`` (``use_reentrant=False``): the forward keeps no activations of the
module, and backward runs the module's forward again to get them back. Two things make that work on
``st.device()``, where a whole training step is one lazy graph compiled by XLA:

* In the recomputation, the module's inputs and parameters first pass through an
  ``optimization_barrier``. Without it the recomputed ops are the very same ops on the very same
  values as the original forward: XLA's common-subexpression elimination merges them, and the
  activations (and the all-gathered weights) stay alive from forward to backward after all.
* The recomputation must also wait: the barrier's outputs depend on the gradients of the module's
  outputs and on the parameter gradients that backward produced since the previous recomputation
  (``optimization_barrier(..., after=...)``). So XLA recomputes a module only once backward reaches
  it, and computes the weight gradients of the module above first, instead of keeping every
  recomputed activation alive until all weight gradients are computed at the end. XLA:CPU removes
  barriers before it schedules, so on CPU these data dependencies are what order the schedule; with
  them the peak memory of an 8-block FSDPv2 step falls by 78% (``bench/fsdp_memory.py``).
* Random numbers: the recomputation must draw the same dropout masks as the forward. torch restores
  the device RNG state only for device modules that say they are ``_initialized``; shardtensor's does
  not, so the device state is saved and restored here (``torch.get_device_module(...).get_rng_state``
  / ``set_rng_state``). Reading the state computes the RNG key when random ops are pending, which
  runs that small part of the lazy graph early.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref

import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint
from torch.utils import _pytree as pytree

import shardtensor as st
from shardtensor.ops.barrier import optimization_barrier


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Make ``module`` recompute its activations in backward instead of keeping them; returns it.

    The module stays the same object (so ``isinstance`` checks and wrap policies still see it); its
    forward is replaced. Checkpointing is skipped when grad mode is off or no tensor input requires
    grad (as PyTorch/XLA's ``checkpoint_module``). Apply it to the module FSDPv2 wraps, e.g. from an
    ``auto_wrapper_callable``. Calling it again on the same module does nothing.

    Example::

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        model = FSDPv2(model, auto_wrap_policy=policy,
                       auto_wrapper_callable=lambda m, *a, **kw: FSDPv2(checkpoint_module(m), *a, **kw))
    """
    if not isinstance(module.__dict__.get("forward"), _CheckpointedForward):
        module.forward = _CheckpointedForward(module, module.__dict__.get("forward"))
    return module


class _CheckpointedForward:
    """A checkpointed module's forward. An object holding the module rather than a closure, so that
    ``copy.deepcopy`` of the module gives a copy whose forward runs the copy."""

    def __init__(self, module: nn.Module, patched=None):
        self.module = module
        self.patched = patched  # a forward set on the instance before, if any

    def original(self, *args, **kwargs):
        if self.patched is not None:
            return self.patched(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        """The module's own forward signature (tools such as Hugging Face ``Trainer`` read it)."""
        if self.patched is not None:
            return inspect.signature(self.patched)
        return inspect.signature(types.MethodType(type(self.module).forward, self.module))

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled() or not _any_requires_grad((args, kwargs)):
            return self.original(*args, **kwargs)
        _RECENT.watch_parameters(self.module)
        frame = _Recomputation(self.module)

        def run(*inputs, **kw):
            if not frame.active:
                return self.original(*inputs, **kw)
            return frame.recompute(self.original, inputs, kw)

        out = torch_checkpoint.checkpoint(
            run, *args, use_reentrant=False, preserve_rng_state=True, context_fn=frame.contexts, **kwargs
        )
        frame.watch_gradients(out)
        return out


def _any_requires_grad(tree) -> bool:
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in pytree.tree_leaves(tree))


class _Recomputation:
    """One checkpointed call: the device RNG state at its start, and whether backward is recomputing."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.active = False
        self.rng_state = None
        self.grads: list[torch.Tensor] = []  # gradients of the outputs that reached backward before the recomputation

    def contexts(self):
        """torch's ``context_fn``: called at the start of the forward; (forward ctx, recompute ctx)."""
        device_module = _device_module()
        if not getattr(device_module, "_initialized", False):  # else torch saves the state itself
            self.rng_state = device_module.get_rng_state()
        return contextlib.nullcontext(), self._recomputing()

    @contextlib.contextmanager
    def _recomputing(self):
        device_module = _device_module()
        current = None
        if self.rng_state is not None:
            current = device_module.get_rng_state()
            device_module.set_rng_state(self.rng_state)
        self.active = True
        try:
            yield
        finally:
            self.active = False
            if current is not None:
                device_module.set_rng_state(current)

    def watch_gradients(self, out):
        """Keep the output gradients as they arrive in backward: the recomputation waits for them."""

        def keep(grad):
            self.grads.append(grad)

        for t in pytree.tree_leaves(out):
            if isinstance(t, st.ShardedTensor) and t.requires_grad:
                t.register_hook(keep)

    def recompute(self, forward, inputs, kwargs):
        """Run ``forward`` again on barrier copies of its inputs and of the module's parameters."""
        flat, spec = pytree.tree_flatten((inputs, kwargs))
        params = list(self.module.parameters())  # a tied parameter comes once
        on_device = [x for x in flat if isinstance(x, st.ShardedTensor)] + [
            p for p in params if isinstance(p, st.ShardedTensor)
        ]
        if not on_device:
            return forward(*inputs, **kwargs)
        grads = [g for g in self.grads + _RECENT.take() if isinstance(g, st.ShardedTensor)]
        self.grads = []
        copies = optimization_barrier([x.detach() for x in on_device], after=grads)
        # same requires_grad as the originals, so the recomputation saves the same tensors
        by_id = {id(x): c.requires_grad_(x.requires_grad) for x, c in zip(on_device, copies)}
        flat = [by_id.get(id(x), x) for x in flat]
        inputs, kwargs = pytree.tree_unflatten(flat, spec)
        with _swapped_parameters(self.module, by_id):
            return forward(*inputs, **kwargs)


class _RecentParameterGradients:
    """Gradients of checkpointed modules' parameters produced since the last recomputation began.

    The next recomputation waits for them, so a module's weight gradients are computed before the
    module below it recomputes its activations, and not all together at the end of backward (which
    XLA:CPU's scheduler otherwise does, keeping every recomputed activation alive). One for the
    process: the hooks run on autograd's device thread, the forward on the caller's."""

    def __init__(self):
        self.grads = []
        # id(parameter) -> weakref to it (tensors can't be set members: == is elementwise)
        self.watched: dict[int, weakref.ref] = {}
        self.clear_queued = False

    def watch_parameters(self, module: nn.Module):
        for p in module.parameters():
            key = id(p)
            ref = self.watched.get(key)
            if p.requires_grad and isinstance(p, st.ShardedTensor) and (ref is None or ref() is not p):
                self.watched[key] = weakref.ref(p, functools.partial(self._forget, key))
                p.register_hook(self._keep)

    def _forget(self, key, _ref):
        self.watched.pop(key, None)

    def _keep(self, grad):
        self.grads.append(grad)
        if not self.clear_queued:  # the last module's gradients are nobody's dependency: drop them
            self.clear_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._clear)

    def _clear(self):
        self.grads, self.clear_queued = [], False

    def take(self) -> list:
        grads, self.grads = self.grads, []
        return grads


_RECENT = _RecentParameterGradients()


def _device_module():
    return torch.get_device_module(st.device().type)


@contextlib.contextmanager
def _swapped_parameters(module: nn.Module, by_id: dict):
    """Temporarily put ``by_id[id(p)]`` in place of each parameter ``p`` of ``module``.

    Written to ``_parameters`` directly (as torch.func.functional_call does) so that no module hook
    runs again and ``module.forward`` — the checkpointed one — is not re-entered.
    """
    swapped = []
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and id(p) in by_id:
                swapped.append((sub, name, p))
                sub._parameters[name] = by_id[id(p)]
    try:
        yield
    finally:
        for sub, name, p in swapped:
            sub._parameters[name] = p
