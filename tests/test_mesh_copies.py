"""Replicated tensors living on another mesh than the program's (shardtensor/graph/mesh_moves.py):
parameters moved with ``model.to(st.device())`` before any global mesh exists land on the 1-D mesh of
all devices; the batch is sharded over the user's mesh. The first call copies them onto that mesh
(``ReplicateToGraphMesh``) and keeps the copies, so later calls (lazy and ``st.compile``) copy
nothing; a copy that cannot be kept warns once (``MeshCopyWarning``). Results equal eager torch's.
"""

import warnings

import pytest
import torch

import shardtensor as st
from shardtensor.graph import mesh_moves

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _copies():
    return st.counter_value("ReplicateToGraphMesh") or 0


@pytest.fixture
def model_and_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(8, 16)
    with torch.no_grad():
        ref = model(x)
    assert st.get_global_mesh() is None  # the parameters land on the default mesh
    dev_model = model.to(st.device())
    st.sync()
    return dev_model, x, ref


@pytest.fixture
def unwarned(monkeypatch):
    monkeypatch.setattr(mesh_moves, "_warned", False)


def test_parameters_move_once_lazy_and_compiled(model_and_batch, unwarned):
    model, x, ref = model_and_batch
    mesh = st.Mesh(range(8), (8,), ("data",))  # another jax mesh than the default one
    batch = st.shard(x, mesh, ("data", None))
    with warnings.catch_warnings():
        warnings.simplefilter("error", st.MeshCopyWarning)
        with torch.no_grad():
            before = _copies()
            torch.testing.assert_close(model(batch).cpu(), ref, **TOL)
            assert _copies() - before == 4  # two weights, two biases: once
            for _ in range(2):
                before = _copies()
                torch.testing.assert_close(model(batch).cpu(), ref, **TOL)
                assert _copies() == before
            compiled = st.compile(lambda b: model(b))
            before = _copies()
            for _ in range(3):  # trace, trace again, then replays of the frozen program
                torch.testing.assert_close(compiled(batch).cpu(), ref, **TOL)
            assert _copies() == before
    # a training step updates the kept copies in place, on the batch's mesh
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        before = _copies()
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
        st.sync()
        assert _copies() == before


def test_a_copy_on_every_call_warns_once(model_and_batch, unwarned):
    model, x, ref = model_and_batch
    other = st.Mesh(range(8), (8,), ("model",))
    for p in model.parameters():  # the user's replicated sharding on a mesh the batch does not use
        st.mark_sharding(p, other, (None,) * p.dim())
    mesh = st.Mesh(range(8), (8,), ("data",))
    batch = st.shard(x, mesh, ("data", None))
    with torch.no_grad():
        torch.testing.assert_close(model(batch).cpu(), ref, **TOL)  # the first call copies quietly
        before = _copies()
        with pytest.warns(st.MeshCopyWarning, match=r"replicated tensor of shape.*again.*st.set_global_mesh"):
            torch.testing.assert_close(model(batch).cpu(), ref, **TOL)
        assert _copies() - before == 4  # not kept: the cells name their own mesh
        with warnings.catch_warnings():
            warnings.simplefilter("error", st.MeshCopyWarning)  # once per process
            torch.testing.assert_close(model(batch).cpu(), ref, **TOL)
