"""Issue 2 §6: ``st.compile(fn, full_graph=False, name=None)`` — as a call and a decorator, results
equal to eager torch, freezing of a trace (later calls run no Python of fn's body) with SGD,
Adam(capturable=True) and torch's default optimizers, Adagrad re-running Python but compiling once,
in-place updates visible after the call, and full_graph=True errors."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardtensor as st
from _training_helpers import (
    CNN,
    CNN_SPECS,
    MLP,
    MLP_SPECS,
    Traces,
    cnn_batches,
    fresh_executable_cache,
    make_pair,
    mesh_1x8,
    mesh_4x2,
    mesh_8,
    mlp_batches,
    reset_state,
    shard_params,
)


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    st.clear_counters()
    yield
    reset_state()


def n(name):
    return st.counter_value(name) or 0


def _data(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- plain functions ------------------------------------------------------------------------------
def _f(x, w):
    return (F.gelu(x @ w) * 2).sum(1) + x.mean()


def test_compile_as_call_equals_torch():
    mesh = mesh_4x2()
    g = st.compile(_f)
    assert isinstance(g, st.CompiledFunction)
    for seed in range(4):  # new values each call (and still right after the trace is frozen)
        x, w = _data((8, 6), seed), _data((6, 4), seed + 10)
        out = g(st.shard(x, mesh, ("data", None)), st.shard(w, mesh, (None, "model")))
        torch.testing.assert_close(out.cpu(), _f(x, w), rtol=1e-5, atol=1e-5)


def _two_outputs(x, y):
    return torch.tanh(x) * y + 1, (x - y).abs().max()


@pytest.mark.parametrize("form", ["bare", "called", "full_graph", "named"])
def test_compile_as_decorator_equals_torch(form):
    calls = Traces()

    def body(x, y):
        return _two_outputs(x, y)

    if form == "bare":
        g = st.compile(body)
    elif form == "called":
        g = st.compile()(body)
    elif form == "full_graph":
        g = st.compile(full_graph=True)(body)
    else:
        g = st.compile(name="my_step")(body)

    mesh = mesh_8()
    for seed in range(4):
        x, y = _data((16, 3), seed), _data((16, 3), seed + 5)
        a, b = g(st.shard(x, mesh, ("d", None)), st.shard(y, mesh, ("d", None)))
        ea, eb = _two_outputs(x, y)
        torch.testing.assert_close(a.cpu(), ea)
        torch.testing.assert_close(b.cpu(), eb)
    assert len(calls) == 2, "frozen after two identical traces"


def test_compile_decorator_syntax_and_name():
    @st.compile
    def doubled(x):
        return x * 2

    @st.compile(name="custom")
    def tripled(x):
        return x * 3

    assert doubled.__name__ == "doubled"
    assert doubled.name == "doubled"
    assert tripled.name == "custom"
    a = _data((4, 4), 0)
    torch.testing.assert_close(doubled(a.to(st.device())).cpu(), a * 2)
    torch.testing.assert_close(tripled(a.to(st.device())).cpu(), a * 3)


def test_compile_freezes_after_two_identical_calls():
    calls = Traces()

    @st.compile
    def g(x, w):
        return _f(x, w)

    mesh = mesh_4x2()
    xs = [(_data((8, 6), s), _data((6, 4), s + 10)) for s in range(6)]
    outs = []
    for x, w in xs:
        outs.append(g(st.shard(x, mesh, ("data", None)), st.shard(w, mesh, (None, "model"))))
    assert len(calls) == 2, "after two identical traces, calls must run no Python of the body"
    assert n("CompileFrozen") == 1
    assert n("CompileReplay") == 4
    assert n("UncachedCompile") <= 1  # (0 when an earlier test compiled the same program)
    # each call's result is its own tensor, with its own value
    for out, (x, w) in zip(outs, xs):
        torch.testing.assert_close(out.cpu(), _f(x, w), rtol=1e-5, atol=1e-5)


def test_compile_new_input_signature_traces_again():
    calls = Traces()

    @st.compile
    def g(x):
        return x.softmax(-1)

    for shape in [(4, 8), (4, 8), (4, 8), (2, 8), (2, 8), (2, 8), (4, 8)]:
        a = _data(shape, len(calls))
        torch.testing.assert_close(g(a.to(st.device())).cpu(), a.softmax(-1))
    assert len(calls) == 4  # two traces per signature, then replays
    assert n("CompileFrozen") == 2


def test_compile_tensors_alone_and_nested_arguments_are_apart():
    """Tensors passed alone (keyed without pytree), by keyword, or in a tuple: each its own
    signature, each result right, and the same call again replays."""
    calls = Traces()

    @st.compile
    def g(x, w=None):
        if isinstance(x, tuple):
            x, w = x
        return _f(x, w)

    x, w = _data((8, 6), 0), _data((6, 4), 1)
    dx, dw = x.to(st.device()), w.to(st.device())
    for _ in range(3):
        for out in (g(dx, dw), g(dx, w=dw), g((dx, dw))):
            torch.testing.assert_close(out.cpu(), _f(x, w), rtol=1e-5, atol=1e-5)
    assert len(calls) == 6  # two traces for each way of passing them, then replays
    assert n("CompileReplay") == 3


def test_a_view_argument_never_replays_a_trace_of_a_plain_tensor():
    """A transposed view of a square tensor has the shape, dtype and layout of a plain one, but its
    values are read through its view: a trace frozen on plain tensors must not replay on it (it read
    the base's values, untransposed), with tensors alone or beside a Python number."""

    @st.compile
    def alone(x):
        return x * 2

    @st.compile
    def with_number(x, s):
        return x * s

    a = _data((4, 4), 0)
    x = a.to(st.device())
    for _ in range(3):
        alone(x), with_number(x, 2.0)
    assert n("CompileReplay") == 2  # frozen on plain tensors
    y = _data((4, 4), 1).to(st.device())
    torch.testing.assert_close(alone(y.t()).cpu(), y.cpu().t() * 2)
    torch.testing.assert_close(with_number(y.t(), 2.0).cpu(), y.cpu().t() * 2)
    torch.testing.assert_close(alone(x).cpu(), a * 2)  # the plain call still replays
    assert n("CompileReplay") == 3


def test_compile_python_scalar_argument():
    """A Python number argument is part of the signature: results follow it."""

    @st.compile
    def g(x, s):
        return x * s + 1

    a = _data((4, 4), 0)
    x = a.to(st.device())
    for s in [2.0, 2.0, 2.0, 3.0, 0.5, 3.0]:
        torch.testing.assert_close(g(x, s).cpu(), a * s + 1)


def test_compile_reads_current_value_of_captured_tensors():
    """Tensors the body reads from its closure (not arguments) are read afresh on every replay."""
    w = _data((4, 4), 1).to(st.device())
    calls = Traces()

    @st.compile
    def g(x):
        return x @ w

    a = _data((4, 4), 0)
    x = a.to(st.device())
    for k in range(5):
        with torch.no_grad():
            w.mul_(2)  # changed outside: the next call must see it
        expected = a @ (_data((4, 4), 1) * 2 ** (k + 1))
        torch.testing.assert_close(g(x).cpu(), expected, rtol=1e-5, atol=1e-5)
    assert len(calls) <= 3


def test_a_frozen_call_follows_a_captured_tensor_resharded_or_replaced():
    """A replay reuses its checks of an input that still holds the same array (parameters, every
    call); a new array (a new value, another layout) is checked again."""
    mesh = mesh_4x2()
    w_cpu = _data((8, 4), 1)
    w = st.shard(w_cpu.clone(), mesh, ("data", None))

    @st.compile
    def g(x):
        return x @ w

    a = _data((4, 8), 0)
    x = a.to(st.device())
    for _ in range(4):  # trace, trace, then replays
        torch.testing.assert_close(g(x).cpu(), a @ w_cpu, rtol=1e-5, atol=1e-5)
    assert n("CompileReplay") >= 2
    st.clear_sharding(w)
    st.mark_sharding(w, mesh, (None, "model"))  # the same value in another layout: a new array
    torch.testing.assert_close(g(x).cpu(), a @ w_cpu, rtol=1e-5, atol=1e-5)
    assert w.sharding_spec == st.shard(w_cpu, mesh, (None, "model")).sharding_spec
    with torch.no_grad():
        w.copy_(2 * w_cpu)  # a new value, the same layout
    torch.testing.assert_close(g(x).cpu(), 2 * a @ w_cpu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g(x).cpu(), 2 * a @ w_cpu, rtol=1e-5, atol=1e-5)


# --- in-place updates are visible after the call ---------------------------------------------------
def test_compile_inplace_update_of_argument_and_captured_state():
    state = torch.zeros(4).to(st.device())
    calls = Traces()

    @st.compile
    def accumulate(x, buf):
        buf.add_(x)
        state.add_(1)
        return buf.sum()

    buf_ref = torch.zeros(4)
    buf = buf_ref.clone().to(st.device())
    for k in range(5):
        a = _data((4,), k)
        s = accumulate(a.to(st.device()), buf)
        buf_ref += a
        torch.testing.assert_close(buf.cpu(), buf_ref)
        torch.testing.assert_close(s.cpu(), buf_ref.sum())
        torch.testing.assert_close(state.cpu(), torch.full((4,), float(k + 1)))
    assert len(calls) == 2


def test_compile_inplace_through_view_argument_base():
    """Writing into a slice/row of an argument updates the argument."""

    @st.compile
    def f(x):
        x[:, 0] = 7
        x[1].mul_(2)
        return None

    ref = _data((3, 4), 0)
    x = ref.clone().to(st.device())
    for _ in range(4):
        f(x)
        ref[:, 0] = 7
        ref[1].mul_(2)
        torch.testing.assert_close(x.cpu(), ref)


def test_compile_batchnorm_buffers_updated():
    """BatchNorm running statistics updated inside the compiled step are visible after each call."""
    mesh = mesh_1x8()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    dev = copy.deepcopy(ref).to(st.device())

    @st.compile
    def fwd(x):
        return dev(x).detach().mean()

    for k in range(4):
        x = _data((8, 3, 6, 6), k)
        out = fwd(st.shard(x, mesh, ("m", None, None, None)))
        torch.testing.assert_close(out.cpu(), ref(x).detach().mean(), rtol=1e-5, atol=1e-5)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(
                getattr(dev[1], name).cpu(),
                getattr(ref[1], name),
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, k=k, name=name: f"step {k} {name}: {m}",
            )


# --- training: freezing, optimizer state -----------------------------------------------------------
def _compiled_training(make_opt, steps, mesh=None, model=MLP, specs=MLP_SPECS, make_ref_opt=None):
    mesh = mesh or mesh_8()
    fresh_executable_cache()  # so that UncachedCompile counts this run's programs only
    ref, dev = make_pair(model)
    shard_params(dev, mesh, specs)
    ref_opt, dev_opt = (make_ref_opt or make_opt)(ref.parameters()), make_opt(dev.parameters())
    batches = mlp_batches(steps, torch.Generator().manual_seed(11))
    calls = Traces()

    @st.compile
    def train_step(x, y):
        loss = F.cross_entropy(dev(x), y)
        loss.backward()
        dev_opt.step()
        dev_opt.zero_grad()
        return loss.detach()

    compiles = []
    losses, ref_losses = [], []
    for x, y in batches:
        losses.append(train_step(st.shard(x, mesh, ("d", None)), st.shard(y, mesh, ("d",))).item())
        compiles.append(n("UncachedCompile"))
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    return ref, dev, ref_opt, dev_opt, losses, ref_losses, calls, compiles


def _assert_same_training(ref, dev, losses, ref_losses, ref_opt=None, dev_opt=None):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(dev.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    if ref_opt is not None:
        for p_ref, p_dev in zip(ref.parameters(), dev.parameters()):
            for k, v in ref_opt.state[p_ref].items():
                got = dev_opt.state[p_dev][k]
                got = got.cpu() if isinstance(got, torch.Tensor) else torch.as_tensor(got)
                torch.testing.assert_close(
                    got, torch.as_tensor(v), rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}"
                )


@pytest.mark.parametrize("opt", ["sgd", "sgd_momentum", "sgd_momentum_foreach_false"])
def test_compile_sgd_freezes_and_trains(opt):
    kw = {
        "sgd": dict(lr=0.1),
        "sgd_momentum": dict(lr=0.1, momentum=0.9),
        "sgd_momentum_foreach_false": dict(lr=0.1, momentum=0.9, foreach=False),
    }[opt]
    ref, dev, ref_opt, dev_opt, losses, ref_losses, calls, compiles = _compiled_training(
        lambda ps: torch.optim.SGD(ps, **kw), steps=7
    )
    assert len(calls) <= 3, f"the body ran {len(calls)} times: the trace never froze"
    assert n("CompileFrozen") == 1
    assert n("CompileReplay") == 7 - len(calls)
    assert compiles[-1] == compiles[2], "replays must not compile"
    _assert_same_training(ref, dev, losses, ref_losses, ref_opt, dev_opt)  # momentum buffers visible too


@pytest.mark.parametrize("foreach", [None, True, False])
def test_compile_adam_capturable_freezes_and_trains(foreach):
    ref, dev, ref_opt, dev_opt, losses, ref_losses, calls, compiles = _compiled_training(
        lambda ps: torch.optim.Adam(ps, lr=1e-3, capturable=True, foreach=foreach),
        steps=6,
        # capturable=True is refused for CPU parameters; the CPU reference is numerically the same
        make_ref_opt=lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=foreach),
    )
    assert len(calls) <= 3, f"the body ran {len(calls)} times: the trace never froze"
    assert n("CompileFrozen") == 1
    assert compiles[-1] == compiles[2]
    _assert_same_training(ref, dev, losses, ref_losses, ref_opt, dev_opt)  # exp_avg, exp_avg_sq, step


