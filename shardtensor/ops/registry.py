"""The lowering table: aten op overload -> a function of jax values with torch semantics.

A lowering receives, in the positions of the aten schema:
  * tensors as ``jax.Array`` (or tracers) with the logical (unpadded) shape and the exact torch dtype;
  * ``Scalar`` arguments as 0-d weakly-typed jax values (so they are graph inputs, not constants, and a
    loop whose learning rate changes does not recompile) — unless the op is registered with
    ``static_scalars=True``, in which case they arrive as Python numbers, or with a set of values
    (``static_scalars={2, 0.5}``: those the lowering specializes, as torch's kernel does), in which
    case a Scalar equal to one of them arrives as a Python number and any other as a jax value;
  * everything else (int, int[], bool, float, str, torch.dtype, torch.device, None) as the Python value.
It returns jax values shaped like the schema's returns (one value, or a tuple). The dispatcher casts
each result to the dtype torch would give, as a safety net, but a lowering should get it right itself.

Example::

    @register(aten.neg.default)
    def neg(x):
        return -x
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One entry of the table: the function and how the dispatcher must call it."""

    fn: Callable
    # Scalar args are Python numbers baked into the program: all of them (True), or those equal to a
    # value of this frozenset (the ones the lowering specializes; other values stay runtime inputs)
    static_scalars: bool | frozenset = False
    random: bool = False  # fn(key, *args, **kwargs): gets a fresh jax PRNG key first
    # torch's CPU kernel gives other result dtypes than its meta kernel: take them from the lowering
    dtypes_from_lowering: bool = False
    # torch's meta kernel refuses or crashes on inputs its CPU kernel takes (it checks CUDA's rules,
    # or the LSTM cell's without biases): take the result shapes and dtypes from the lowering
    # (jax.eval_shape) instead
    meta_from_lowering: bool = False
    platforms: tuple = ()  # (platform name, fn) pairs: a variant of fn for that PJRT platform
    checked: bool = False  # fn may declare on-device checks (ops.checks): record the user's line
    # ``float`` arguments (by name) that enter as runtime scalars, like Scalars: a learning rate that
    # a scheduler changes every step must not recompile the step
    runtime_floats: frozenset = frozenset()
    # the lowering's dots/convolutions follow torch's float32 matmul precision (ops.precision): the
    # dispatcher reads it when the op is recorded and keys the op on it
    products: bool = False
    # validate(*args, **kwargs): raises torch's exception for arguments torch's CPU kernel refuses and
    # its meta kernel lets pass (shapes, dtypes, static values); called with the op's own arguments
    # (tensors as torch tensors: read their shape and dtype) when the op is first recorded with them,
    # so the mistake is raised at the op, not when the program is built
    validate: Callable | None = None

    def for_platform(self, platform: str) -> Callable:
        """The function to run on ``platform`` ('cpu', 'cuda', 'tpu'): its variant, else ``fn``."""
        return dict(self.platforms).get(platform, self.fn)


class OpTable(dict):
    """A dict keyed by aten overloads that also answers by the overload's identity (``find``).

    An ``OpOverload`` hashes in Python (~0.3 us a lookup) and the dispatch looks every op up in
    such tables; ``find`` is one C-level lookup by ``id(op)``. Each key also sits in ``ids`` as
    ``id(op) -> (op, value)`` (the dict holds ``op`` alive, so no other object has its id meanwhile).

    Example::

        table = OpTable()
        table[aten.add.Tensor] = "add"
        table.find(aten.add.Tensor) == "add" and table.find(aten.mul.Tensor) is None   # True
    """

    def __init__(self):
        super().__init__()
        self.ids: dict = {}

    def __setitem__(self, op, value):
        super().__setitem__(op, value)
        self.ids[id(op)] = (op, value)

    def __delitem__(self, op):
        super().__delitem__(op)
        del self.ids[id(op)]

    def pop(self, op, *default):
        self.ids.pop(id(op), None)
        return super().pop(op, *default)

    def popitem(self):
        op, value = super().popitem()
        del self.ids[id(op)]
        return op, value

    def setdefault(self, op, default=None):
        if op not in self:
            self[op] = default
        return self[op]

    def update(self, *args, **kwargs):
        for op, value in dict(*args, **kwargs).items():
            self[op] = value

    def clear(self):
        super().clear()
        self.ids.clear()

    def find(self, op):
        """``self.get(op)`` without hashing ``op``."""
        entry = self.ids.get(id(op))
        return None if entry is None or entry[0] is not op else entry[1]


_TABLE: OpTable = OpTable()  # aten overload -> Lowering


def bakes_scalar(static_scalars: bool | frozenset, value) -> bool:
    """Whether a Python number in a ``Scalar`` argument of an op registered with ``static_scalars``
    reaches its lowering as that number (baked into the program) rather than as a 0-d jax value.

    Example: ``bakes_scalar(frozenset({2}), 2) and not bakes_scalar(frozenset({2}), 1.7)``.
    """
    if isinstance(static_scalars, frozenset):
        return value in static_scalars
    return static_scalars


def register(
    *ops,
    static_scalars: bool | frozenset = False,
    random: bool = False,
    dtypes_from_lowering: bool = False,
    meta_from_lowering: bool = False,
    platform: str | None = None,
    checked: bool = False,
    runtime_floats: tuple = (),
    products: bool = False,
    validate: Callable | None = None,
):
    """Decorator: register ``fn`` as the lowering of every aten overload in ``ops``.

    ``platform="cpu"`` registers a variant for that platform of an op registered before.
    ``checked=True``: the lowering may call ``ops.checks.fail_where`` (torch raises on some values).
    ``runtime_floats``: names of ``float`` arguments passed as 0-d jax values, not baked in.
    ``products=True``: the lowering's products use ``ops.precision.precision()`` (torch's float32
    matmul precision when the op was recorded).
    ``static_scalars``: True bakes every ``Scalar`` argument into the program as a Python number; a
    set of values bakes only a Scalar equal to one of them (see the module docstring).
    ``validate``: a function of the op's arguments that raises torch's exception for bad ones that
    torch's meta kernel lets pass (see ``Lowering.validate``).

    Example::

        @register(aten.add.Tensor, aten.add.Scalar)
        def add(x, y, *, alpha=1):
            return x + alpha * y
    """

    def deco(fn):
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(f"register() takes aten overloads such as aten.add.Tensor, got {op!r}")
            if platform is not None:
                if op not in _TABLE:
                    raise ValueError(f"{op}: register its lowering before a variant for {platform}")
                entry = _TABLE[op]
                _TABLE[op] = dataclasses.replace(entry, platforms=entry.platforms + ((platform, fn),))
                continue
            if op in _TABLE:
                raise ValueError(f"{op} has two lowerings")
            _TABLE[op] = Lowering(
                fn,
                static_scalars=static_scalars,
                random=random,
                dtypes_from_lowering=dtypes_from_lowering,
                meta_from_lowering=meta_from_lowering,
                checked=checked,
                runtime_floats=frozenset(runtime_floats),
                products=products,
                validate=validate,
            )
        return fn

    return deco


def lookup(op) -> Lowering | None:
    """The lowering registered for ``op``, or None.

    Example::

        lookup(torch.ops.aten.add.Tensor).fn(x, y)
    """
    return _TABLE.find(op)


def registered_ops() -> list:
    """Every aten overload that has a direct lowering."""
    return list(_TABLE)
