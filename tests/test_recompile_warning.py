"""Issue 12 §2: a call site that keeps compiling graphs of one structure is logged at WARNING under
the ``shardtensor`` logger from its third compile on, with the count and what changed (always on,
not only with SHARDTENSOR_DEBUG); a stable loop says nothing; the logger's level silences it.

Shapes are unusual (x 91..) so that no earlier test has compiled these graphs."""

import logging
import re

import pytest
import torch

import shardtensor as st
from _training_helpers import MLP, assert_trained_alike, mesh_4x2, mlp_batches, reset_state, run_both


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("SHARDTENSOR_DEBUG", raising=False)
    reset_state()
    yield
    reset_state()


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "shardtensor" and r.levelno == logging.WARNING]


def _changing_batches(width, rows=range(9, 14)):
    """Batches whose row count changes every step, and weights: one new shape per step."""
    g = torch.Generator().manual_seed(width)
    return [torch.randn(n, width, generator=g) for n in rows], torch.randn(width, 3, generator=g)


def test_a_loop_with_changing_batch_shapes_warns_from_its_third_compile(caplog):
    batches, w = _changing_batches(91)
    mesh = mesh_4x2()
    dev_w = st.shard(w, mesh, (None, None))
    with caplog.at_level(logging.WARNING, logger="shardtensor"):
        for x in batches:
            got = (st.shard(x, mesh, (None, "model")) @ dev_w).relu().sum().item()  # the call site
            torch.testing.assert_close(got, (x @ w).relu().sum().item(), rtol=1e-5, atol=1e-5)
    said = _warnings(caplog)
    assert len(said) == 3, said  # compiles 3, 4 and 5 of the same structure at that line
    line = re.escape("test_recompile_warning.py:") + r"\d+"
    assert re.match(line + r" compiled a graph of the same structure for the 3rd time \(\d+ ops\)", said[0])
    assert "changed shape (10, 91) -> (11, 91)" in said[0]
    assert "for the 5th time" in said[2] and "changed shape (12, 91) -> (13, 91)" in said[2]
    assert "pad the last batch" in said[0]


def test_a_compiled_function_names_the_argument_that_changed(caplog):
    @st.compile
    def scale(t):
        return t * 5 - 1

    mesh = mesh_4x2()
    with caplog.at_level(logging.WARNING, logger="shardtensor"):
        for n in (93, 94, 95):
            x = torch.randn(8, n)
            torch.testing.assert_close(scale(st.shard(x, mesh, ("data", None))).cpu(), x * 5 - 1)
    (said,) = _warnings(caplog)
    assert "for the 3rd time" in said
    assert "input 0 (argument 0 of scale; (8, 95) float32" in said and "(8, 94) -> (8, 95)" in said


@pytest.mark.parametrize("mode", ["lazy", "compile"])
def test_a_stable_training_loop_never_warns(caplog, mode):
    batches = mlp_batches(5, torch.Generator().manual_seed(97), batch=16)
    specs = {"fc1.weight": ("model", None), "fc2.weight": (None, "model")}
    with caplog.at_level(logging.INFO, logger="shardtensor"):
        ref, dev, ref_losses, dev_losses, _, _ = run_both(
            lambda: MLP(d_in=16), specs, mesh_4x2(), batches, lambda p: torch.optim.Adam(p, lr=1e-2), mode
        )
    assert_trained_alike(ref, dev, ref_losses, dev_losses)
    assert _warnings(caplog) == []


def test_the_logger_level_silences_it(caplog):
    batches, w = _changing_batches(99)
    mesh = mesh_4x2()
    logger = logging.getLogger("shardtensor")
    level = logger.level
    logger.setLevel(logging.ERROR)  # what a user does to silence shardtensor's warnings
    try:
        for x in batches:
            got = (st.shard(x, mesh, (None, "model")) @ st.shard(w, mesh, (None, None))).sum().item()
            torch.testing.assert_close(got, (x @ w).sum().item(), rtol=1e-5, atol=1e-5)
    finally:
        logger.setLevel(level)
    assert _warnings(caplog) == []
