"""Output metadata of an op: the shapes, dtypes and strides torch gives its results, from torch's
meta kernels (or, for the few ops torch has none for, from the lowering itself)."""
from __future__ import annotations

import jax
import torch

from shardtensor.dtypes import to_jax, to_torch
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.geometry import contiguous_strides, meta_like


def as_meta(value):
    """``value`` with every ShardedTensor (and device) replaced by its meta twin, for torch's meta kernels."""
    if isinstance(value, ShardedTensor):
        return meta_like(value)
    if isinstance(value, (list, tuple)):
        return type(value)(as_meta(v) for v in value)
    if isinstance(value, torch.device) and value.type != "cpu":
        return torch.device("meta")
    return value


def meta_outputs(func, args, kwargs):
    """Run torch's meta kernel: the shapes and dtypes torch gives, and the output structure."""
    margs = [as_meta(a) for a in args]
    mkw = {k: as_meta(v) for k, v in kwargs.items()}
    with torch._C._DisableTorchDispatch():
        out = func(*margs, **mkw)
    if out is None:
        return (), "none"
    if isinstance(out, torch.Tensor):
        return (describe(out),), "one"
    structure = "list" if isinstance(out, list) else "tuple"
    return tuple(None if o is None else describe(o) for o in out), structure


def describe(t):
    """(shape, dtype, strides, storage offset) of a meta result."""
    return tuple(t.shape), t.dtype, t.stride(), t.storage_offset()


class _TensorSlot:
    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index


def outputs_from_lowering(func, lowering, args, kwargs):
    """Output metadata from the lowering itself (``jax.eval_shape``), for the few ops torch has no
    meta kernel for (geqrf, linalg_lstsq): contiguous results of the shapes and dtypes it returns."""

    tensors = []  # only tensors are traced: ints, bools and floats stay Python values, as in a real call

    def abstract(v):
        if isinstance(v, ShardedTensor):
            tensors.append(jax.ShapeDtypeStruct(tuple(v.shape), to_jax(v.dtype)))
            return _TensorSlot(len(tensors) - 1)
        if isinstance(v, (list, tuple)):
            return type(v)(abstract(x) for x in v)
        return v

    def fill(v, values):
        if isinstance(v, _TensorSlot):
            return values[v.index]
        if isinstance(v, (list, tuple)):
            return type(v)(fill(x, values) for x in v)
        return v

    a, k = [abstract(x) for x in args], {n: abstract(v) for n, v in kwargs.items()}

    def run(*values):
        pos, kw = fill(a, values), {n: fill(v, values) for n, v in k.items()}
        return lowering.fn(jax.random.key(0), *pos, **kw) if lowering.random else lowering.fn(*pos, **kw)

    out = jax.eval_shape(run, *tensors)
    structure = "tuple" if isinstance(out, (tuple, list)) else "one"
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple((tuple(o.shape), to_torch(o.dtype), contiguous_strides(tuple(o.shape)), 0) for o in outs), structure