DEFAULT_OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw_foreach_false": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=False),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-3),  # two host counters: step and mu_product
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-3),  # a host branch on the step count
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-3),
}


@pytest.mark.parametrize("opt", sorted(DEFAULT_OPTIMIZERS))
def test_compile_default_optimizers_freeze_and_train(opt):
    """torch's default optimizers keep their step counters on the CPU and read them (.item()); inside
    st.compile they count on the devices (torch's capturable path), so the trace freezes, while
    param_groups still say capturable=False and the results equal eager torch's default optimizer."""
    ref, dev, ref_opt, dev_opt, losses, ref_losses, calls, compiles = _compiled_training(
        DEFAULT_OPTIMIZERS[opt], steps=6
    )
    assert len(calls) <= 3, f"the body ran {len(calls)} times: the trace never froze"
    assert n("CompileFrozen") == 1
    assert compiles[-1] == compiles[2], f"replays must not compile: {compiles}"
    assert [g["capturable"] for g in dev_opt.param_groups] == [False]
    _assert_same_training(ref, dev, losses, ref_losses, ref_opt, dev_opt)  # step counters too


def test_compile_adagrad_freezes_on_its_fused_path():
    """Adagrad has no capturable path in torch, but its fused kernel reads the step count on the
    device: inside a trace its groups take that path (optim_steps), so the step freezes, equal to
    torch's default Adagrad."""
    ref, dev, ref_opt, dev_opt, losses, ref_losses, calls, compiles = _compiled_training(
        lambda ps: torch.optim.Adagrad(ps, lr=1e-2), steps=5
    )
    assert len(calls) <= 3, f"the body ran {len(calls)} times: the trace never froze"
    assert n("CompileFrozen") == 1
    assert compiles[-1] == compiles[2], f"replays must not compile: {compiles}"
    assert [g["fused"] for g in dev_opt.param_groups] == [None]  # (as the user made it)
    _assert_same_training(ref, dev, losses, ref_losses, ref_opt, dev_opt)


