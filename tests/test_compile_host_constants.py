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


def test_debug_names_what_a_step_changes(monkeypatch, capsys):
    """A step that changes what it can read (its own counter) never freezes, and SHARDTENSOR_DEBUG
    says which object and how."""
    monkeypatch.setenv("SHARDTENSOR_DEBUG", "1")
    calls = [0]

    def step(x):
        calls[0] += 1
        y = x * 2
        return y + torch.tensor([float(calls[0])], device=x.device)

    compiled = st.compile(step)
    x = torch.ones(4).to(st.device())
    capsys.readouterr()
    for n in range(1, 4):
        assert_close(compiled(x).cpu(), torch.full((4,), 2.0 + n))
    err = capsys.readouterr().err
    reports = [ln for ln in err.splitlines() if "re-running Python each call" in ln]
    assert len(reports) == 2, err  # calls 2 and 3 (the first has nothing to compare with)
    assert "step<closure calls>" in reports[-1] and "changed during the call" in reports[-1], err


def test_debug_names_a_changed_global(monkeypatch, capsys):
    """A frozen step whose global changed runs its Python again, and says which."""
    monkeypatch.setenv("SHARDTENSOR_DEBUG", "1")
    monkeypatch.setitem(globals(), "FACTOR", 1.0)

    def step(x):
        return x * FACTOR  # noqa: F821  (a global the test sets)

    compiled = st.compile(step)
    x = torch.ones(5).to(st.device())
    for _ in range(3):
        compiled(x)
    capsys.readouterr()
    monkeypatch.setitem(globals(), "FACTOR", 2.0)
    assert_close(compiled(x).cpu(), torch.full((5,), 2.0))
    err = capsys.readouterr().err
    assert "runs its Python again" in err and "FACTOR" in err, err
