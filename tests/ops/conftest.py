"""The test modules here import their harnesses by name (``_lowering_harness``, ``opinfo_harness``): put
this directory on sys.path. Last, not first: tests/ is a package root before it, so tests/test_random.py
still imports as ``test_random`` and not as this directory's test_random.py (see __init__.py).

The lowering tests (modules using ``_lowering_harness``) call lowerings on jax values directly, as
the engine does inside its 64-bit scope: each of their tests runs under ``jax.enable_x64(True)``, in
its own thread only. The others (the OpInfo sweep) run with the process's setting, JAX's default,
so they check that shardtensor's own entries keep int64 / float64 exact."""

import os
import sys

import jax
import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)


def _uses_lowering_harness(module) -> bool:
    names = ("_lowering_harness",)
    return any(
        getattr(v, "__module__", None) in names or getattr(v, "__name__", None) in names for v in vars(module).values()
    )


@pytest.fixture(autouse=True)
def _x64_for_lowering_tests(request):
    if not _uses_lowering_harness(request.module):
        yield
        return
    with jax.enable_x64(True):
        yield
