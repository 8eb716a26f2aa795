"""Shared helpers for the lowering tests of matmul/shape/indexing/nn: import the lowering modules
(even while the rest of the package is not importable yet) and compare a lowering with eager torch.

Example::

    from lowering_testkit import aten, check
    check(aten.mm.default, torch.randn(2, 3), torch.randn(3, 4))
"""
from __future__ import annotations

import importlib
import sys
import types

import jax
import numpy as np
import pytest
import torch

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

aten = torch.ops.aten
JIT = __import__("os").environ.get("LOWERING_JIT", "1") == "1"
ROOT = "/work/main/shardtensor"


def _import_ops():
    try:
        import shardtensor.ops  # noqa: F401  (the real package, once it imports)
    except Exception:  # other modules not written yet: import ours through stub packages
        for name in [m for m in sys.modules if m == "shardtensor" or m.startswith("shardtensor.")]:
            del sys.modules[name]
        pkg = types.ModuleType("shardtensor")
        pkg.__path__ = [ROOT]
        ops = types.ModuleType("shardtensor.ops")
        ops.__path__ = [ROOT + "/ops"]
        sys.modules["shardtensor"], sys.modules["shardtensor.ops"] = pkg, ops
        pkg.ops = ops
    for mod in ("matmul", "shape", "indexing", "nn"):
        importlib.import_module(f"shardtensor.ops.{mod}")
    return importlib.import_module("shardtensor.ops.registry"), importlib.import_module("shardtensor.dtypes")


registry, dtypes = _import_ops()


def lower(op):
    entry = registry.lookup(op)
    assert entry is not None, f"no lowering registered for {op}"
    return entry.fn


def to_jax(x):
    """torch tensor -> jax array with the exact dtype; other values unchanged (lists recursively)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().resolve_conj().resolve_neg()
        if x.dtype == torch.bfloat16:  # numpy-side conversion: no jax op to compile
            return jnp.asarray(x.float().numpy().astype(jnp.bfloat16))
        return jnp.asarray(x.numpy().copy())  # jax on CPU may alias the numpy buffer: snapshot it
    if isinstance(x, (list, tuple)):
        return type(x)(to_jax(v) for v in x)
    return x


def to_torch(x):
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return [to_torch(v) for v in x]
    x = np.array(x)
    dt = dtypes.to_torch(x.dtype)
    if dt == torch.bfloat16:
        return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(x)


def _scalar_args(op, args, kwargs):
    """Python numbers in Scalar positions become 0-d weakly-typed jax values, as the dispatcher passes them."""
    schema = op._schema
    args = list(args)
    for i, a in enumerate(schema.arguments):
        if str(a.type) != "Scalar":
            continue
        if a.kwarg_only:
            if a.name in kwargs and isinstance(kwargs[a.name], (int, float, bool)):
                kwargs[a.name] = jnp.asarray(kwargs[a.name])
        elif i < len(args) and isinstance(args[i], (int, float, bool)):
            args[i] = jnp.asarray(args[i])
    return args, kwargs


def assert_same(got, want, rtol=None, atol=None, equal_nan=True):
    """Compare a lowering result (jax, possibly nested) with a torch result, dtypes exactly."""
    if want is None or (isinstance(want, torch.Tensor) and got is None):
        assert got is None, f"expected None, got {got}"
        return
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{len(got)} outputs vs {len(want)}"
        for g, w in zip(got, want):
            assert_same(g, w, rtol, atol, equal_nan)
        return
    if not isinstance(want, torch.Tensor):
        assert got == want
        return
    g = to_torch(got)
    assert g.dtype == want.dtype, f"dtype {g.dtype} != torch {want.dtype}"
    assert tuple(g.shape) == tuple(want.shape), f"shape {tuple(g.shape)} != torch {tuple(want.shape)}"
    kw = {} if rtol is None else {"rtol": rtol, "atol": atol}
    torch.testing.assert_close(g, want.detach().resolve_conj(), equal_nan=equal_nan, **kw)


def _jit_many(calls):
    """[fn(*args, **kwargs) for fn, args, kwargs in calls] inside one jax.jit: jax arrays are the
    inputs (so lowerings must work on tracers), every other argument is static, as in a compiled graph."""
    leaves, treedef = jax.tree_util.tree_flatten([(list(a), k) for _, a, k in calls], is_leaf=lambda v: v is None)
    pos = [i for i, v in enumerate(leaves) if isinstance(v, jax.Array)]

    def inner(*arrays):
        filled = list(leaves)
        for i, a in zip(pos, arrays):
            filled[i] = a
        outs = []
        for (fn, _, _), (a, k) in zip(calls, jax.tree_util.tree_unflatten(treedef, filled)):
            try:
                outs.append(fn(*a, **k))
            except Exception as e:
                e.add_note(f"while lowering {getattr(fn, '_op', fn)}")
                raise
        return outs

    args = [leaves[i] for i in pos]
    return jax.jit(inner).lower(*args).compile(_FAST_COMPILE)(*args)


# the tests check lowering semantics, not XLA's optimizer: compile cheaply (~2x faster)
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def call(fn, args, kwargs, jit=True):
    """fn(*args, **kwargs), under jax.jit if ``jit``."""
    return _jit_many([(fn, args, kwargs)])[0] if jit else fn(*args, **kwargs)


# Checks made inside a test are compared when the test ends, all lowerings compiled as one jit
# (one XLA compilation per test instead of one per check: the tests stay fast).
_pending = None


@pytest.fixture(autouse=True)
def batch_checks():
    """Autouse fixture (import it into a test module): defer that module's checks to the test's end."""
    global _pending
    _pending = []
    try:
        yield
        flush()
    finally:
        _pending = None


def flush():
    """Run and compare every deferred check now."""
    global _pending
    pending, _pending = _pending or [], []
    if not pending:
        return
    outs = _jit_many([(fn, a, k) for fn, a, k, *_ in pending])
    for (fn, _, _, want, rtol, atol, op), got in zip(pending, outs):
        try:
            assert_same(got, want, rtol, atol)
        except AssertionError as e:
            raise AssertionError(f"{op}: {e}") from None


def check(op, *args, rtol=None, atol=None, scalars=True, jit=JIT, **kwargs):
    """Run ``op`` in torch and its lowering on the same inputs and compare (at the end of the test when
    checks are batched); returns the torch result."""
    want = op(*args, **kwargs)
    jargs, jkw = to_jax(list(args)), {k: to_jax(v) for k, v in kwargs.items()}
    if scalars:
        jargs, jkw = _scalar_args(op, jargs, jkw)
    fn = lower(op)
    if jit and _pending is not None:
        _pending.append((fn, jargs, jkw, want, rtol, atol, op))
        return want
    try:
        got = call(fn, jargs, jkw, jit)
        assert_same(got, want, rtol, atol)
    except AssertionError as e:
        raise AssertionError(f"{op}: {e}") from None
    return want
