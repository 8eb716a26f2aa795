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
``Guard(objects, args)`` takes their state; a replay asks ``guard.holds(args)`` (the modules and
tensors read in one pass by the C++ extension, ``guard_fingerprint``, else C-level passes over flat
lists: ~0.4 µs per parameter with its module, ~1.3 µs without the extension). Plain Python
attributes a function reads besides these (a global ``scale = 0.5``) are not seen: they stay
captured as they were.

Example::

    with watch() as seen:
        train_step(x)
    guard = Guard(seen.objects(), (x,))
    ...
    guard.holds((x,))      # False after p.grad was set, a hook added, ...
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.modules.module as torch_module
import torch.optim.optimizer as torch_optimizer

from shardtensor.tensor import device as torch_device

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
        # id -> module, in call order; held weakly: a module made and dropped inside the call (the
        # CrossEntropyLoss() a Hugging Face model builds in each forward) is gone by the end of the
        # call, and a replay, which runs none of that Python, does not depend on it
        self.modules: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.optimizers: dict = {}
        self.tensors: dict = {}

    def note_tensor(self, t) -> None:
        """An op read ``t``: remember it if it is a parameter (an ``nn.Parameter``, used by a module
        or not; other tensors made inside the call are new objects each time)."""
        if id(t) not in self.tensors and isinstance(t, torch.nn.Parameter):
            self.tensors[id(t)] = t

    def objects(self) -> tuple:
        """The objects whose state a replay depends on (the call's arguments apart: see ``Guard``)."""
        modules = tuple(self.modules.values())  # (the live ones, once)
        tensors = dict(self.tensors)
        for m in modules:
            for p in m._parameters.values():
                if p is not None:
                    tensors.setdefault(id(p), p)
        for opt in self.optimizers.values():
            for group in opt.param_groups:
                for p in group["params"]:
                    tensors.setdefault(id(p), p)
        return modules, tuple(self.optimizers.values()), tuple(tensors.values())


