"""Issue 18, second bullet: a small tensor made on the host inside an ``st.compile``d step
(``torch.tensor(data, device=st.device())``) does not stop the step from freezing when its value is
the same each call, never replays a stale value when it changes, and ``SHARDTENSOR_DEBUG=1`` names the
line where consecutive traces differ."""

import torch
from torch.testing import assert_close

import shardtensor as st
from _training_helpers import reset_state
from shardtensor import metrics


def setup_function():
    reset_state()


def teardown_function():
    reset_state()


def _count(name):
    return metrics.counter_value(name) or 0


def test_a_host_constant_freezes_and_matches_eager():
    def step(x):
        weights = torch.tensor([1.0, 2.0], device=x.device)
        return (x * weights).sum(0) + torch.tensor(0.5, device=x.device)

    compiled = st.compile(step)
    x_cpu = torch.arange(6.0).reshape(3, 2)
    x = x_cpu.to(st.device())
    replays = _count("CompileReplay")
    for _ in range(4):
        assert_close(compiled(x).cpu(), step(x_cpu))
    assert _count("CompileReplay") - replays == 2  # traced twice, then frozen


def test_a_host_tensor_that_changes_is_never_replayed_stale():
    calls = [0]

    def step(x):
        calls[0] += 1
        offset = torch.tensor([float(calls[0]), 0.0], device=x.device)
        return x + offset

    compiled = st.compile(step)
    x = torch.zeros(3, 2)
    for n in range(1, 6):
        assert_close(compiled(x.to(st.device())).cpu(), x + torch.tensor([float(n), 0.0]))
    assert calls[0] == 5  # the Python ran on every call


def test_debug_names_the_line_where_traces_differ(monkeypatch, capsys):
    monkeypatch.setenv("SHARDTENSOR_DEBUG", "1")
    calls = [0]

    def step(x):
        calls[0] += 1
        y = x * 2
        return y + torch.tensor([float(calls[0])], device=x.device)  # DIFFERS

    compiled = st.compile(step)
    x = torch.ones(4).to(st.device())
    capsys.readouterr()
    for _ in range(3):
        compiled(x)
    err = capsys.readouterr().err
    import inspect

    line = next(i for i, text in enumerate(inspect.getsource(step).splitlines()) if "# DIFFERS" in text)
    lineno = step.__code__.co_firstlineno + line
    assert f"test_compile_host_constants.py:{lineno}" in err, err
