"""The check a frozen ``st.compile`` replay runs on each call: whether the Python state its trace
could read (``replay_guard.Snapshot``) is still as it was.

``Guard.holds(args)`` asks the C++ extension (``replay_state.h``) to compare each entry of the
snapshot's plan (dict and class version tags, list and set items, closure cells, tensors' flags,
globals by name), then torch's global state (``GlobalStateGuard``: grad mode, autocast, the default
dtype...), the mode stacks and SDPA switches, and the call's tensor arguments' requires_grad, hooks
and gradients. ``Kind`` names the plan's entry kinds; ``picker`` is the replay's C-level item getter.

Example::

    guard = Snapshot(roots).guard([x, y])   # (replay_guard)
    guard.holds([x, y])                    # False once a watched attribute, a hook... changed
"""

from __future__ import annotations

import enum
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardtensor.tensor import device as torch_device


def _ext() -> Any:
    """The C++ extension (its check's functions: replay_state.h); only called once ``available()``."""
    return torch_device.EXT


class Kind(enum.IntEnum):  # the C++ check's entry kinds (replay_state.h)
    DICT = 0
    OBJECT = 1
    TYPE = 2
    LIST = 3
    CELL = 4
    FUNCTION = 5
    GLOBALS = 6
    TENSOR = 7
    UNIQUE = 8
    SET = 9
    BYTES = 10
    FAST_TENSOR = 11
    LIVE_DICT = 12


def _global_state() -> tuple:
    """Torch's process-wide settings an op's recording depends on, beyond those GlobalStateGuard
    covers: the mode stacks and SDPA's backend switches."""
    return (
        torch._C._len_torch_function_stack(),
        torch._C._len_torch_dispatch_stack(),
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.math_sdp_enabled(),
        torch._C._get_overrideable_sdp_enabled(),
        torch.get_default_dtype(),
        torch.is_inference_mode_enabled(),
    )


class Guard:
    """Whether the state of a ``Snapshot`` still holds: ``holds(args)`` on each replay.

    The objects the snapshot reached are held weakly (any of them dying fails the guard) where they
    can be, strongly where they cannot (small values: numbers, strings, tuples, sets); dicts, which
    the check reads by their version tag, are not held."""

    def __init__(self, snapshot: Any, args: Sequence | None, grads_made: Sequence = (), debug: bool = False):
        from torch._C._dynamo.guards import GlobalStateGuard  # (C++: no import of torch._dynamo)

        ext = _ext()
        self.alive = True
        self.roots = snapshot.roots
        self._refs: list = []
        self._keep: list = []
        died = self._died
        for o in snapshot._objects:
            if isinstance(o, dict):
                continue
            if type(o).__weakrefoffset__:
                self._refs.append(weakref.ref(o, died))
            else:
                self._keep.append(o)
        entries = list(snapshot._entries)
        for _param, grad in grads_made:
            # the gradient is written in place by a replay: only while it is torch's alone (a
            # reference from Python elsewhere, or a view of it, would see the change)
            entries.append((int(Kind.UNIQUE), id(grad), 1, id(grad._cell)))
            fast = ext.tensor_fast(grad)
            entries.append(
                (int(Kind.FAST_TENSOR), id(grad)) if fast else (int(Kind.TENSOR), id(grad), ext.tensor_state(grad))
            )
            self._refs.append(weakref.ref(grad, died))
            self._refs.append(weakref.ref(grad._cell, died))
        self._plan = ext.state_plan(entries)
        # (with SHARDTENSOR_DEBUG: what each entry is about, for the message saying why a replay ran
        # the Python again)
        self._about = [o if isinstance(o, str) else snapshot._path(o) for o in snapshot._entry_owner] if debug else None
        self._global_state = GlobalStateGuard()
        self._state = _global_state()
        self._args = None if args is None else _arguments_state(args)

    def _died(self, _ref) -> None:
        self.alive = False

    def holds(self, args: Sequence = ()) -> bool:
        """Whether everything is as it was when the guard was taken."""
        return (
            self.alive
            and self._global_state.check()
            and _ext().state_holds(self._plan)
            and _global_state() == self._state
            and (self._args is None or _arguments_state(args) == self._args)
        )

    def failing(self) -> str:
        """Which part no longer holds (for SHARDTENSOR_DEBUG's messages)."""
        if not self.alive:
            return "an object it read was freed"
        if not self._global_state.check():
            return f"torch's global state changed ({self._global_state.reason()})"
        index = _ext().state_failing(self._plan)
        if index >= 0:
            about = self._about[index] if self._about is not None and index < len(self._about) else None
            return f"{about} changed" if about else f"entry {index} of its plan changed"
        return "the mode stacks, SDPA switches or arguments changed"


def _arguments_state(args: Sequence):
    """The call's tensor arguments' requires_grad, hooks and (a leaf's) gradient, by position."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return ()
    with torch._C.DisableTorchFunctionSubclass():  # a subclass's attribute getters, at C speed
        state = _ext().arguments_state(tensors)
        if state is not None:
            return state
        return tuple(
            (a.requires_grad, tuple(a._backward_hooks or ()), id(a.grad) if a.grad_fn is None else None)
            for a in tensors
        )


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
