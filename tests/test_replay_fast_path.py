"""A frozen ``st.compile`` replay as a decode loop uses it (issue 37 §3): each call's outputs (the next
token, the position) are the next call's inputs, a closed-over cache is updated in place. The
replay stores its outputs in one pass and, with ``raise_on_call=False``, does not wait for the
device: a failed on-device check then raises by the next call, before that call runs anything.

Every result is compared with eager torch on CPU; changed inputs and changed Python state must
still retrace, as on the slower paths.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.nn as nn

import shardtensor as st
from _training_helpers import reset_state
from shardtensor.graph import aliasing, memory
from shardtensor.runtime import environ_reader

VOCAB, WIDTH, LENGTH = 6, 4, 8


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    yield
    reset_state()


def _decoder(device, raise_on_call=True):
    """(step, cache): a greedy step over a cache of LENGTH rows, compiled on the device."""
    torch.manual_seed(0)
    w = torch.randn(VOCAB, WIDTH).to(device)
    positions = (10 * torch.randn(LENGTH + 1, VOCAB)).to(device)
    cache = torch.zeros(LENGTH, WIDTH).to(device)

    def step(tok, pos):
        cache.index_copy_(0, pos, w[tok])
        logits = cache.sum(0, keepdim=True) @ w.t() + positions[pos]
        return logits.argmax(-1), pos + 1, logits

    if device == "cpu":
        return step, cache
    return st.compile(step, raise_on_call=raise_on_call), cache


def _run(step, tok, pos, calls):
    out = []
    with torch.no_grad():
        for _ in range(calls):
            tok, pos, logits = step(tok, pos)
            out.append((tok, pos, logits))
    return out


@pytest.mark.parametrize("raise_on_call", [True, False])
def test_decode_loop_feeding_outputs_back_equals_torch(raise_on_call):
    ref_step, ref_cache = _decoder("cpu")
    step, cache = _decoder(st.device(), raise_on_call)
    start = (torch.tensor([1]), torch.tensor([0]))
    replays = st.counter_value("CompileReplay") or 0
    expected = _run(ref_step, *start, LENGTH)
    got = _run(step, *(t.to(st.device()) for t in start), LENGTH)
    assert (st.counter_value("CompileReplay") or 0) - replays >= LENGTH - 2  # traced twice, then replayed
    for (t, p, lg), (t2, p2, lg2) in zip(expected, got):
        assert torch.equal(t2.cpu(), t) and torch.equal(p2.cpu(), p)
        torch.testing.assert_close(lg2.cpu(), lg)
    torch.testing.assert_close(cache.cpu(), ref_cache)
    assert len({t.item() for t, _, _ in expected}) > 1  # (the tokens change: the fed-back values matter)


def test_deferred_check_raises_on_the_next_call_and_keeps_the_cache():
    step, cache = _decoder(st.device(), raise_on_call=False)
    outs = _run(step, torch.tensor([1]).to(st.device()), torch.tensor([0]).to(st.device()), LENGTH)
    tok, pos, _ = outs[-1]
    before = cache.cpu()
    with torch.no_grad():
        bad_tok, bad_pos, _ = step(tok, pos)  # position LENGTH: out of the cache; returns without waiting
        with pytest.raises(IndexError, match="out of bounds") as info:
            step(bad_tok, bad_pos)
    assert "test_replay_fast_path.py" in str(info.value)  # the user's line of the checked op
    torch.testing.assert_close(cache.cpu(), before)  # the failed call's update was not kept
    with pytest.raises(IndexError):  # its result depends on the failed check
        bad_tok.cpu()
    # the loop goes on from earlier outputs (a good position), replaying
    replays = st.counter_value("CompileReplay") or 0
    with torch.no_grad():
        tok, _, _ = step(*outs[2][:2])
    assert (st.counter_value("CompileReplay") or 0) == replays + 1
    ref_step, ref_cache = _decoder("cpu")
    expected = _run(ref_step, torch.tensor([1]), torch.tensor([0]), LENGTH)
    with torch.no_grad():
        ref_tok, _, _ = ref_step(*expected[2][:2])
    assert torch.equal(tok.cpu(), ref_tok)
    torch.testing.assert_close(cache.cpu(), ref_cache)


def test_deferred_check_raises_at_a_read():
    step, _ = _decoder(st.device(), raise_on_call=False)
    _run(step, torch.tensor([1]).to(st.device()), torch.tensor([0]).to(st.device()), 3)  # frozen
    with torch.no_grad():
        _, pos, logits = step(torch.tensor([1]).to(st.device()), torch.tensor([LENGTH]).to(st.device()))
    with pytest.raises(IndexError, match="out of bounds"):
        pos.cpu()  # (the read settles the checks first, whatever it reads)


def test_changed_inputs_still_retrace():
    step, _ = _decoder(st.device())
    ref_step, _ = _decoder("cpu")
    tok, pos = torch.tensor([1]), torch.tensor([0])
    _run(step, tok.to(st.device()), pos.to(st.device()), 3)
    _run(ref_step, tok, pos, 3)
    traces = st.counter_value("CompileTrace") or 0
    # another shape, then another dtype: each a trace of its own, equal to torch
    for t, p in ((torch.tensor([1, 2]), torch.tensor([3, 4])), (torch.tensor([1], dtype=torch.int32), pos)):
        with torch.no_grad():
            got = step(t.to(st.device()), p.to(st.device()))
            expected = ref_step(t, p)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a.cpu(), b)
    assert (st.counter_value("CompileTrace") or 0) >= traces + 2


def test_changed_python_state_still_retraces():
    """The guard reads modules through their __dict__; a hook, a new parameter or eval() must still
    be seen (and a module keeping ``training`` elsewhere takes the attribute path)."""

    class Odd(nn.Linear):
        @property
        def training(self):  # kept elsewhere: not in the module's __dict__
            return self.__dict__.get("_mode", True)

        @training.setter
        def training(self, value):
            self.__dict__["_mode"] = value

    for cls in (nn.Linear, Odd):
        torch.manual_seed(0)
        model = cls(4, 4)
        ref = cls(4, 4)
        ref.load_state_dict(model.state_dict())
        model = model.to(st.device())
        step = st.compile(lambda x, m=model: torch.nn.functional.dropout(m(x), 0.5, m.training))
        x = torch.randn(2, 4)
        model.eval()
        ref.eval()
        with torch.no_grad():
            replays = st.counter_value("CompileReplay") or 0
            for _ in range(4):
                torch.testing.assert_close(step(x.to(st.device())).cpu(), ref(x))
            frozen = st.counter_value("CompileReplay") or 0
            assert frozen > replays
            handle = model.register_forward_hook(lambda m, i, o: o * 2)
            torch.testing.assert_close(step(x.to(st.device())).cpu(), ref(x) * 2)
            handle.remove()
            model.weight = nn.Parameter(model.weight * 3)
            torch.testing.assert_close(step(x.to(st.device())).cpu(), nn.functional.linear(x, ref.weight * 3, ref.bias))
            assert (st.counter_value("CompileReplay") or 0) == frozen  # neither call replayed the stale trace


def test_backend_option_raise_on_call():
    f = torch.compile(lambda x, i: x.index_select(0, i) * 2, backend="shardtensor", options={"raise_on_call": False})
    x = torch.arange(12.0).reshape(6, 2)
    torch.testing.assert_close(f(x.to(st.device()), torch.tensor([0, 5]).to(st.device())).cpu(), x[[0, 5]] * 2)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="raise_on_call"):
        torch._dynamo.reset()
        torch.compile(lambda x: x + 1, backend="shardtensor", options={"nope": 1})(x.to(st.device()))
    torch._dynamo.reset()


def test_environment_settings_read_each_run(monkeypatch):
    read = environ_reader("SHARDTENSOR_TEST_VARIABLE")
    monkeypatch.delenv("SHARDTENSOR_TEST_VARIABLE", raising=False)
    unset = read()
    monkeypatch.setenv("SHARDTENSOR_TEST_VARIABLE", "1")
    one = read()
    monkeypatch.setenv("SHARDTENSOR_TEST_VARIABLE", "2")
    assert len({unset, one, read()}) == 3
    assert read() == read()
    # the settings behind a replay's checks see a change made mid-run
    monkeypatch.setenv("XLA_ENABLE_PARAM_ALIASING", "0")
    assert aliasing.param_aliasing_enabled() is False
    monkeypatch.setenv("XLA_ENABLE_PARAM_ALIASING", "1")
    assert aliasing.param_aliasing_enabled() is True
    monkeypatch.setenv("SHARDTENSOR_DEVICE_MEMORY", "2KiB")
    assert memory.device_memory_limit() == 2048
    monkeypatch.setenv("SHARDTENSOR_DEVICE_MEMORY", "lots")
    with pytest.raises(ValueError, match="SHARDTENSOR_DEVICE_MEMORY"):
        memory.device_memory_limit()
    monkeypatch.delenv("SHARDTENSOR_DEVICE_MEMORY")
    assert memory.device_memory_limit() is None
    assert os.environ.get("SHARDTENSOR_DEVICE_MEMORY") is None


def test_aliasing_switched_off_mid_loop_keeps_results_equal(monkeypatch):
    step, cache = _decoder(st.device())
    ref_step, ref_cache = _decoder("cpu")
    tok, pos = torch.tensor([1]), torch.tensor([0])
    got = _run(step, tok.to(st.device()), pos.to(st.device()), 3)
    expected = _run(ref_step, tok, pos, 3)
    monkeypatch.setenv("XLA_ENABLE_PARAM_ALIASING", "0")  # the frozen program donates: trace again
    got += _run(step, got[-1][0], got[-1][1], 3)
    expected += _run(ref_step, expected[-1][0], expected[-1][1], 3)
    for (t, p, lg), (t2, p2, lg2) in zip(expected, got):
        assert torch.equal(t2.cpu(), t) and torch.equal(p2.cpu(), p)
        torch.testing.assert_close(lg2.cpu(), lg)
    torch.testing.assert_close(cache.cpu(), ref_cache)


def _changes():
    """(name, change(model)) for each Python-state change a replay could not repeat."""

    def swap_param(m):
        m[0].weight = nn.Parameter(m[0].weight.detach().clone())

    def swap_buffer(m):
        m[1].running_mean = m[1].running_mean.clone()

    def add_module(m):
        m[0].extra = nn.Identity()

    def set_grad(m):
        m[0].weight.grad = torch.zeros_like(m[0].weight)

    return [
        ("forward hook", lambda m: m[0].register_forward_hook(lambda *a: None)),
        ("forward pre-hook", lambda m: m[1].register_forward_pre_hook(lambda *a: None)),
        ("backward hook", lambda m: m[0].register_full_backward_hook(lambda *a: None)),
        ("tensor hook", lambda m: m[0].bias.register_hook(lambda g: g)),
        ("accumulate hook", lambda m: m[0].bias.register_post_accumulate_grad_hook(lambda p: None)),
        ("requires_grad", lambda m: m[0].weight.requires_grad_(False)),
        ("grad", set_grad),
        ("parameter", swap_param),
        ("buffer", swap_buffer),
        ("submodule", add_module),
        ("eval", lambda m: m.eval()),
        ("global hook", lambda m: nn.modules.module.register_module_forward_hook(lambda *a: None)),
    ]


def _guard_of(fn, *objects, args=None):
    """The guard a trace of ``fn`` would take: the objects it reaches from ``fn``, ``objects`` and
    the globals its code reads (``args``: tensor arguments checked by position; None: not checked)."""
    from shardtensor import replay_guard, trace_reads

    with trace_reads.recording() as ran:
        fn()
    snap = replay_guard.Snapshot(replay_guard.Roots(fn, objects, trace_reads.global_reads(ran.code_globals)))
    assert snap.reason is None, snap.reason
    return snap.guard(args)


def _model_and_forward():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(st.device())
    x = torch.ones(2, 4).to(st.device())
    return model, x, lambda: model(x)


@pytest.mark.parametrize(("name", "change"), _changes(), ids=[n for n, _ in _changes()])
def test_guard_sees_each_change(name, change):
    """The guard (dict version tags, tensor states, the globals torch's code reads) sees every change."""
    model, x, forward = _model_and_forward()
    guard = _guard_of(forward)
    assert guard.holds()
    handle = change(model)
    try:
        assert not guard.holds()
    finally:
        if hasattr(handle, "remove"):
            handle.remove()


def test_guard_of_a_graph_sees_its_modules_grad_mode_and_global_hooks():
    """A guard whose arguments the caller vouches for (a Dynamo graph's) still sees its modules,
    grad mode, inference mode and the global hooks."""
    model, x, forward = _model_and_forward()
    guard = _guard_of(forward)
    assert guard.holds([x])
    with torch.no_grad():
        assert not guard.holds([x])
    with torch.inference_mode():
        assert not guard.holds([x])
    changes = dict(_changes())
    for name in ("forward hook", "forward pre-hook", "backward hook", "global hook"):  # (each removed after)
        handle = changes[name](model)
        assert not guard.holds([x]), name
        handle.remove()  # (a dict changed and changed back: seen as changed, the call traces again)
        guard = _guard_of(forward)
    model.eval()
    assert not guard.holds([x])
    model.train()
    guard = _guard_of(forward)
    changes["submodule"](model)
    assert not guard.holds([x])
    del model, forward
    gc.collect()
    assert not guard.holds([x])  # (a module gone)


def test_guard_sees_a_gradient_replaced_and_a_plain_tensor_or_subclass():
    """A tensor's state is read straight from torch's object where its type takes it from torch (a
    parameter, a plain tensor, a subclass that overrides none of it): a gradient replaced by
    another, a hook added or requires_grad flipped on any of them fails the guard."""

    class Tagged(torch.Tensor):  # a subclass of torch's (its attributes still torch's getters)
        pass

    weight = nn.Parameter(torch.ones(3).to(st.device()))
    weight.grad = torch.zeros(3).to(st.device())
    tensors = (weight, torch.ones(2, requires_grad=True), torch.ones(2).as_subclass(Tagged).requires_grad_())
    guard = _guard_of(lambda: None, *tensors)
    assert guard.holds()
    weight.grad = torch.zeros(3).to(st.device())  # (another tensor, equal values)
    assert not guard.holds()
    for t in tensors[1:]:
        guard = _guard_of(lambda: None, *tensors)
        handle = t.register_hook(lambda g: g)
        assert not guard.holds()
        handle.remove()
        assert guard.holds()
        t.requires_grad_(False)
        assert not guard.holds()


def test_guard_sees_changes_to_the_call_arguments():
    """A call's tensor arguments: their requires_grad, hooks and a leaf's .grad; a new argument
    with the same state holds."""
    weight = nn.Parameter(torch.ones(3).to(st.device()))
    x = torch.ones(3).to(st.device()).requires_grad_()
    guard = _guard_of(lambda: None, weight, args=[x])
    assert guard.holds([x]) and guard.holds([torch.zeros(3).to(st.device()).requires_grad_()])
    assert not guard.holds([torch.zeros(3).to(st.device())])  # (requires_grad differs)
    assert not guard.holds([x, x])
    handle = x.register_hook(lambda g: g)
    assert not guard.holds([x])
    handle.remove()
    x.grad = torch.zeros(3).to(st.device())
    assert not guard.holds([x])


@pytest.mark.parametrize(
    "change",
    [
        lambda opt, model: opt.param_groups[0].update(lr=0.5),
        lambda opt, model: opt.param_groups[0]["params"].reverse(),
        lambda opt, model: opt.param_groups[0]["params"].append(nn.Parameter(torch.zeros(2).to(st.device()))),
        lambda opt, model: opt.register_step_pre_hook(lambda *a: None),
        lambda opt, model: opt.param_groups[0].update(betas=(0.9, 0.999)),
        lambda opt, model: opt.param_groups[0].update(lr_tensor=torch.tensor(0.1)),  # (equal, another tensor)
        lambda opt, model: opt.param_groups[0].update(nesterov_extra=False),
        lambda opt, model: opt.state[model[0].weight].update(momentum_buffer=torch.zeros(4, 4).to(st.device())),
    ],
    ids=["lr", "order", "new parameter", "step hook", "betas", "tensor lr", "new entry", "state replaced"],
)
def test_guard_sees_optimizer_changes_and_a_dropped_module(change):
    """An optimizer's groups, hyperparameters, hooks and state, and the objects' lives (the guard
    holds them weakly)."""
    model = nn.Sequential(nn.Linear(4, 4)).to(st.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.param_groups[0]["betas"] = (0.9, 0.99)
    opt.param_groups[0]["lr_tensor"] = torch.tensor(0.1)
    opt.state[model[0].weight]["momentum_buffer"] = torch.ones(4, 4).to(st.device())
    guard = _guard_of(lambda: None, model, opt)
    assert guard.holds()
    change(opt, model)
    assert not guard.holds()
    other = nn.Linear(2, 2).to(st.device())
    guard = _guard_of(lambda: None, other)
    assert guard.holds()
    del other
    gc.collect()
    assert not guard.holds()


def test_replay_still_checks_an_address_space_limit_set_later(monkeypatch):
    """A program found small next to the host's RAM skips the host query on later runs, but not the
    address-space limit: one set (here: pretended) after it froze still refuses it."""
    monkeypatch.delenv(memory.ENV, raising=False)
    step, cache = _decoder(st.device())
    big = torch.zeros(1 << 16, 8).to(st.device())
    grow = st.compile(lambda t: (t + 1, cache.sum()))
    with torch.no_grad():
        for _ in range(3):
            big, _ = grow(big)
        replays = st.counter_value("CompileReplay") or 0
        big, _ = grow(big)
        assert (st.counter_value("CompileReplay") or 0) == replays + 1
        real = memory.resource.getrlimit
        pretended = lambda which: (memory._address_space_used() + (1 << 20), real(which)[1])  # noqa: E731
        monkeypatch.setattr(memory.resource, "getrlimit", pretended)
        with pytest.raises(torch.OutOfMemoryError, match="address-space limit"):
            grow(big)
        monkeypatch.setattr(memory.resource, "getrlimit", real)
        kept = big.cpu()  # the refused call ran nothing: its input is intact
    torch.testing.assert_close(kept, torch.full((1 << 16, 8), 4.0))


def test_a_new_loop_from_uploaded_inputs_replays():
    """The first call of a second decode loop takes freshly uploaded inputs, whose replicated layout
    jax may name otherwise than the program's outputs (``P()`` / ``P(None)``): it replays, with
    torch's results, instead of tracing again."""
    step, cache = _decoder(st.device())
    ref_step, ref_cache = _decoder("cpu")
    _run(step, torch.tensor([1]).to(st.device()), torch.tensor([0]).to(st.device()), 3)
    _run(ref_step, torch.tensor([1]), torch.tensor([0]), 3)
    traces = st.counter_value("CompileTrace") or 0
    got = _run(step, torch.tensor([4]).to(st.device()), torch.tensor([2]).to(st.device()), 3)
    expected = _run(ref_step, torch.tensor([4]), torch.tensor([2]), 3)
    assert (st.counter_value("CompileTrace") or 0) == traces
    for (t, p, lg), (t2, p2, lg2) in zip(expected, got):
        assert torch.equal(t2.cpu(), t) and torch.equal(p2.cpu(), p)
        torch.testing.assert_close(lg2.cpu(), lg)
    torch.testing.assert_close(cache.cpu(), ref_cache)
