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
import torch

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

aten = torch.ops.aten
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
        x = x.detach()
        if x.dtype == torch.bfloat16:
            return jnp.asarray(x.float().numpy()).astype(jnp.bfloat16)
        return jnp.asarray(x.numpy())
    if isinstance(x, (list, tuple)):
        return type(x)(to_jax(v) for v in x)
    return x


def to_torch(x):
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return [to_torch(v) for v in x]
    x = jnp.asarray(x)
    dt = dtypes.to_torch(x.dtype)
    if dt == torch.bfloat16:
        return torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.array(x))


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


def check(op, *args, rtol=None, atol=None, scalars=True, **kwargs):
    """Run ``op`` in torch and its lowering on the same inputs and compare; returns the torch result."""
    want = op(*args, **kwargs)
    jargs, jkw = to_jax(list(args)), {k: to_jax(v) for k, v in kwargs.items()}
    if scalars:
        jargs, jkw = _scalar_args(op, jargs, jkw)
    got = lower(op)(*jargs, **jkw)
    assert_same(got, want, rtol, atol)
    return want


def check_fn(lowering, torch_fn, *args, rtol=None, atol=None, **kwargs):
    """Compare an arbitrary torch callable with a lowering callable on the same (converted) inputs."""
    want = torch_fn(*args, **kwargs)
    got = lowering(*to_jax(list(args)), **{k: to_jax(v) for k, v in kwargs.items()})
    assert_same(got, want, rtol, atol)
    return want


def grads(fn, *inputs, grad_out=None, seed=0):
    """torch grads of fn(*inputs) w.r.t. the inputs that require grad, for a random grad_output."""
    out = fn(*inputs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    g = torch.Generator().manual_seed(seed)
    if grad_out is None:
        grad_out = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    torch.autograd.backward(outs, grad_out)
    return out, grad_out
