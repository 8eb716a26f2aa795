"""A JAX function as one torch op: ``torch.ops.shardtensor.call_jax(Tensor[] args, int fn_key) -> Tensor[]``.

The op carries only tensors and an int: ``fn_key`` names an entry of a table of JAX calls (the
function, its static keyword arguments, how it is partitioned). The same function with the same
static arguments and partitioning always gets the same key, so two recordings of a step give the same
graph node (``st.compile`` freezes such a step) and the executable cache keys on it like on any op.

* On ShardedTensors the op is recorded like an aten op: its lowering calls the JAX function on the
  jax values (eager, lazy, compiled, ``torch.compile(backend="shardtensor")`` alike), so it is part of
  the one program.
* On CPU tensors it runs the function at once with JAX on its CPU device and returns CPU tensors.
* Its fake (meta) kernel is ``jax.eval_shape`` of the function.
* Its gradient is ``jax.vjp`` of the function (a ``jax.custom_vjp`` of the user is honoured by it),
  itself a ``call_jax`` op, so a backward is part of the program too and has its own gradient.

Partitioning: without a mesh the function is an ordinary piece of the global program (GSPMD
partitions it by the shardings around it; an opaque kernel such as a Pallas call is run replicated:
every device computes the whole result). With a mesh and specs it runs per shard under
``jax.shard_map``. The public face is ``shardtensor.jax_ops`` (``st.call_jax``, ``st.jax_op``).

Example::

    key = key_for(JaxCall(jnp.sin))
    torch.ops.shardtensor.call_jax([x], key)      # [sin(x)]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch

from shardtensor import runtime as rt
from shardtensor.dtypes import numpy_to_torch, to_jax, to_torch, torch_to_numpy
from shardtensor.ops.registry import register

# --------------------------------------------------------------------------- the table of calls


@dataclasses.dataclass(frozen=True)
class JaxCall:
    """One entry: ``fn(*arrays, **static)``, run per shard under ``jax.shard_map`` when ``mesh`` is set.

    ``static`` is a tuple of (name, value) pairs, sorted; ``in_specs`` / ``out_specs`` are tuples of
    jax PartitionSpecs over ``mesh``'s jax mesh (``out_specs`` a single spec when the function
    returns one array). Equal entries get equal keys, so the fields must be hashable.
    """

    fn: Callable
    static: tuple = ()
    mesh: jax.sharding.Mesh | None = None  # None: the function is a piece of the global program
    in_specs: Any = None
    out_specs: Any = None
    check_vma: bool = False

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", None) or getattr(self.fn, "__name__", None) or repr(self.fn)

    def function(self) -> Callable:
        """The function of the input arrays alone (static arguments bound, shard_map applied)."""
        fn = functools.partial(self.fn, **dict(self.static)) if self.static else self.fn
        if self.mesh is None:
            return fn
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=self.in_specs, out_specs=self.out_specs, check_vma=self.check_vma
        )


@dataclasses.dataclass(frozen=True)
class _VjpCall:
    """The backward of entry ``of``: (primals..., cotangents of the differentiable outputs) -> the
    cotangents of the differentiable inputs. ``diff_in``/``diff_out``: masks of what is differentiable."""

    of: int
    diff_in: tuple
    diff_out: tuple

    @property
    def name(self) -> str:
        return f"vjp of {entry(self.of).name}"

    def function(self) -> Callable:
        forward = entry(self.of).function()
        n_in = len(self.diff_in)

        def backward(*values):
            primals, cts = list(values[:n_in]), list(values[n_in:])
            diff = [i for i, d in enumerate(self.diff_in) if d]

            def of_differentiable(*xs):
                filled = list(primals)
                for i, x in zip(diff, xs):
                    filled[i] = x
                return _as_tuple(forward(*filled))

            outs, pull = jax.vjp(of_differentiable, *[primals[i] for i in diff])
            it = iter(cts)
            full = tuple(next(it) if d else np.zeros(o.shape, jax.dtypes.float0) for o, d in zip(outs, self.diff_out))
            return tuple(pull(full))

        return backward


_LOCK = threading.Lock()
_KEYS: dict = {}  # entry -> key
_ENTRIES: list = []  # key -> entry
_SINGLE: dict[int, bool] = {}  # key -> the function returns one array (not a tuple)
_FUNCTION_IDS: set[int] = set()  # id() of every registered function (each kept alive by _ENTRIES)


def is_registered_function(obj) -> bool:
    """Whether ``obj`` was given to ``call_jax``/``jax_op``: like ``jax.jit``, its program is keyed by the
    function itself, so a frozen replay compares it by identity and does not look into its state.

    Example: ``key_for(JaxCall(jnp.sin)); is_registered_function(jnp.sin) is True``.
    """
    return id(obj) in _FUNCTION_IDS


def key_for(call) -> int:
    """The stable int key of a JaxCall (the same for equal entries).

    Example: ``key_for(JaxCall(jnp.sin)) == key_for(JaxCall(jnp.sin))``.
    """
    try:
        hash(call)
    except TypeError:
        raise TypeError(
            f"call_jax: the function {getattr(call.fn, '__name__', call.fn)!r} and its static keyword arguments "
            f"must be hashable (they key the compiled program); got {dict(call.static)!r}. Pass tuples, not lists "
            "or arrays, as static arguments."
        ) from None
    with _LOCK:
        key = _KEYS.get(call)
        if key is None:
            key = _KEYS[call] = len(_ENTRIES)
            _ENTRIES.append(call)
            if isinstance(call, JaxCall):  # (a backward entry holds its forward's key, no function)
                _FUNCTION_IDS.add(id(call.fn))
        return key


def entry(key: int):
    """The JaxCall (or backward) of ``key``."""
    if not 0 <= key < len(_ENTRIES):
        raise KeyError(f"call_jax: no JAX function is registered under key {key}; use st.call_jax / st.jax_op.")
    return _ENTRIES[key]


def returns_single(key: int) -> bool:
    """Whether the function of ``key`` returned one array (not a tuple) when it was last run or traced."""
    return _SINGLE[key]


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _check_outputs(key: int, out) -> tuple:
    """The flat outputs of the function of ``key``; a clear error for anything but arrays."""
    single = not isinstance(out, (tuple, list))
    outs = _as_tuple(out)
    name = entry(key).name
    if not outs:
        raise TypeError(f"call_jax: {name} returned no arrays; it must return an array or a tuple of arrays.")
    for i, o in enumerate(outs):
        if not (isinstance(o, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)) or hasattr(o, "aval")):
            raise TypeError(
                f"call_jax: output {i} of {name} is a {type(o).__name__}, not an array; the function must return "
                "a jax array or a tuple/list of jax arrays (return other values through a closure or a static "
                "argument)."
            )
        try:
            to_torch(o.dtype)
        except TypeError:
            raise TypeError(f"call_jax: output {i} of {name} has dtype {o.dtype}, which torch cannot hold.") from None
    _SINGLE[key] = single
    return outs


def _input_structs(args) -> list:
    structs = []
    for i, a in enumerate(args):
        try:
            jd = to_jax(a.dtype)
        except TypeError:
            raise TypeError(f"call_jax: input {i} has dtype {a.dtype}, which JAX cannot hold.") from None
        if not all(type(n) is int for n in a.shape):
            raise TypeError(
                f"call_jax: input {i} has a symbolic shape {tuple(a.shape)}; a JAX function needs static shapes "
                "(use torch.compile(..., dynamic=False))."
            )
        structs.append(jax.ShapeDtypeStruct(tuple(a.shape), jd))
    return structs


@functools.lru_cache(maxsize=1024)
def _shapes(key: int, structs: tuple) -> tuple:
    """((shape, dtype), ...) of the outputs of ``key`` on inputs shaped ``structs``."""
    with rt.x64_scope(), _explained(key, structs), _types_for(key, structs):
        out = jax.eval_shape(entry(key).function(), *[jax.ShapeDtypeStruct(s, d) for s, d in structs])
    return tuple((tuple(o.shape), to_torch(o.dtype)) for o in _check_outputs(key, out))


_64_BIT = frozenset(map(np.dtype, ("int64", "uint64", "float64", "complex128")))


def _types_for(key: int, structs) -> contextlib.AbstractContextManager:
    """The 64-bit setting to trace the function of ``key`` under (inside shardtensor's x64 scope):
    off for a function that holds a Pallas kernel and has no 64-bit input, as in the user's plain
    JAX, since Mosaic (the TPU's kernel compiler) takes only 32-bit index maps and loop counters;
    else on, so that int64 and float64 stay 64-bit."""
    structs = tuple((tuple(s), np.dtype(d)) for s, d in structs)
    return rt.x64_off_scope() if _holds_pallas_kernel(key, structs) else contextlib.nullcontext()


@functools.lru_cache(maxsize=1024)
def _holds_pallas_kernel(key: int, structs: tuple) -> bool:
    if any(d in _64_BIT for _, d in structs):
        return False
    with rt.x64_scope(), _explained(key, structs):
        jaxpr = jax.make_jaxpr(entry(key).function())(*[jax.ShapeDtypeStruct(s, d) for s, d in structs])
    return _has_pallas_call(jaxpr.jaxpr)


def _has_pallas_call(jaxpr) -> bool:
    """Whether ``jaxpr`` or a jaxpr nested in its equations' parameters runs a ``pallas_call``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            return True
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr, or a Jaxpr
                if hasattr(inner, "eqns") and _has_pallas_call(inner):
                    return True
    return False


@contextlib.contextmanager
def _explained(key: int, structs):
    """JAX's error while tracing the function of ``key``, as a ValueError naming the function and inputs."""
    try:
        yield
    except Exception as e:
        inputs = ", ".join(f"{np.dtype(d).name}{list(s)}" for s, d in structs)
        raise ValueError(f"call_jax: JAX could not run {entry(key).name} on inputs ({inputs}): {e}") from e


@functools.cache
def _cpu_function(key: int):
    return jax.jit(entry(key).function())


# --------------------------------------------------------------------------- the op


@torch.library.custom_op("shardtensor::call_jax", mutates_args=())
def call_jax(args: list[torch.Tensor], fn_key: int) -> list[torch.Tensor]:
    """The JAX function registered under ``fn_key`` on ``args`` (CPU tensors: run by JAX on its CPU)."""
    _input_structs(args)  # a clear error for a dtype JAX cannot hold
    inputs = [torch_to_numpy(a) for a in args]
    structs = [(a.shape, a.dtype) for a in inputs]
    with rt.x64_scope():
        with _explained(fn_key, structs), _types_for(fn_key, structs):
            fn = _cpu_function(fn_key)
            if isinstance(entry(fn_key), JaxCall) and entry(fn_key).mesh is not None:
                out = fn(*inputs)  # a shard_map'd function runs on its mesh's devices
            else:
                with jax.default_device(jax.devices("cpu")[0]):
                    out = fn(*inputs)
        outs = _check_outputs(fn_key, out)
    return [numpy_to_torch(np.asarray(o)) for o in outs]


@call_jax.register_fake
def _call_jax_fake(args, fn_key):
    structs = tuple((tuple(s.shape), s.dtype) for s in _input_structs(args))
    return [args[0].new_empty(shape, dtype=dtype) for shape, dtype in _shapes(fn_key, structs)] if args else []


@register(torch.ops.shardtensor.call_jax.default)
def _call_jax_lowering(args, fn_key):
    with _types_for(fn_key, tuple((a.shape, a.dtype) for a in args)):
        return list(_check_outputs(fn_key, entry(fn_key).function()(*args)))


# --------------------------------------------------------------------------- gradients


def _differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _setup(ctx, inputs, output):
    args, key = inputs
    ctx.key = key
    ctx.in_dtypes = [a.dtype for a in args]
    ctx.out_dtypes = [o.dtype for o in output]
    ctx.save_for_backward(*args)


def _backward(ctx, grads):
    args = list(ctx.saved_tensors)
    diff_in = tuple(_differentiable(d) for d in ctx.in_dtypes)
    diff_out = tuple(_differentiable(d) and g is not None for d, g in zip(ctx.out_dtypes, grads))
    if not any(diff_in) or not any(diff_out):
        return [None] * len(args), None
    cts = [g for g, d in zip(grads, diff_out) if d]
    key = key_for(_VjpCall(ctx.key, diff_in, diff_out))
    got = iter(torch.ops.shardtensor.call_jax(args + cts, key))
    return [next(got) if d else None for d in diff_in], None


call_jax.register_autograd(_backward, setup_context=_setup)
