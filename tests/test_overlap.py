"""Issue 37: the host does not wait for the devices. ``sync()`` (a lazy step's end) and a frozen
``st.compile`` replay dispatch their program and return; the next step records while the devices
still work on the last one; only reading a value waits. Asserted on state: each
program holds a gate (a host callback inside it) that the test opens only after the host returned,
so a host that waited would find the gate shut and time out (the callback says so)."""

import threading

import jax
import torch
import torch.nn.functional as F

import shardtensor as st
from _training_helpers import reset_state


class Gate:
    """A host callback the program calls; it returns only once ``open()`` was called."""

    def __init__(self):
        self.opened, self.calls = threading.Event(), []

    def __call__(self, a):
        def wait(value):
            self.calls.append(self.opened.wait(30))  # False: nobody opened it (the host was waiting)
            return value

        return jax.pure_callback(wait, jax.ShapeDtypeStruct(a.shape, a.dtype), a)

    def open(self):
        self.opened.set()


def test_lazy_steps_dispatch_without_waiting_and_the_next_step_records_meanwhile():
    reset_state()
    gate = Gate()
    w = torch.linspace(-1.0, 1.0, 16).reshape(4, 4)
    dev_w = w.clone().to(st.device())
    x = torch.arange(8.0).reshape(2, 4) / 8
    dev_x = x.to(st.device())

    held = st.call_jax(gate, dev_x @ dev_w)  # step 1: its program waits on the gate
    st.sync()
    assert gate.calls == [], "sync() waited for the program to finish"
    # step 2 records while step 1 is in flight, reading its pending result (its own dispatch is not
    # asserted: XLA:CPU runs a program whose inputs are still being computed on the calling thread)
    second = torch.tanh(held).sum(dim=0) * 3 + dev_w.sum()
    assert gate.calls == [], "recording the next step waited for the devices"
    gate.open()
    torch.testing.assert_close(second.cpu(), torch.tanh(x @ w).sum(dim=0) * 3 + w.sum())  # reading waits
    torch.testing.assert_close(held.cpu(), x @ w)
    assert gate.calls and all(gate.calls), "the gate timed out: the host waited for the devices"


def test_a_frozen_replay_returns_before_its_program_finishes():
    reset_state()
    gate = Gate()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    model = model.to(st.device())
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=0.1), torch.optim.AdamW(ref.parameters(), lr=0.1)

    @st.compile
    def train_step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return st.call_jax(gate, loss.detach())  # the whole step's program waits on the gate

    def reference(x):
        loss = ref(x).pow(2).mean()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        return loss.detach()

    xs = [torch.randn(2, 4) for _ in range(4)]
    gate.open()  # open while the first calls trace (and run) the step
    losses = [train_step(x.to(st.device())) for x in xs[:3]]
    st.sync(wait=True)
    replays, calls_before = st.counter_value("CompileReplay") or 0, len(gate.calls)
    gate.opened.clear()
    losses.append(train_step(xs[3].to(st.device())))  # a frozen replay: dispatched, held by the gate
    assert (st.counter_value("CompileReplay") or 0) == replays + 1
    assert len(gate.calls) == calls_before, "the replay waited for its program to finish"
    gate.open()
    for got, x in zip(losses, xs):
        torch.testing.assert_close(got.cpu(), reference(x))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach())
    assert all(gate.calls[calls_before:])


def test_reading_a_value_waits_for_its_program():
    """The other half: ``.item()`` of a pending step's result returns the program's value."""
    reset_state()
    gate = Gate()
    x = torch.arange(6.0)
    y = st.call_jax(gate, x.to(st.device()) * 2)
    st.sync()
    threading.Timer(0.2, gate.open).start()
    assert F.relu(y - 3).sum().item() == F.relu(x * 2 - 3).sum().item()
    assert gate.calls == [True]
