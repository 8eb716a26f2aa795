"""Issue 35: a loop that never reads its results queues at most ``max_in_flight()`` programs.

XLA:CPU queues at most 32 programs per device; past that, a frozen ``st.compile`` training step
over 8 devices (Linear 512x512, capturable Adam, 300 calls, nothing read) died with "Termination
timeout for all reduce". Every path that runs a program (frozen replays, lazy syncs, eager ops) now
waits for the oldest run before it would exceed the bound. The tests count the engine's runs in
flight (never a time) and compare the trained parameters with eager torch. The issue's loop itself
(about 30 s here) is ``bench/in_flight_loop.py``.
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import shardtensor as st
from _training_helpers import mesh_8, reset_state
from shardtensor.graph import inflight

BOUND = 3  # small, so that a few calls show it; the process's real bound is max_in_flight()


@pytest.fixture
def small_bound(monkeypatch):
    reset_state()
    monkeypatch.setattr(inflight, "_bound", BOUND)
    yield
    reset_state()


def _model_and_batch():
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    x, y = torch.randn(16, 6), torch.randn(16, 4)
    return model, x, y


def _train_eager(model, x, y, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def test_cpu_bound_stays_under_xla_cpu_queue():
    assert st.runtime.platform() == "cpu"
    assert inflight.max_in_flight() == inflight.MAX_IN_FLIGHT_CPU < 32


def test_frozen_replays_that_read_nothing_stay_bounded(small_bound):
    model, x, y = _model_and_batch()
    ref = _train_eager(copy.deepcopy(model), x, y, steps=20)
    dev = copy.deepcopy(model).to(st.device())
    opt = torch.optim.SGD(dev.parameters(), lr=0.05, momentum=0.9)
    xs, ys = st.shard(x, mesh_8(), ("d", None)), st.shard(y, mesh_8(), ("d", None))  # gradients all-reduce

    @st.compile
    def step():
        loss = (dev(xs) - ys).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    replays = st.counter_value("CompileReplay") or 0
    counts = []
    for _ in range(20):
        step()
        counts.append(inflight.in_flight())
    assert (st.counter_value("CompileReplay") or 0) - replays >= 15  # the frozen path ran
    assert max(counts) <= BOUND, counts  # (before: one more run noted per replay, never waited for)
    assert_close(dev.weight.cpu(), ref.weight, rtol=1e-5, atol=1e-6)
    assert_close(dev.bias.cpu(), ref.bias, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_lazy_and_eager_loops_that_read_nothing_stay_bounded(small_bound, mode):
    model, x, y = _model_and_batch()
    ref = _train_eager(copy.deepcopy(model), x, y, steps=8)
    dev = copy.deepcopy(model).to(st.device())
    opt = torch.optim.SGD(dev.parameters(), lr=0.05, momentum=0.9)
    xs, ys = st.shard(x, mesh_8(), ("d", None)), st.shard(y, mesh_8(), ("d", None))
    counts = []
    st.eager_mode(mode == "eager")
    try:
        for _ in range(8):
            (dev(xs) - ys).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            st.step()
            counts.append(inflight.in_flight())
    finally:
        st.eager_mode(False)
    assert max(counts) <= BOUND, counts
    assert_close(dev.weight.cpu(), ref.weight, rtol=1e-5, atol=1e-6)
    assert_close(dev.bias.cpu(), ref.bias, rtol=1e-5, atol=1e-6)
