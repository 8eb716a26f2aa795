"""Tied parameters stay tied when a module moves onto ``st.device()``.

``Module._apply`` (``model.to(st.device())``) keeps a parameter object when the moved tensor can take
over its storage type (``param.data = moved``). A CPU parameter that becomes a ShardedTensor cannot,
so torch makes a new ``Parameter(moved)`` for each module that holds it, and one parameter held by
two modules (tied embeddings, ``head.weight = emb.weight``) would come out as two that train apart.
So a move inside ``Module._apply`` remembers which device parameter each CPU parameter became, and
a second move of the same, unchanged CPU parameter there gets that same parameter back: the modules
share one parameter, as they do after a move on any torch device. Outside ``Module._apply``,
``nn.Parameter(p.to(st.device()))`` is always a new tensor.

Example::

    model.lm_head.weight = model.embed.weight
    model.to(st.device())
    assert model.lm_head.weight is model.embed.weight
"""

from __future__ import annotations

import functools
import sys
import types
import weakref

import torch

_APPLY = torch.nn.Module._apply.__code__
# id(CPU parameter) -> (weakref to it, its version when moved, weakref to the device parameter)
_MOVED: dict[int, tuple] = {}


def note_move(dst, src) -> None:
    """``dst`` (a new device tensor) was filled from ``src``: remember the source if ``src`` is a
    parameter that a ``Module._apply`` is moving."""
    if isinstance(src, torch.nn.Parameter) and _inside_module_apply():
        dst.__dict__["_moved_parameter"] = (weakref.ref(src), src._version)


def parameter_for(moved):
    """The device parameter an earlier move of the same unchanged CPU parameter gave, or None."""
    src, version = _source(moved)
    entry = _MOVED.get(id(src)) if src is not None else None
    if entry is None or entry[0]() is not src or entry[1] != version:
        return None
    return entry[2]()


def remember(moved, parameter) -> None:
    """``parameter`` (``moved`` detached, as ``nn.Parameter(moved)`` does) is what its source became."""
    src, version = _source(moved)
    if src is not None:
        key = id(src)
        _MOVED[key] = (weakref.ref(src, functools.partial(_forget, key)), version, weakref.ref(parameter))


def _source(moved):
    """(the CPU parameter ``moved`` was filled from, or None; its version then)."""
    ref, version = moved.__dict__.get("_moved_parameter", (lambda: None, None))
    return ref(), version


def _forget(key: int, _ref) -> None:
    _MOVED.pop(key, None)


def _inside_module_apply() -> bool:
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _APPLY:
            return True
        frame = frame.f_back
    return False
