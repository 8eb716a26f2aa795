"""The lowering tests' harness (every ``tests/ops/test_*`` file but the OpInfo sweep): call a
lowering the way the dispatcher does and compare it with eager torch on CPU.

Lowerings get the dispatcher's calling convention: torch tensors become jax arrays, and numbers in
``Scalar`` / ``Tensor`` positions become weakly typed 0-d jax values (a Python number passed to a
jitted function); numbers in other positions (int, float, bool arguments) and everything else stay
Python values.

* ``Batch``: many checks compiled as one ``jax.jit`` (one XLA compile), compared at its end;
* ``check(op, *args, **kwargs)``: one check, returning torch's result; in a module that imports the
  ``deferred_checks`` fixture, the checks of a test are batched and compared when the test ends;
* ``call`` / ``call_random``: a lowering's jax result, eager or jitted; ``run``: any function on jax
  values, jitted with its arrays as inputs; ``assert_same``: a jax result against torch's.

Lowerings run with JAX's 64-bit types on, as inside shardtensor's engine: tests/ops/conftest.py turns
them on for each test of a module that uses this harness, in that test's thread only (never for the
whole process, which would hide a shardtensor entry that forgot its own 64-bit scope).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import shardtensor.ops  # noqa: F401  (registers every lowering)
from shardtensor import dtypes
from shardtensor.ops import registry

aten = torch.ops.aten
# tolerances shared by the lowering tests: float64 lowerings against torch's float64 kernels, and
# bfloat16 results (8 significant bits)
TIGHT = {"rtol": 1e-9, "atol": 1e-9}
BF16 = {"rtol": 2e-2, "atol": 2e-2}
EAGER = False  # Batch: True computes values op by op (slower here than one jit compile per batch)


def _jit_run(f, *args):
    # compiled with the suite's XLA settings (tests/conftest.py): cheap LLVM passes, XLA's older CPU
    # fusion emitter. Values checked to the last bit hold with either emitter (SHARDTENSOR_TEST_FULL_OPT=1
    # runs them with XLA's defaults): references that depend on fused multiply-adds are avoided.
    return jax.jit(f)(*args)


lookup = registry.lookup


def lower(op):
    """The lowering function registered for ``op``."""
    entry = lookup(op)
    assert entry is not None, f"no lowering registered for {op}"
    return entry.fn


# ----------------------------------------------------------------------------------------------
def to_jax(t):
    """A torch CPU tensor as a jax array of the exact same dtype (lists and tuples element by element;
    other values unchanged)."""
    if isinstance(t, (list, tuple)):
        return type(t)(to_jax(v) for v in t)
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach().resolve_conj().resolve_neg()
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.numpy().copy())  # a snapshot: jax on CPU may alias the numpy buffer


def to_torch(a) -> torch.Tensor:
    """A jax array as a torch CPU tensor of the exact same dtype."""
    a = np.asarray(a)
    dt = dtypes.to_torch(a.dtype)
    if dt == torch.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def _dynamic(value, type_str: str, static_scalars) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, numbers.Number) and not registry.bakes_scalar(static_scalars, value):
        return "number" in type_str or "Tensor" in type_str
    return False


def _split(op, args, kwargs):
    """Flatten the call into (leaves, rebuild): leaves are what the dispatcher makes jax values."""
    low = lookup(op)
    assert low is not None, f"no lowering registered for {op}"
    schema_args = op._schema.arguments
    positional = [a for a in schema_args if not a.kwarg_only]
    types_by_name = {a.name: str(a.type) for a in schema_args}
    leaves: list = []

    def conv(value, type_str):
        if isinstance(value, (list, tuple)):
            return type(value)(conv(v, type_str) for v in value)
        if _dynamic(value, type_str, low.static_scalars):
            leaves.append(to_jax(value) if isinstance(value, torch.Tensor) else value)
            return ("__leaf__", len(leaves) - 1)
        return value

    cargs = [conv(v, str(positional[i].type) if i < len(positional) else "") for i, v in enumerate(args)]
    ckwargs = {k: conv(v, types_by_name.get(k, "")) for k, v in kwargs.items()}

    def rebuild(vals):
        def r(x):
            if isinstance(x, tuple) and len(x) == 2 and x[0] == "__leaf__":
                return vals[x[1]]
            if isinstance(x, (list, tuple)):
                return type(x)(r(v) for v in x)
            return x

        return [r(a) for a in cargs], {k: r(v) for k, v in ckwargs.items()}

    return low, leaves, rebuild


def call(op, *args, jit=False, **kwargs):
    """Run the lowering of ``op`` on torch-style arguments; returns jax values.

    Eagerly by default (fast: jax caches each primitive), with Python scalars as weak 0-d arrays;
    the function is also traced with ``jax.make_jaxpr`` (scalars as weak tracers, as under the
    dispatcher's jit) and must give the same shapes and dtypes there. ``jit=True`` runs it jitted.
    """
    low, leaves, rebuild = _split(op, args, kwargs)
    assert not low.random, f"{op} is a random op: use call_random"

    def f(vals):
        a, k = rebuild(vals)
        return low.fn(*a, **k)

    if jit:
        return _jit_run(f, leaves)
    out = f([jnp.asarray(v) if isinstance(v, numbers.Number) else v for v in leaves])
    traced = jax.eval_shape(f, leaves)
    _same_avals(out, traced, op)
    return out


def _same_avals(out, traced, op):
    flat_out, tree_out = jax.tree_util.tree_flatten(out)
    flat_tr, tree_tr = jax.tree_util.tree_flatten(traced)
    assert tree_out == tree_tr, (op, tree_out, tree_tr)
    for o, t in zip(flat_out, flat_tr):
        assert (o.shape, o.dtype) == (t.shape, t.dtype), (op, o.shape, o.dtype, t.shape, t.dtype)


def call_random(op, key, *args, jit=True, **kwargs):
    """Run the random lowering of ``op`` with PRNG ``key``."""
    low, leaves, rebuild = _split(op, args, kwargs)
    assert low.random, f"{op} is not registered as random"

    def f(key, vals):
        a, k = rebuild(vals)
        return low.fn(key, *a, **k)

    return _jit_run(f, key, leaves) if jit else f(key, leaves)


def _to_torch_tree(x):
    if isinstance(x, (list, tuple)):
        return type(x)(_to_torch_tree(v) for v in x)
    if x is None or isinstance(x, numbers.Number):
        return x
    return to_torch(x)


def _compare(got, expected, atol, rtol, what):
    if expected is None:
        assert got is None, f"{what}: got {got}, torch gives None"
        return
    if isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(expected), (what, got, expected)
        for g, e in zip(got, expected):
            _compare(g, e, atol, rtol, what)
        return
    try:
        if isinstance(expected, torch.Tensor):
            expected = expected.detach().resolve_conj().resolve_neg()
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, equal_nan=True)
    except AssertionError as e:
        raise AssertionError(f"{what}:\n{e}\ngot      {got}\nexpected {expected}") from None


def _describe(op, args, kwargs):
    def short(v):
        if isinstance(v, torch.Tensor):
            return f"Tensor{tuple(v.shape)}:{str(v.dtype).replace('torch.', '')}"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(short(x) for x in v) + "]"
        return repr(v)

    parts = [short(a) for a in args] + [f"{k}={short(v)}" for k, v in kwargs.items()]
    return f"{op}({', '.join(parts)})"


class Batch:
    """Collects checks and runs every lowering in one ``jax.jit`` (one XLA compile for the lot, with
    the dispatcher's calling convention: scalars are weakly typed tracers), then compares each result
    with eager torch. Use as a context manager::

        with Batch() as b:
            b.check(aten.add.Tensor, x, 2.5)
            b.check(aten.mul.Tensor, x, y)
    """

    def __init__(self):
        self.items = []

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.run()
        return False

    def check(self, op, *args, atol=None, rtol=None, expected=None, compare=None, **kwargs):
        """Queue a comparison of ``op``'s lowering with ``op`` run by eager torch, or with ``expected``
        where torch's CPU kernel depends on the CPU's instruction sets and the test states the result
        against a reference that does not. ``compare(got, expected, what)``, if given, replaces the
        ``assert_close`` with ``atol`` / ``rtol``."""
        if expected is None:
            expected = op(*args, **kwargs)
        low, leaves, rebuild = _split(op, args, kwargs)
        assert not low.random, f"{op} is a random op"
        if compare is None:

            def compare(got, want, what):
                _compare(got, want, atol, rtol, what)

        self.items.append((low, leaves, rebuild, expected, compare, _describe(op, args, kwargs)))

    def check_or_skip(self, op, *args, atol=None, rtol=None, expected=None, **kwargs):
        """``check`` unless eager torch itself rejects the call (e.g. bool - bool)."""
        try:
            op(*args, **kwargs)
        except (RuntimeError, ZeroDivisionError, NotImplementedError):
            return
        self.check(op, *args, atol=atol, rtol=rtol, expected=expected, **kwargs)

    def run(self):
        items, self.items = self.items, []
        if not items:
            return

        def f(all_leaves):
            outs = []
            for (low, _, rebuild, _, _, what), vals in zip(items, all_leaves):
                a, k = rebuild(vals)
                try:
                    outs.append(low.fn(*a, **k))
                except Exception as e:
                    raise AssertionError(f"lowering failed for {what}: {type(e).__name__}: {e}") from e
            return outs

        leaves = [it[1] for it in items]
        if EAGER:
            # values op by op (each primitive compiles once per signature, cached across tests), plus
            # a trace with weak tracers (the dispatcher's calling convention) for shapes and dtypes
            traced = jax.eval_shape(f, leaves)
            with jax.disable_jit():
                outs = f([[jnp.asarray(v) if isinstance(v, numbers.Number) else v for v in lv] for lv in leaves])
            _same_avals(outs, traced, "batch")
        else:
            outs = _jit_run(f, leaves)
        for (_, _, _, expected, compare, what), out in zip(items, outs):
            compare(_to_torch_tree(out), expected, what)


_DEFERRED: list = []  # the Batch of the running test, in a module that uses ``deferred_checks``


@pytest.fixture(autouse=True)
def deferred_checks():
    """Import into a test module (it is autouse there): the module's ``check`` calls queue into one
    Batch per test, compiled and compared when the test ends."""
    _DEFERRED.append(Batch())
    try:
        yield
        _DEFERRED[-1].run()
    finally:
        _DEFERRED.pop()


def check(op, *args, atol=None, rtol=None, jit=True, **kwargs):
    """Compare the lowering of ``op`` with ``op`` run by eager torch on CPU; returns torch's result.
    ``jit=False`` runs the lowering eagerly (data-dependent output shapes)."""
    want = op(*args, **kwargs)
    if not jit:
        low, leaves, rebuild = _split(op, args, kwargs)
        a, k = rebuild([jnp.asarray(v) if isinstance(v, numbers.Number) else v for v in leaves])
        _compare(_to_torch_tree(low.fn(*a, **k)), want, atol, rtol, _describe(op, args, kwargs))
    elif _DEFERRED:
        _DEFERRED[-1].check(op, *args, atol=atol, rtol=rtol, expected=want, **kwargs)
    else:
        with Batch() as b:
            b.check(op, *args, atol=atol, rtol=rtol, expected=want, **kwargs)
    return want


def run(fn, args, kwargs=None, jit=True):
    """``fn(*args, **kwargs)`` on jax values; under ``jit`` the jax arrays among them are the program's
    inputs and everything else is static, as in a compiled graph."""
    kwargs = kwargs or {}
    if not jit:
        return fn(*args, **kwargs)
    leaves, treedef = jax.tree_util.tree_flatten((list(args), kwargs), is_leaf=lambda v: v is None)
    dynamic = [i for i, v in enumerate(leaves) if isinstance(v, jax.Array)]

    def inner(*arrays):
        filled = list(leaves)
        for i, a in zip(dynamic, arrays):
            filled[i] = a
        a, k = jax.tree_util.tree_unflatten(treedef, filled)
        return fn(*a, **k)

    return _jit_run(inner, *[leaves[i] for i in dynamic])


def assert_same(got, want, rtol=None, atol=None):
    """Compare a lowering's jax result (possibly nested) with torch's ``want``: dtypes and shapes
    exactly, values with ``assert_close``'s tolerances (or the given ones)."""
    _compare(_to_torch_tree(got), want, atol, rtol, "result")


def randn(*shape, dtype=torch.float32, seed=None):
    """``torch.randn(*shape)`` as ``dtype``, after seeding torch's generator with ``seed`` if given."""
    if seed is not None:
        torch.manual_seed(seed)
    return torch.randn(*shape).to(dtype)


def make(shape, dtype, *, low=-3, high=3, seed=0, nan=False):
    """A deterministic torch test tensor (ints in [low, high), floats uniform; optional NaNs)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(low, high, shape, generator=g).to(dtype)
    t = (torch.rand(shape, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype)
    if nan and t.numel() > 1:
        t.view(-1)[:: max(2, t.numel() // 3)] = float("nan")
    return t