def test_compile_cnn_batchnorm_training_state_visible():
    mesh = mesh_1x8()
    ref, dev = make_pair(CNN)
    shard_params(dev, mesh, CNN_SPECS)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    dev_opt = torch.optim.SGD(dev.parameters(), lr=0.1, momentum=0.9)

    @st.compile
    def train_step(x, y):
        loss = F.cross_entropy(dev(x), y)
        loss.backward()
        dev_opt.step()
        dev_opt.zero_grad()
        return loss.detach()

    for x, y in cnn_batches(4, torch.Generator().manual_seed(2)):
        loss = train_step(st.shard(x, mesh, ("m", None, None, None)), st.shard(y, mesh, ("m",)))
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=1e-4, atol=1e-5)
        for name, v in ref.state_dict().items():
            torch.testing.assert_close(
                dev.state_dict()[name].cpu(), v, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
            )


# --- full_graph=True -------------------------------------------------------------------------------
def _full_graph_cases():
    def item(x):
        return x * x.sum().item()

    def branch(x):
        if x.sum() > 0:
            return x + 1
        return x - 1

    def printing(x):
        y = x * 2
        print(y)  # a computed value
        return y

    def to_cpu(x):
        return (x + 1).cpu() * 2

    return {"item": item, "branch": branch, "print": printing, "cpu": to_cpu}


