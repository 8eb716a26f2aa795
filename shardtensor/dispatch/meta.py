"""Output metadata of an op: the shapes, dtypes and strides torch gives its results, from torch's
meta kernels (or, for the few ops torch has none for, from the lowering itself)."""

from __future__ import annotations

import jax
import torch
from torch.utils import _pytree as pytree

from shardtensor.dtypes import to_jax, to_torch
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.geometry import contiguous_strides, meta_like
from shardtensor.trees import map_leaves


def as_meta(value):
    """``value`` with every ShardedTensor (and device) replaced by its meta twin, for torch's meta kernels."""
    return map_leaves(_meta_leaf, value)


def _meta_leaf(value):
    if isinstance(value, ShardedTensor):
        return meta_like(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type == "cpu":
        # a CPU scalar, which torch's kernels take beside any device's tensors (``masked_fill(mask,
        # torch.tensor(0.))``, copysign); some meta kernels insist on one device for all
        return value.to("meta")
    if isinstance(value, torch.device) and value.type != "cpu":
        return torch.device("meta")
    return value


def meta_outputs(func, args, kwargs):
    """Run torch's meta kernel: the shapes and dtypes torch gives, and the output structure."""
    margs, mkw = as_meta((args, kwargs))
    with torch._C._DisableTorchDispatch():
        out = func(*margs, **mkw)
    if out is None:
        return (), "none"
    if isinstance(out, torch.Tensor):
        return (describe(out),), "one"
    if isinstance(out, tuple) and any(isinstance(o, list) for o in out):  # _fused_adam: lists in a tuple
        flat = [t for o in out for t in (o if isinstance(o, list) else [o])]
        grouping = tuple(len(o) if isinstance(o, list) else None for o in out)
        return tuple(None if o is None else describe(o) for o in flat), grouping
    structure = "list" if isinstance(out, list) else "tuple"
    return tuple(None if o is None else describe(o) for o in out), structure


# elements of the zero tensors ``torch_cpu_error`` may make: its probe runs on small or empty tensors
_PROBE_ELEMENTS = 1 << 20


def has_empty_tensor(args, kwargs) -> bool:
    """Whether a ShardedTensor among the arguments has no element (torch's kernels check such inputs
    where its meta kernels often do not: ``max()`` of an empty tensor)."""
    return any(isinstance(v, ShardedTensor) and v.numel() == 0 for v in pytree.tree_leaves((args, kwargs)))


def torch_cpu_error(func, args, kwargs):
    """The exception torch's CPU kernel raises for the aten op ``func`` on zero tensors shaped and
    typed like the arguments' ShardedTensors, or None (it raises nothing, has no CPU kernel for them,
    or they hold more than ``_PROBE_ELEMENTS`` elements).

    For a mistake that depends on shapes, dtypes and arguments only (not on values), that is the
    exception torch gives the user: torch's meta kernels raise another type for some of them
    (RuntimeError where the CPU kernel raises IndexError) and skip others.

    Example::

        torch_cpu_error(aten.max.default, (empty_sharded,), {})   # RuntimeError('max(): Expected ...')
    """
    if func.namespace != "aten":  # (a library's or a collective's kernel may need more than tensors)
        return None
    leaves = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, ShardedTensor)]
    if sum(v.numel() for v in leaves) > _PROBE_ELEMENTS:
        return None

    def on_cpu(value):
        if isinstance(value, ShardedTensor):
            return torch.zeros(tuple(value.shape), dtype=value.dtype)
        if isinstance(value, torch.device) and value.type != "cpu":
            return torch.device("cpu")
        return value

    cpu_args, cpu_kwargs = map_leaves(on_cpu, (args, kwargs))
    # (its random draws must not move torch's generator; its warnings are those torch would give)
    with torch._C._DisableTorchDispatch(), torch.random.fork_rng(devices=[]):
        try:
            func(*cpu_args, **cpu_kwargs)
        except NotImplementedError:  # no CPU kernel for these: nothing learned
            return None
        except Exception as error:  # noqa: BLE001  (returned: the caller raises it)
            if "not implemented for" in str(error):  # a dtype CPU kernels lack and devices have
                return None
            return error
    return None


def regroup(values, structure):
    """An op's results from its flat outputs, shaped as ``structure`` says: "one", "list", "tuple", or a
    tuple of group sizes (None: a single tensor, n: a list of n), as in ``_fused_adam``'s tuple of lists.

    Example::

        regroup([a, b, c], (2, None))   # ([a, b], c)
    """
    if structure == "one":
        return values[0]
    if structure == "list":
        return list(values)
    if not isinstance(structure, tuple):
        return tuple(values)
    it = iter(values)
    return tuple(next(it) if n is None else [next(it) for _ in range(n)] for n in structure)


def flat_results(out, structure: tuple) -> tuple:
    """A lowering's tuple of lists (and tensors) as one flat tuple; ``structure``: its group sizes.

    Example::

        flat_results(([a, b], c), (2, None))   # (a, b, c)
    """
    return tuple(v for o, n in zip(out, structure) for v in (o if n is not None else [o]))


def describe(t):
    """(shape, dtype, strides, storage offset) of a meta result."""
    return tuple(t.shape), t.dtype, t.stride(), t.storage_offset()


def outputs_from_lowering(func, lowering, args, kwargs):
    """Output metadata from the lowering itself (``jax.eval_shape``), for the few ops torch has no
    meta kernel for (geqrf, linalg_lstsq): contiguous results of the shapes and dtypes it returns (None
    for an undefined optional result, as the GRU cell backward's bias gradients without biases)."""

    # only tensors are traced: ints, bools and floats stay Python values, as in a real call
    flat, spec = pytree.tree_flatten((args, kwargs))
    traced = [i for i, v in enumerate(flat) if isinstance(v, ShardedTensor)]
    tensors = [jax.ShapeDtypeStruct(tuple(flat[i].shape), to_jax(flat[i].dtype)) for i in traced]

    def run(*values):
        filled = list(flat)
        for i, v in zip(traced, values):
            filled[i] = v
        pos, kw = pytree.tree_unflatten(filled, spec)
        return lowering.fn(jax.random.key(0), *pos, **kw) if lowering.random else lowering.fn(*pos, **kw)

    out = jax.eval_shape(run, *tensors)
    structure = "tuple" if isinstance(out, (tuple, list)) else "one"
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(
        None if o is None else (tuple(o.shape), to_torch(o.dtype), contiguous_strides(tuple(o.shape)), 0) for o in outs
    ), structure
