"""Reading and writing through view chains.

A view is its Cell plus a chain of ``ViewStep``s (the view ops applied to the Cell's value). Reading
replays the chain; writing runs it backwards with scatters, so ``x.t().mul_(2)`` or ``x[:, 0] = 1``
updates the base exactly as torch does.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from shardtensor import lazy
from shardtensor.storage import Failed, Leaf, Node, Pending

aten = torch.ops.aten

_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.alias.default, aten.detach.default,
             aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
             aten._reshape_alias.default, aten.reshape.default}
_TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}


class ViewStep:
    """One view op in a chain: forward ``caller(base) -> (view,)`` and the scatter that inverts it."""

    __slots__ = ("func", "args", "kwargs", "caller", "index", "key", "in_shape", "out_shape", "_scatter")

    def __init__(self, func, args, kwargs, caller, index, key, in_shape, out_shape):
        self.func, self.args, self.kwargs = func, args, kwargs  # args without the base
        self.caller, self.index, self.key = caller, index, key
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self._scatter = None

    def scatter(self):
        """A function (base, src) -> base with the viewed elements replaced by src."""
        if self._scatter is None:
            self._scatter = _make_scatter(self)
        return self._scatter


def apply(step: ViewStep, ref):
    """Record (or run) the view op on a value reference; returns a reference to the view."""
    node = Node(step.caller, ("view", step.key), (ref,))
    return Pending(node, step.index)


def scatter(step: ViewStep, base_ref, src_ref):
    """Reference to ``base`` with the part ``step`` views replaced by ``src``."""
    node = Node(step.scatter(), ("scatter", step.key), (base_ref, src_ref))
    return Pending(node, 0)


def _make_scatter(step: ViewStep):
    func, args = step.func, step.args
    if func in _RESHAPES:
        return lambda base, src: (src.reshape(base.shape).astype(base.dtype),)
    if func in _TRANSPOSES:
        perm = _permutation(func, args, len(step.in_shape))
        inverse = tuple(int(i) for i in np.argsort(perm))
        return lambda base, src: (jnp.transpose(src, inverse).astype(base.dtype),)
    if func is aten.slice.Tensor:
        dim, start, end, stepsize = (list(args) + [0, None, None, 1][len(args):])[:4]
        dim = dim % len(step.in_shape)
        start, _, stepsize = slice(start, end, stepsize).indices(step.in_shape[dim])
        if stepsize == 1:
            return _update_slice(dim, start, squeeze=False)
        index = (slice(None),) * dim + (slice(start, end, stepsize),)
        return lambda base, src: (base.at[index].set(src.astype(base.dtype)),)
    if func is aten.select.int:
        dim = args[0] % len(step.in_shape)
        return _update_slice(dim, args[1] % step.in_shape[dim], squeeze=True)
    return _generic_scatter(step)


def _update_slice(dim, start, squeeze):
    # dynamic_update_slice rather than .at[].set: XLA (jax 0.10.2) miscompiles a sharded
    # dynamic_update_slice followed by a scatter, so every contiguous write uses the same primitive.
    def scatter_fn(base, src):
        src = src.astype(base.dtype)
        if squeeze:
            src = jnp.expand_dims(src, dim)
        return (jax.lax.dynamic_update_slice_in_dim(base, src, start, axis=dim),)

    return scatter_fn


def _permutation(func, args, ndim):
    if func is aten.t.default:
        return (1, 0) if ndim == 2 else tuple(range(ndim))
    if func is aten.transpose.int:
        perm = list(range(ndim))
        a, b = args[0] % ndim, args[1] % ndim
        perm[a], perm[b] = perm[b], perm[a]
        return tuple(perm)
    return tuple(d % ndim for d in args[0])


def _generic_scatter(step: ViewStep):
    # Which base element each view element reads, worked out by running the same view op on indices.
    n = math.prod(step.in_shape)
    positions = torch.arange(n, dtype=torch.int64).reshape(step.in_shape)
    with torch._C._DisableTorchDispatch():
        viewed = step.func(positions, *step.args, **step.kwargs)
    if isinstance(viewed, (tuple, list)):
        viewed = viewed[step.index]
    flat = viewed.contiguous().reshape(-1).numpy()

    def scatter_fn(base, src):
        out = base.reshape(-1).at[flat].set(src.reshape(-1).astype(base.dtype))
        return (out.reshape(base.shape),)

    return scatter_fn


def read(t):
    """The value reference of ShardedTensor ``t`` (Pending or Leaf)."""
    cell = t._cell
    if not t._chain:
        return _base_ref(cell)
    cached = t._vcache
    if cached is not None and cached[0] == lazy.STATE.epoch and cached[1] == cell.version and cached[2] is cell.value:
        return cached[3]
    ref = _base_ref(cell)
    for step in t._chain:
        ref = apply(step, ref)
    t._vcache = (lazy.STATE.epoch, cell.version, cell.value, ref)
    return ref


def _base_ref(cell):
    v = cell.value
    if isinstance(v, Pending):
        return v
    if isinstance(v, Failed):
        v.reraise()
    return cell.leaf()


def _identity(x):
    return (x,)


def write(t, ref) -> None:
    """Make ``ref`` the new value of ``t``, writing through its view chain into the Cell."""
    cell = t._cell
    if isinstance(ref, Leaf):  # a concrete value: copy it through a node so cells never share arrays
        ref = Pending(Node(_identity, ("identity",), (ref,)), 0)
    if t._chain:
        parts = [_base_ref(cell)]
        for step in t._chain[:-1]:
            parts.append(apply(step, parts[-1]))
        for step, part in zip(reversed(t._chain), reversed(parts)):
            ref = scatter(step, part, ref)
    lazy.set_pending(cell, ref)
