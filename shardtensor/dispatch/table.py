"""The declared table of special handlers: aten ops that are not recorded as one lowering (host
values, data-dependent shapes, storage and device changes). Handler modules fill it with
``@special``; the dispatch entry looks ops up in it first.

Example::

    @special(aten._local_scalar_dense.default)
    def _item(func, args, kwargs):
        return to_cpu(args[0]).item()
"""

from __future__ import annotations

import torch

from shardtensor.ops.registry import OpTable

SPECIAL: OpTable = OpTable()  # aten overload -> handler(func, args, kwargs); the entry uses SPECIAL.find


def special(*ops):
    """Decorator: ``fn(func, args, kwargs)`` handles every overload in ``ops``."""

    def deco(fn):
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(f"special() takes aten overloads, got {op!r}")
            if op in SPECIAL:
                raise ValueError(f"{op} has two special handlers")
            SPECIAL[op] = fn
        return fn

    return deco