def ignore_hook(handle_id: int) -> None:
    """A global hook shardtensor installs for itself: the guard does not count it as the user's."""
    _OURS.add(handle_id)


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
    with attribute getters, list equality), with torch-function handling off while tensor
    attributes are read. Objects are compared by
    identity (a gradient, a parameter, a storage cell), hooks by their handles' ids, flags and
    hyperparameters by value. The guard keeps nothing alive (a dropped model is freed): it holds
    weak references, and any of those objects dying makes it fail, so an id cannot be reused.

    A watched tensor that is also one of ``args`` (a parameter passed to a Dynamo graph) is checked
    once, as an argument, while the same object is passed at that position. With ``args_guarded``
    the arguments are not checked at all, nor the watched tensors among them: the caller vouches for
    them (a Dynamo graph, whose function reads only its arguments, whose guards check each input's
    requires_grad, and whose frozen replays build no autograd graph through which hooks or
    gradients could act).
    """

    def __init__(
        self, objects: tuple[Sequence, Sequence, Sequence], args: Sequence = (), args_guarded: bool = False
    ) -> None:
        self.alive = True
        self._refs: list[Callable[[], Any]] = []  # weak references (their callbacks mark the guard dead), or the object
        # args_guarded: the caller checks the arguments' state itself (Dynamo's guards do, for a graph,
        # whose function reads its arguments only: the watched tensors passed as arguments are left out)
        self._args_guarded = args_guarded
        if args_guarded:
            passed = set(map(id, args))
            objects = (objects[0], objects[1], tuple(t for t in objects[2] if id(t) not in passed))
        self.counts = tuple(map(len, objects))
        self._roots = [self._watch(o) for o in itertools.chain(*objects)]
        modules, optimizers, tensors = objects
        plain, identities, hooks = self._state(modules, optimizers, tensors, () if args_guarded else args)
        for o in identities:
            if o is not None:
                self._watch(o)
        # identities as ids, or packed by the C extension when it has them (one form per guard)
        self._ids = getattr(torch_device.EXT, "addresses", None) or _id_list
        self.state = plain, self._ids(identities), hooks
        # the modules' and tensors' part read in one C pass when it can be (``_fingerprint``), the
        # rest (grad mode, optimizers, arguments, global hooks) in Python
        self._fingerprint = _fingerprint(modules, tensors)
        if self._fingerprint is not None:
            plain, identities, hooks = self._state((), optimizers, (), () if args_guarded else args)
            self._other_state = plain, self._ids(identities), hooks
        # the modules' and tensors' weak references, which the C pass reads through (no list of the
        # objects made first), and the optimizers'; None where one is not a weak reference
        m, o, _ = self.counts
        refs = self._roots
        self._weak: tuple | None = None
        if all(type(r) is weakref.ref for r in refs[:m] + refs[m + o :]):
            self._weak = tuple(refs[:m]), tuple(refs[m : m + o]), tuple(refs[m + o :])
        # the call's tensor arguments (a list: as ``holds`` is given them) and the optimizers read in
        # the same C pass where it can read them (tensors that take torch's own getters, optimizers
        # without strings in their groups), grad mode and the global hooks then in Python; None: no
        self._whole: bytes | None = None
        if (
            self._fingerprint is not None
            and self._weak is not None
            and not args_guarded
            and all(type(r) is weakref.ref for r in refs[m : m + o])
        ):
            self._whole = _fingerprint(modules, tensors, list(args), optimizers)
            if self._whole is not None:
                plain, identities, hooks = self._state((), (), (), ())
                self._outside = plain, self._ids(identities), hooks
        # the watched tensors passed as arguments: while each is passed again at its position, the
        # argument's check covers it (the others are checked as tensors, ``_rest``)
        position = {id(a): i for i, a in enumerate(args)} if not args_guarded else {}
        shared = [(i, position[id(t)]) for i, t in enumerate(tensors) if id(t) in position]
        self._shared = None
        if shared:
            self._shared = (
                picker([a for _, a in shared]),
                picker([t for t, _ in shared]),
                picker([i for i in range(len(tensors)) if id(tensors[i]) not in position]),
                len(args),
            )
            rest = self._shared[2](tensors)
            plain, identities, hooks = self._state(modules, optimizers, rest, () if args_guarded else args)
            self._rest_state = plain, self._ids(identities), hooks
            self._rest_fingerprint = _fingerprint(modules, rest) if self._fingerprint is not None else None
        # no optimizers, the arguments vouched for (a Dynamo graph's guard): a replay compares the
        # C pass, grad mode and the global hooks only (``_other_state`` then has no identities)
        self._modules_only = (
            self._weak is not None
            and self._shared is None
            and self._fingerprint is not None
            and self._whole is None
            and not optimizers
            and args_guarded
        )

    def objects(self) -> tuple[tuple, tuple, tuple] | None:
        """(modules, optimizers, tensors) as given, or None if one of them no longer exists."""
        if not self.alive:
            return None
        roots = list(map(operator.call, self._roots))  # all alive: a death marks the guard dead
        m, o, _ = self.counts
        return tuple(roots[:m]), tuple(roots[m : m + o]), tuple(roots[m + o :])

    def holds(self, args: Sequence = ()) -> bool:
        """Whether everything is as it was when the guard was taken."""
        weak = self._weak
        if self._modules_only and self.alive and weak is not None:
            now = _fingerprint(weak[0], weak[2])
            if now is not None:  # (None: one died, or took another form: the full check below says)
                if now != self._fingerprint:
                    return False
                plain, _, hooks = self._state((), (), (), ())
                return plain == self._other_state[0] and hooks == self._other_state[2]
        if weak is not None and self._shared is None and self._fingerprint is not None and self.alive:
            # (the modules and tensors read through their references, with the arguments and the
            # optimizers if it can)
            whole = self._whole is not None and isinstance(args, list)
            now = _fingerprint(weak[0], weak[2], args, weak[1]) if isinstance(args, list) and whole else None
            if now is None:
                whole = False
                now = _fingerprint(weak[0], weak[2])
            if now is not None:  # (None: one died, or took another form: the full check below says)
                if now != (self._whole if whole else self._fingerprint):
                    return False
                if whole:
                    state = self._outside
                    plain, identities, hooks = self._state((), (), (), ())
                else:
                    optimizers = tuple(map(operator.call, weak[1]))
                    if None in optimizers:  # (one died)
                        return False
                    state = self._other_state
                    plain, identities, hooks = self._state((), optimizers, (), () if self._args_guarded else args)
                return plain == state[0] and self._ids(identities) == state[1] and hooks == state[2]
        objects = self.objects()
        if objects is None:
            return False
        modules, optimizers, tensors = objects
        state, fingerprint = self.state, self._fingerprint
        shared = self._shared
        if shared is not None and len(args) == shared[3]:
            passed_again = all(map(operator.is_, shared[0](args), shared[1](tensors)))
            if passed_again:  # (the arguments' check covers them)
                tensors, state, fingerprint = shared[2](tensors), self._rest_state, self._rest_fingerprint
        args = () if self._args_guarded else args
        if fingerprint is not None:
            now = _fingerprint(modules, tensors)
            if now is not None:  # (None: a module's state took another form: compared in Python below)
                if now != fingerprint:
                    return False
                modules, tensors, state = (), (), self._other_state
        plain, identities, hooks = self._state(modules, optimizers, tensors, args)
        return plain == state[0] and self._ids(identities) == state[1] and hooks == state[2]

    def _watch(self, obj):
        ref: Callable[[], Any]
        try:
            ref = weakref.ref(obj, self._died)
        except TypeError:  # not weakly referenceable (a dict, say): keep it
            ref = functools.partial(_same_object, obj)
        self._refs.append(ref)
        return ref

    def _died(self, _ref):
        self.alive = False

    @staticmethod
    def _state(modules, optimizers, tensors, args):
        """(plain values, objects to compare by identity, hook ids); an empty group of objects
        costs nothing (the groups' sizes are fixed for a guard: an absent part compares as absent)."""
        plain: list = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
        identities: list = []
        if tensors or args:
            with torch._C.DisableTorchFunctionSubclass():  # a subclass's attribute getters, at C speed
                flags = list(map(_FLAGS, tensors))  # (requires_grad, hook dict, hook dict) each
                grads = list(map(_GRAD, tensors))
                arg_flags = list(map(_FLAGS, args))
                grad_fns = list(map(_GRAD_FN, args))
                if grad_fns.count(None) == len(grad_fns):  # all leaves (a non-leaf's .grad warns)
                    arg_grads = list(map(_GRAD, args))
                else:
                    arg_grads = [a.grad if fn is None else None for a, fn in zip(args, grad_fns)]  # only a leaf's
            # hooks by their handles' ids (the dict keys): every hook registered anywhere gets a new id,
            # so the ids of all hooks together say whether one was added or removed; a tensor without
            # hooks has None for both dicts, and those tuples compare as they are
            if flags.count(_NO_HOOKS) + flags.count(_NO_HOOKS_GRAD) != len(flags):
                flags = list(map(_hook_ids, flags))
            if arg_flags.count(_NO_HOOKS) + arg_flags.count(_NO_HOOKS_GRAD) != len(arg_flags):
                arg_flags = list(map(_hook_ids, arg_flags))
            plain += (flags, arg_flags)
            identities = grads + arg_grads + [getattr(t, "_cell", None) for t in tensors]
        hooks = [k for d in _GLOBAL_HOOK_DICTS for k in d if k not in _OURS]
        if modules:
            # each module's attributes from its __dict__, one C-level pass (attribute lookups would walk
            # the class's MRO first); a module that keeps one elsewhere (a property) takes getattr
            try:
                fields = list(map(_MODULE_FIELDS, map(vars, modules)))
            except KeyError:
                fields = list(map(_MODULE_ATTRS, modules))
            containers = list(itertools.chain.from_iterable(map(_CONTAINERS_OF, fields)))
            identities += itertools.chain.from_iterable(map(dict.values, containers))
            plain += (list(map(_TRAINING_OF, fields)), list(map(len, containers)))
            hooks += itertools.chain.from_iterable(filter(None, itertools.chain.from_iterable(map(_HOOKS_OF, fields))))
        for opt in optimizers:
            plain.append(id(opt.state))  # the optimizer holds it
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
            hooks += (*opt._optimizer_step_pre_hooks, *opt._optimizer_step_post_hooks)
        return plain, identities, hooks


def _fingerprint(
    modules: Sequence, tensors: Sequence, args: list | None = None, optimizers: Sequence | None = None
) -> bytes | None:
    """The modules' and tensors' guarded state read by the C++ extension in one pass (equal bytes:
    the same state), or None without the extension or when a module keeps it in another form;
    with ``args``, a call's tensor arguments' too, and with ``optimizers`` theirs (None where it
    cannot read them: a tensor with getters of its own, a string in a parameter group)."""
    read = getattr(torch_device.EXT, "guard_fingerprint", None)
    if read is None:
        return None
    if not tensors and args is None and optimizers is None:  # (modules only: their dicts, no tensor getter)
        return read(tuple(modules), ())
    with torch._C.DisableTorchFunctionSubclass():  # a subclass's attribute getters, at C speed
        if args is None:
            return read(tuple(modules), tuple(tensors))
        if optimizers is None:
            return read(tuple(modules), tuple(tensors), args)
        return read(tuple(modules), tuple(tensors), args, tuple(optimizers))


def picker(indices: list[int]) -> Callable[[Sequence], tuple]:
    """A function giving the items of a sequence at ``indices``, as a tuple (C-level for 2 or more).

    Example: ``picker([2, 0])("abc") == ("c", "a")``
    """
    if len(indices) >= 2:
        return operator.itemgetter(*indices)
    if indices:
        (i,) = indices
        return lambda items: (items[i],)
    return lambda items: ()


def _id_list(objects: Sequence) -> list[int]:
    """The ids of ``objects``, in order (the extension's ``addresses`` packs the same into bytes)."""
    return list(map(id, objects))


def _hook_ids(flags: tuple) -> tuple:
    """(requires_grad, ids of the backward hooks, ids of the post-accumulate-grad hooks)."""
    requires_grad, backward, accumulate = flags
    return requires_grad, tuple(backward or ()), tuple(accumulate or ())


def _same_object(obj):
    return obj


_GRAD = operator.attrgetter("grad")
_GRAD_FN = operator.attrgetter("grad_fn")
_FLAGS = operator.attrgetter("requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks")
_NO_HOOKS, _NO_HOOKS_GRAD = (False, None, None), (True, None, None)
_FIELDS = (  # what the guard reads of a module: its mode, containers and hook dicts
    "training",
    "_parameters",
    "_buffers",
    "_modules",
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
)
_MODULE_FIELDS = operator.itemgetter(*_FIELDS)  # (from the module's __dict__)
_MODULE_ATTRS = operator.attrgetter(*_FIELDS)
_TRAINING_OF = operator.itemgetter(0)
_CONTAINERS_OF = operator.itemgetter(1, 2, 3)
_HOOKS_OF = operator.itemgetter(4, 5, 6, 7)
