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
    replays = _count("CompileReplay")
    for n in range(1, 6):
        assert_close(compiled(x.to(st.device())).cpu(), x + torch.tensor([float(n), 0.0]))
    assert calls[0] == 5 and _count("CompileReplay") == replays  # the Python ran on every call


def test_a_large_host_tensor_is_a_new_input_each_call():
    # too large to compare by value: never frozen, even when a freed array's id is reused
    calls = [0]

    def step(x):
        calls[0] += 1
        return x + torch.full((300_000,), float(calls[0])).to(x.device)

    compiled = st.compile(step)
    x = torch.zeros(300_000)
    for n in range(1, 4):
        assert_close(compiled(x.to(st.device())).cpu(), x + n)
    assert calls[0] == 3


def test_debug_names_the_line_where_traces_differ(monkeypatch, capsys):
    monkeypatch.setenv("SHARDTENSOR_DEBUG", "1")
    calls = [0]

    def step(x):
        calls[0] += 1
        y = x * 2
        return y + torch.tensor([float(calls[0])], device=x.device)

    compiled = st.compile(step)
    x = torch.ones(4).to(st.device())
    capsys.readouterr()
    for _ in range(3):
        compiled(x)
    err = capsys.readouterr().err
    lineno = step.__code__.co_firstlineno + 3  # the torch.tensor line
    reports = [ln for ln in err.splitlines() if "not frozen" in ln]
    assert len(reports) == 2, err  # calls 2 and 3 each differ from the one before
    report = reports[-1]
    assert f"at test_compile_host_constants.py:{lineno}, op" in report, err
    assert "made on the host during the call" in report and "its value changed" in report


def test_debug_names_a_changed_python_number(monkeypatch, capsys):
    monkeypatch.setenv("SHARDTENSOR_DEBUG", "1")
    calls = [0]

    def step(x):
        calls[0] += 1
        return x * float(calls[0])

    compiled = st.compile(step)
    x = torch.ones(5).to(st.device())
    capsys.readouterr()
    compiled(x)
    compiled(x)
    err = capsys.readouterr().err
    lineno = step.__code__.co_firstlineno + 2
    assert f"test_compile_host_constants.py:{lineno}, op 0 (aten.mul.Tensor): Python number 1.0 -> 2.0" in err, err
