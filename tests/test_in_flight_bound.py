"""Issue 35: a loop that never reads its results queues at most ``max_in_flight()`` programs.

XLA:CPU queues at most 32 programs per device; past that, a frozen ``st.compile`` training step
over 8 devices (Linear 512x512, capturable Adam, 300 calls, nothing read) died with "Termination
timeout for all reduce". Every path that runs a program (frozen replays, lazy syncs, eager ops) now
waits for the oldest run before it would exceed the bound. The tests count the engine's runs in
flight (never a time) and compare the trained parameters with eager torch. The issue's loop itself
(about 30 s here) is ``bench/in_flight_loop.py``.
"""

import copy
import json
import os
import pathlib
import subprocess
import sys
import types

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


class _Result:
    """A program's result as ``inflight`` sees it: consumed (donated to a later program), or computing
    until it has been asked ``polls`` times whether it is ready."""

    def __init__(self, consumed: bool = False, polls: int = 10**9):
        self.consumed, self.polls, self.asked = consumed, polls, 0

    def is_deleted(self):
        return self.consumed

    def is_ready(self):
        self.asked += 1
        return self.asked > self.polls

    def block_until_ready(self):
        return self

    @property
    def addressable_shards(self):
        return [types.SimpleNamespace(data=self)]


@pytest.fixture
def fake_runs(small_bound):
    """Note runs whose results are ``_Result``s; forgotten afterwards (a real run would wait for them)."""

    def note(*results):
        for i, result in enumerate(results):
            inflight.note(f"program {i}", [], [result], [result], False)

    yield note
    inflight.forget()


def test_a_run_whose_results_a_later_run_consumed_counts_until_that_one_finished(fake_runs, monkeypatch):
    """A step that returns nothing donates everything it computed to the next one: it cannot be looked
    at. Before, it counted as finished (the bound then never held: issue 48 §4's abort); now the
    later run that consumed its results answers for it."""
    monkeypatch.setattr(inflight, "_bound", 16)
    later = _Result()
    fake_runs(_Result(consumed=True), later)
    inflight.settle()
    assert inflight.in_flight() == 2  # (the later run is still computing: both are in flight)
    later.polls = 0
    inflight.settle()
    assert inflight.in_flight() == 0


def test_a_crowded_run_whose_results_were_consumed_waits_for_the_run_that_consumed_them(fake_runs, monkeypatch):
    monkeypatch.setattr(inflight, "_bound", 2)
    later = _Result(polls=3)
    fake_runs(_Result(consumed=True), later)
    inflight.settle()  # (one more would make three: the oldest is waited for, by the run after it)
    assert later.asked > later.polls  # waited until it finished
    assert inflight.in_flight() == 0


def test_loops_that_read_nothing_run_to_the_end():
    """Issue 48 §4: a frozen step returning nothing (Linear 512x512, Adam, batch over 8 devices) in a
    loop that reads nothing died with SIGABRT (XLA:CPU "Termination timeout for all reduce") in 5 of
    5 runs; returning the loss avoided it. Lazy steps and eager ops that return nothing too. In a
    subprocess: an abort must not take the test process with it."""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    worker = pathlib.Path(__file__).with_name("_interrupt_worker.py")
    result = subprocess.run(
        [sys.executable, str(worker), "no_read_loops", "80"], env=env, capture_output=True, text=True, timeout=400
    )
    assert result.returncode == 0, f"the loop ended with {result.returncode}: {result.stderr[-3000:]}"
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["differs"] == [] and "problems" not in report, report
    assert max(report["most"].values()) <= report["bound"], report