@pytest.mark.parametrize("case", list(_full_graph_cases()))
def test_full_graph_needing_a_value_raises(case):
    fn = _full_graph_cases()[case]
    g = st.compile(fn, full_graph=True)
    a = _data((4, 4), 0)
    x = a.to(st.device())
    with pytest.raises(st.UnexpectedExecutionError, match="full_graph") as info:
        g(x)
    assert isinstance(info.value, RuntimeError)
    assert g.name in str(info.value)
    # nothing is left broken: lazy work runs normally afterwards, and the same body without
    # full_graph works (re-running Python)
    assert not st.is_eager_mode()
    torch.testing.assert_close((x + 1).cpu(), a + 1)
    h = st.compile(fn)
    for _ in range(3):
        out = h(x)
        torch.testing.assert_close(out.cpu() if isinstance(out, st.ShardedTensor) else out, fn(a))


def test_unexpected_execution_error_is_public():
    assert issubclass(st.UnexpectedExecutionError, RuntimeError)


def test_full_graph_without_value_reads_freezes():
    calls = Traces()

    @st.compile(full_graph=True)
    def g(x):
        return torch.where(x.sum() > 0, x + 1, x - 1)

    for k in range(4):
        a = _data((4, 4), k)
        torch.testing.assert_close(g(a.to(st.device())).cpu(), torch.where(a.sum() > 0, a + 1, a - 1))
    assert len(calls) == 2


def test_compile_under_eager_mode():
    """A compiled function called in eager mode still gives torch's results."""

    @st.compile
    def g(x):
        return F.silu(x) @ x.t()

    with st.eager_mode(True):
        for k in range(3):
            a = _data((4, 4), k)
            torch.testing.assert_close(g(a.to(st.device())).cpu(), F.silu(a) @ a.t(), rtol=1e-5, atol=1e-5)
        assert st.is_eager_mode()
