"""Shared helpers for the ShardedTensor tests (test_tensor, test_views, test_properties) and the
OpInfo and nn-module sweeps (RandomProbe)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import shardtensor as st
from shardtensor.graph import state

MESHES = {
    "8": st.Mesh(range(8), (8,), ("x",)),
    "4x2": st.Mesh(range(8), (4, 2), ("x", "y")),
    "2x2x2": st.Mesh(range(8), (2, 2, 2), ("x", "y", "z")),
    "1x8": st.Mesh(range(8), (1, 8), ("x", "y")),
}
MESH_42 = MESHES["4x2"]

# A 2-d spec per mesh that shards both dimensions where the mesh allows it.
SPECS_2D = {
    "8": ("x", None),
    "4x2": ("x", "y"),
    "2x2x2": (("x", "z"), "y"),
    "1x8": ("x", "y"),
}


def modes():
    """Parametrize over lazy (default) and eager execution."""
    return pytest.mark.parametrize("eager", [False, True], ids=["lazy", "eager"])


@contextlib.contextmanager
def mode(eager: bool):
    with st.eager_mode(eager):
        yield


def isolate_lazy_graph():
    """Run after each test: a graph that failed in one test must not fail the next ones.

    (Whether one failing graph poisons later, unrelated reads is itself tested in test_tensor.py.)
    """
    try:
        st.sync()
    except Exception:
        state.forget_pending()


def check_cover(x, t):
    """The unpadded local shards of ``x`` cover ``t`` exactly once per replica."""
    shards = x.local_shards
    assert sorted(s.device for s in shards) == sorted(f"CPU:{i}" for i in range(8))
    replicas = sorted({s.replica_id for s in shards})
    assert replicas == list(range(len(replicas)))
    padded_shapes = {tuple(s.data.shape) for s in shards}
    assert len(padded_shapes) == 1, f"shards of one tensor differ in padded shape: {padded_shapes}"
    for r in replicas:
        count = torch.zeros(t.shape, dtype=torch.int64)
        for s in shards:
            if s.replica_id != r:
                continue
            assert s.data.dtype == t.dtype
            index = s.indices
            if index is Ellipsis:
                assert tuple(s.unpadded_data.shape) == tuple(t.shape)
                torch.testing.assert_close(s.unpadded_data, t, rtol=0, atol=0, equal_nan=True)
                count += 1
                continue
            assert len(index) == t.dim()
            assert all(sl.step in (None, 1) for sl in index)
            part = t[tuple(index)]
            assert tuple(s.unpadded_data.shape) == tuple(part.shape)
            for n, p in zip(s.unpadded_data.shape, s.data.shape):
                assert n <= p
            torch.testing.assert_close(s.unpadded_data, part, rtol=0, atol=0, equal_nan=True)
            count[tuple(index)] += 1
        assert bool((count == 1).all()), f"replica {r} does not cover the tensor exactly once:\n{count}"
    return shards


class RandomProbe(TorchDispatchMode):
    """Notes whether any aten op that draws from torch's generator runs (``probe.random``)."""

    def __init__(self):
        super().__init__()
        self.random = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            self.random = True
        return func(*args, **(kwargs or {}))
