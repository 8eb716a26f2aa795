"""Nothing lost: Ctrl-C at any point of a training step, programs that cannot fit, waits that end.

The interrupt loop and the failed-execution scenarios (the memory refusals, and a program that
runs out of memory on some devices while it runs, with parameter aliasing on and off) are
``bench/reliability.py``, run here in one subprocess with fewer interrupts (signals and
address-space limits must not touch the test process). The rest checks the pieces in this process:
the memory limit knob, the deferral of SIGINT, an interruptible wait, and what a refused or failed
run leaves (inputs intact, results raising).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading

import pytest
import torch

import shardtensor as st
from shardtensor.graph import memory
from shardtensor.graph.interrupts import deferred_interrupts
from tensor_helpers import MESH_42

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_interrupted_and_failed_steps_lose_nothing():
    env = dict(os.environ, PYTHONPATH=str(ROOT), SHARDTENSOR_CPU_DEVICES="8", SHARDTENSOR_PLATFORM="cpu")
    env.pop("SHARDTENSOR_DEVICE_MEMORY", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "reliability.py"), "--interrupts", "8"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(result.stdout)
    assert "interrupts tried / state lost: 16 / 0" in result.stdout, result.stdout + result.stderr
    assert "failed executions tried / state lost: 5 / 0" in result.stdout, result.stdout + result.stderr
    # a program that runs out of memory on some devices while it runs: with parameter aliasing on, the
    # weight and momentum it updated were donated, lost, and say so when read; off, both are kept
    assert (
        "parameter aliasing on (donated): 1 tried, 1 raised on read, 0 hung, state lost: 2 of 2, "
        "lost without a clear error: 0"
    ) in result.stdout, result.stdout + result.stderr
    assert (
        "parameter aliasing off: 1 tried, 1 raised on read, 0 hung, state lost: 0 of 2, lost without a clear error: 0"
    ) in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0, result.stderr


@pytest.fixture
def limit():
    yield st.set_device_memory_limit
    st.set_device_memory_limit(None)


def test_a_step_that_does_not_fit_is_refused_and_keeps_the_parameters(limit):
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 8)
    model = torch.nn.Linear(8, 8).to(st.device())
    model.load_state_dict(ref.state_dict())
    st.mark_sharding(model.weight, MESH_42, ("x", None))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    st.sync()  # the parameters' values come before the step (pending ones would be part of its program)
    limit("64KiB")
    refused = pytest.raises(torch.OutOfMemoryError, match=r"needs .* per device .* more than the limit of 64\.0 KiB")
    with refused, st.step():
        model(torch.randn(4096, 8).to(st.device())).sum().backward()
        opt.step()
    torch.testing.assert_close(model.weight.cpu(), ref.weight)
    with pytest.raises(torch.OutOfMemoryError):
        model.weight.grad.cpu()  # computed by the refused program: it raises the same error
    opt.zero_grad(set_to_none=True)
    x = torch.randn(4, 8)
    with st.step():
        model(x.to(st.device())).sum().backward()
        opt.step()
    ref(x).sum().backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    torch.testing.assert_close(model.weight.cpu(), ref.weight)


def test_an_address_space_limit_is_checked_for_programs_small_next_to_the_ram(monkeypatch):
    # a `ulimit -v` can be far below the host's RAM: a step needing 8 x 2 MiB (far below the share
    # of the RAM under which nothing else is read) is refused when less than that is left under it.
    # The limit is pretended (getrlimit patched): a real one would bind every thread of this worker.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).to(st.device())
    weight = model.weight.detach().cpu()
    x = torch.randn(1 << 16, 8).to(st.device())
    st.sync()
    monkeypatch.delenv(memory.ENV, raising=False)  # no configured limit: the host's decides
    left = 1 << 20
    real = memory.resource.getrlimit
    pretended = lambda which: (memory._address_space_used() + left, real(which)[1])  # noqa: E731
    monkeypatch.setattr(memory.resource, "getrlimit", pretended)
    refused = pytest.raises(torch.OutOfMemoryError, match=r"left under the address-space limit \(ulimit -v\)")
    with refused, st.step():
        y = model(x)  # 2 MiB per device, an output of the step
        model.weight.data.add_(y.sum())
    monkeypatch.setattr(memory.resource, "getrlimit", real)
    torch.testing.assert_close(model.weight.cpu(), weight)
    with pytest.raises(torch.OutOfMemoryError):
        y.cpu()


def test_memory_limit_knob(monkeypatch, limit):
    assert memory.parse_size("1KiB") == 1024 and memory.parse_size("2GB") == 2 * 10**9
    assert memory.parse_size(4096) == 4096 and memory.parse_size("1e6") == 10**6
    with pytest.raises(ValueError, match="cannot read 'lots'"):
        memory.parse_size("lots")
    monkeypatch.setenv("SHARDTENSOR_DEVICE_MEMORY", "3MiB")
    assert st.device_memory_limit() == 3 << 20
    limit("1GiB")
    assert st.device_memory_limit() == 1 << 30
    limit(None)
    assert st.device_memory_limit() == 3 << 20


@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler (KeyboardInterrupt) for the test. A process started in the
    background by a non-interactive shell (``make test &``, nohup, some CI runners) inherits SIGINT
    ignored, and Python then installs no handler: Ctrl-C does nothing there, whatever shardtensor does."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_deferred_interrupts_leaves_an_ignored_ctrl_c_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("ctrl_c_raises")
def test_deferred_interrupts_delivers_ctrl_c_after_the_block():
    reached = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the signal is handled here, inside: recorded, not raised
            pass
        reached.append(True)
    assert reached == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_deferred_interrupts_keeps_the_users_handler_and_other_threads_alone():
    calls = []
    previous = signal.signal(signal.SIGINT, lambda s, f: calls.append(s))
    try:
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
            assert calls == []
        assert calls == [signal.SIGINT]  # the user's handler ran once, after the block
        seen = []
        thread = threading.Thread(target=lambda: seen.append(deferred_interrupts().__enter__()._user_handler))
        thread.start()
        thread.join()
        assert seen == [None]  # not the main thread: no handler installed
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("ctrl_c_raises")
def test_waiting_for_a_result_can_be_interrupted():
    """Ctrl-C lands while a result is still being computed (``block_until_ready`` would hold it)."""
    import jax
    import jax.numpy as jnp

    from shardtensor.graph.waiting import wait_until_ready

    def slow(x):
        for _ in range(12):
            x = jnp.tanh(x @ x)
        return x

    y = jax.jit(slow)(jnp.ones((1024, 1024)))
    timer = threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGINT))
    try:
        with pytest.raises(KeyboardInterrupt):
            timer.start()  # inside the block: on a busy machine the signal may come before the wait starts
            wait_until_ready([y])
            timer.join()  # finished before the signal came: it lands here instead
        interrupted_while_running = not y.is_ready()
    finally:
        if timer.ident is not None:
            timer.join()
    wait_until_ready([y])
    if not interrupted_while_running:
        pytest.skip("the program finished before the signal arrived (a fast machine)")


def test_a_run_that_fails_gives_back_what_it_would_have_overwritten(monkeypatch):
    """A program whose call fails keeps its donated inputs: the tensors it overwrites get their values
    from before it back; the ones it computes raise its error when read."""
    from shardtensor.graph import execute

    w = st.shard(torch.ones(8, 4), MESH_42, ("x", None))
    st.sync()
    w.mul_(2)
    total = w.sum()

    def failing(fn, arrays, scalars):
        raise RuntimeError("device fault")

    monkeypatch.setattr(execute, "call_executable", failing)
    with pytest.raises(RuntimeError, match="device fault"):
        st.sync()
    monkeypatch.undo()
    torch.testing.assert_close(w.cpu(), torch.ones(8, 4))
    with pytest.raises(RuntimeError, match="device fault"):
        total.item()
    w.mul_(3)  # training goes on from the value before the failed step
    torch.testing.assert_close(w.cpu(), torch.full((8, 4), 3.0))


def test_an_eager_op_that_does_not_fit_keeps_its_inputs(limit):
    w = st.shard(torch.ones(64, 64), MESH_42, ("x", None))
    with st.eager_mode(True):
        w.add_(1)  # compiled and cached while they fit
        (w * 2).cpu()
        limit("1KiB")
        with pytest.raises(torch.OutOfMemoryError, match="needs .* per device"):
            w.add_(1)  # donates w: refused before
        with pytest.raises(torch.OutOfMemoryError, match="needs .* per device"):
            w * 2  # eager mode's cached single-op path
        limit(None)
        torch.testing.assert_close(w.cpu(), torch.full((64, 64), 2.0))
        w.add_(1)
    torch.testing.assert_close(w.cpu(), torch.full((64, 64), 3.0))
