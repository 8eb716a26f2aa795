"""Issue 2 §6: lazy mode (recording, sync, step, implicit sync on reads, the executable cache,
Python scalars as graph inputs, donation, counters) and eager mode."""

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from _training_helpers import (
    MLP,
    MLP_SPECS,
    fresh_executable_cache,
    make_pair,
    mesh_4x2,
    mesh_8,
    mlp_batches,
    reset_state,
    shard_params,
)
from _training_helpers import (
    cross_entropy_step as _step,
)


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    st.clear_counters()
    yield
    reset_state()


def n(name):
    """Counter value, 0 when it never counted (counter_value gives None then)."""
    return st.counter_value(name) or 0


def _x(shape=(8, 6), seed=0):
    a = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return a, st.shard(a, mesh_4x2(), ("data", None))


# --- counters -------------------------------------------------------------------------------------
def test_counter_api():
    fresh_executable_cache()
    st.clear_counters()
    assert st.counter_value("UncachedCompile") is None
    assert st.counters() == {}
    a, x = _x()
    assert n("TransferToDevice") == 1  # st.shard uploads
    (x + 1).cpu()
    names = st.counter_names()
    for name in ("TransferToDevice", "TransferFromDevice", "UncachedCompile", "ExecuteReplicated"):
        assert name in names
    assert st.counters()["ExecuteReplicated"] == 1
    st.clear_counters()
    assert st.counter_value("ExecuteReplicated") is None


def test_transfer_counters():
    a = torch.randn(4, 4)
    t = a.to(st.device())
    assert n("TransferToDevice") == 1
    assert n("TransferFromDevice") == 0
    torch.testing.assert_close(t.cpu(), a)
    assert n("TransferFromDevice") == 1


# --- lazy mode ------------------------------------------------------------------------------------
def test_default_mode_is_lazy():
    assert st.is_eager_mode() is False


def test_ops_are_recorded_and_run_at_sync():
    fresh_executable_cache()
    a, x = _x()
    st.clear_counters()
    y = (x * 2 + 1).sin().sum(0)
    z = x.t() @ x
    assert n("ExecuteReplicated") == 0
    assert n("UncachedCompile") == 0
    st.sync()
    assert n("MarkStep") == 1
    assert n("UncachedCompile") == 1
    assert n("ExecuteReplicated") == 1  # y and z in one program
    torch.testing.assert_close(y.cpu(), (a * 2 + 1).sin().sum(0))
    torch.testing.assert_close(z.cpu(), a.t() @ a, rtol=1e-5, atol=1e-5)
    assert n("ExecuteReplicated") == 1  # reading computed values runs nothing
    assert n("TransferFromDevice") == 2


def test_sync_with_nothing_pending_runs_nothing():
    a, x = _x()
    st.sync()
    st.sync(wait=True)
    assert n("ExecuteReplicated") == 0
    assert n("UncachedCompile") == 0


def test_sync_wait():
    a, x = _x()
    y = x.exp()
    st.sync(wait=True)
    assert n("ExecuteReplicated") == 1
    torch.testing.assert_close(y.cpu(), a.exp())


def test_same_graph_is_cached():
    fresh_executable_cache()
    a, x = _x()
    for _ in range(3):
        y = x * 2 - x.sum()
        st.sync()
    assert n("UncachedCompile") == 1
    assert n("CachedCompile") == 2
    assert n("ExecuteReplicated") == 3
    torch.testing.assert_close(y.cpu(), a * 2 - a.sum())


def test_step_syncs_at_normal_exit():
    a, x = _x()
    with st.step():
        y = x + 1
        assert n("ExecuteReplicated") == 0
    assert n("MarkStep") == 1
    assert n("ExecuteReplicated") == 1
    torch.testing.assert_close(y.cpu(), a + 1)
    assert n("ExecuteReplicated") == 1


def test_step_does_not_sync_when_block_raises():
    a, x = _x()
    with pytest.raises(ValueError, match="boom"), st.step():
        y = x + 1
        raise ValueError("boom")
    assert n("MarkStep") == 0
    assert n("ExecuteReplicated") == 0
    # the recorded work is still there and runs when needed
    torch.testing.assert_close(y.cpu(), a + 1)
    assert n("ExecuteReplicated") == 1


@pytest.mark.parametrize(
    "reader", ["cpu", "to_cpu", "item", "tolist", "numpy", "print", "repr", "bool", "float", "format"]
)
def test_reading_a_value_syncs(reader, capsys):
    a, x = _x()
    s = x.sum()
    v = x * 3
    other = x - 1  # pending too: an implicit sync runs everything pending
    assert n("ExecuteReplicated") == 0
    if reader == "cpu":
        torch.testing.assert_close(v.cpu(), a * 3)
    elif reader == "to_cpu":
        torch.testing.assert_close(v.to("cpu"), a * 3)
    elif reader == "item":
        assert s.item() == pytest.approx(a.sum().item(), rel=1e-5)
    elif reader == "tolist":
        torch.testing.assert_close(torch.tensor(v.tolist()), a * 3)
    elif reader == "numpy":
        torch.testing.assert_close(torch.from_numpy(v.numpy()), a * 3)
    elif reader == "print":
        print(v)
        out = capsys.readouterr().out
        assert f"{(a * 3)[0, 0].item():.4f}" in out
    elif reader == "repr":
        r = repr(v)
        assert f"{(a * 3)[0, 0].item():.4f}" in r
    elif reader == "bool":
        assert bool(s > -1e9) is True
    elif reader == "float":
        assert float(s) == pytest.approx(a.sum().item(), rel=1e-5)
    elif reader == "format":
        assert f"{s:.3f}" == f"{a.sum().item():.3f}"
    assert n("ExecuteReplicated") == 1
    torch.testing.assert_close(other.cpu(), a - 1)
    assert n("ExecuteReplicated") == 1


def test_print_replicated_and_sharded_results(capsys):
    """Printing works for replicated tensors, user-sharded ones and results whose layout XLA chose."""
    a, x = _x()
    r = torch.arange(4.0).to(st.device()) + 1
    y = x * 2  # sharded input, no user spec: XLA picks the layout
    for t, expected in ((x, a), (r, torch.arange(4.0) + 1), (y, a * 2)):
        text = repr(t)
        assert "ShardedTensor" in text
        assert repr(expected) in text  # exact values: x, arange + 1 and x * 2 are exact in float32
        print(t)
    assert "ShardedTensor" in capsys.readouterr().out


def test_value_read_inside_step_syncs_once_more():
    a, x = _x()
    with st.step():
        s = (x * 2).sum()
        assert s.item() == pytest.approx(2 * a.sum().item(), rel=1e-5)
        y = x + s
    assert n("ExecuteReplicated") == 2
    torch.testing.assert_close(y.cpu(), a + 2 * a.sum(), rtol=1e-5, atol=1e-5)


def _mlp_setup(opt_kwargs=None, mesh=None):
    mesh = mesh or mesh_8()
    ref, dev = make_pair(MLP)
    shard_params(dev, mesh, MLP_SPECS)
    kw = dict(lr=0.1, momentum=0.9) if opt_kwargs is None else opt_kwargs
    ref_opt = torch.optim.SGD(ref.parameters(), **kw)
    dev_opt = torch.optim.SGD(dev.parameters(), **kw)
    batches = mlp_batches(7, torch.Generator().manual_seed(3))
    dev_batches = [(st.shard(x, mesh, ("d", None)), st.shard(y, mesh, ("d",))) for x, y in batches]
    return ref, dev, ref_opt, dev_opt, batches, dev_batches


def test_training_loop_compiles_once():
    """After a warm-up of 2 steps (the optimizer creates its state in step 1), 5 identical steps
    reuse the cached executable: no compile, one execution each, no transfers."""
    fresh_executable_cache()
    ref, dev, ref_opt, dev_opt, batches, dev_batches = _mlp_setup()
    losses = []
    for i, (x, y) in enumerate(dev_batches):
        if i == 2:
            st.clear_counters()
        with st.step():
            losses.append(_step(dev, dev_opt, x, y).detach())  # the same step each time, warm-up too
    losses = losses[2:]
    assert n("UncachedCompile") == 0, st.counters()
    assert n("CachedCompile") == 5
    assert n("ExecuteReplicated") == 5
    assert n("MarkStep") == 5
    assert n("TransferToDevice") == 0
    assert n("TransferFromDevice") == 0
    ref_losses = [_step(ref, ref_opt, x, y).item() for x, y in batches]
    torch.testing.assert_close(
        torch.stack([loss.cpu() for loss in losses]), torch.tensor(ref_losses[2:]), rtol=1e-4, atol=1e-5
    )
    for (name, p), q in zip(dev.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_learning_rate_change_does_not_recompile():
    """Python scalars (lr, momentum...) are graph inputs: a new lr reuses the executable and is used."""
    fresh_executable_cache()
    ref, dev, ref_opt, dev_opt, batches, dev_batches = _mlp_setup()
    lrs = [0.1, 0.1, 0.05, 0.02, 0.3, 0.07, 0.01]
    for i, ((x, y), (xd, yd)) in enumerate(zip(batches, dev_batches)):
        if i == 2:
            st.clear_counters()
        for g in ref_opt.param_groups + dev_opt.param_groups:
            g["lr"] = lrs[i]
        with st.step():
            _step(dev, dev_opt, xd, yd)
        _step(ref, ref_opt, x, y)
    assert n("UncachedCompile") == 0, st.counters()
    assert n("CachedCompile") == 5
    for (name, p), q in zip(dev.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("op", ["add_alpha", "mul_scalar", "div_scalar", "rsub", "pow", "addcdiv_value"])
def test_python_scalars_are_graph_inputs(op):
    """The minimal form of the lr test: the same op with another Python number compiles once."""
    fresh_executable_cache()
    a, x = _x()
    fns = {
        "add_alpha": lambda t, s: t.add(t, alpha=s),
        "mul_scalar": lambda t, s: t * s,
        "div_scalar": lambda t, s: t / s,
        "rsub": lambda t, s: s - t,
        "pow": lambda t, s: t.abs() ** s,
        "addcdiv_value": lambda t, s: torch.addcdiv(t, t, t.abs() + 1, value=s),
    }
    fn = fns[op]
    for s in (0.75, 1.5, 2.5, 3.5):  # (not 0.5: pow bakes it, see the next test)
        y = fn(x, s)
        st.sync()
        torch.testing.assert_close(y.cpu(), fn(a, s), rtol=1e-5, atol=1e-5)
    assert n("UncachedCompile") == 1, st.counters()
    assert n("CachedCompile") == 3


def test_pow_bakes_the_exponents_torch_special_cases():
    """``x ** 2`` is ``x * x``, as torch's CPU kernel computes it, not XLA's general power of a
    runtime exponent: the exponents torch special-cases (2, 3, 0.5, -0.5, -1, -2, 1, 0) are baked
    into the program, and any other stays a runtime input (a new value does not recompile)."""
    from shardtensor.graph import state
    from shardtensor.graph.capture import lower

    fresh_executable_cache()
    a, x = _x()
    for e in (2, 3, 0.5, -0.5, -1, -2, 1, 0, 2.0, -1.0):
        y = x**e
        lowered = lower(state.pending_cells())
        text = lowered.jitted().lower(*lowered.abstract_arguments()).as_text()
        assert "stablehlo.power" not in text and not lowered.scalars, (e, lowered.scalars)
        st.sync()
        want = a**e
        assert y.dtype == want.dtype
        if e in (2, -1, 1, 0):  # one multiply or division, or none: the same float bits as torch
            assert torch.equal(torch.nan_to_num(y.cpu()), torch.nan_to_num(want)), e
        else:
            torch.testing.assert_close(y.cpu(), want, equal_nan=True)
    compiles = n("UncachedCompile")
    for e in (1.7, 2.5, -2.3):  # not special: one program, the exponent a runtime input
        y = x.abs() ** e
        st.sync()
        torch.testing.assert_close(y.cpu(), a.abs() ** e)
    assert n("UncachedCompile") == compiles + 1, st.counters()
    # integer tensors: a special exponent is baked too, with torch's integer results
    i = torch.arange(-4, 4).reshape(8, 1) * torch.arange(1, 4)
    xi = st.shard(i, mesh_4x2(), ("data", None))
    for e in (2, 3, 0, 1, 0.5, -0.5):
        torch.testing.assert_close(xi.pow(e).cpu(), i.pow(e), equal_nan=True)
    # a bool tensor to a bool power stays bool, as torch's CPU kernel gives (its meta kernel: int64)
    b = i > 0
    for e in (True, False, 2):
        assert torch.equal(st.shard(b, mesh_4x2(), ("data", None)).pow(e).cpu(), b.pow(e)), e


def test_equal_python_scalars_share_one_input():
    """Uses of one value read one scalar input (XLA then merges them, as plain JAX merges equal
    constants); a pattern that changes stops sharing once, and every result stays torch's."""
    from shardtensor.graph import state
    from shardtensor.graph.capture import lower

    fresh_executable_cache()
    a, x = _x()

    def fn(t, s, u):
        return ((t * s + u) * s - u) / s

    y = fn(x, 0.5, 0.25)
    assert list(lower(state.pending_cells()).scalars["f"]) == [0.5, 0.25]  # five uses, two inputs
    st.sync()
    torch.testing.assert_close(y.cpu(), fn(a, 0.5, 0.25))
    for s, u in [(0.5, 0.5), (0.5, 0.25), (0.75, 0.75), (2.0, 3.0), (1.5, 1.5)]:
        y = fn(x, s, u)
        st.sync()
        torch.testing.assert_close(y.cpu(), fn(a, s, u))
    # (0.5, 0.25) first, then (0.5, 0.5) merges nothing new: a program with s and u apart serves all
    assert n("UncachedCompile") == 1, st.counters()

    def gn(t, s, u):
        return t * s - u * t

    for i, (s, u) in enumerate([(0.5, 0.5), (0.5, 0.5), (0.5, 0.25), (0.5, 0.5), (0.75, 0.75), (1.0, 2.0)]):
        y = gn(x, s, u)
        st.sync()
        torch.testing.assert_close(y.cpu(), gn(a, s, u))
        # shared while equal (one compile), apart once they differed (one more), never back and forth
        assert n("UncachedCompile") == 1 + (1 if i < 2 else 2), (i, st.counters())


def test_scalars_sharing_a_value_keep_zero_signs_and_eager_ops_apart():
    a, x = _x()
    y, z = x * 0.0, x * -0.0
    st.sync()
    assert torch.equal(torch.signbit(y.cpu()), torch.signbit(a * 0.0))
    assert torch.equal(torch.signbit(z.cpu()), torch.signbit(a * -0.0))
    with st.eager_mode(True):
        for lo, hi in [(0.25, 0.25), (-0.5, 0.5), (0.1, 0.1), (-1.0, 1.0)]:
            torch.testing.assert_close(x.clamp(lo, hi).cpu(), a.clamp(lo, hi))


def test_overwritten_buffers_are_donated():
    """Parameters overwritten by a step are donated: the previous step's arrays are freed."""
    ref, dev, ref_opt, dev_opt, batches, dev_batches = _mlp_setup()
    for x, y in dev_batches[:2]:
        with st.step():
            _step(dev, dev_opt, x, y)
    before = {name: p._cell.value for name, p in dev.named_parameters()}
    x, y = dev_batches[2]
    with st.step():
        _step(dev, dev_opt, x, y)
    for name, array in before.items():
        assert array.is_deleted(), f"{name}: the old value of an overwritten parameter was not donated"
    # and the values are right
    for x, y in batches[:3]:
        _step(ref, ref_opt, x, y)
    for (name, p), q in zip(dev.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_inputs_still_read_are_not_donated():
    """A tensor that a graph overwrites but that another live tensor still shares is not donated."""
    a, x = _x()
    keep = x.detach()  # shares the cell: sees the update
    y = x.clone()
    old_y = y * 1
    st.sync()
    y.mul_(2)
    st.sync()
    torch.testing.assert_close(old_y.cpu(), a)
    torch.testing.assert_close(y.cpu(), a * 2)
    x.add_(1)
    st.sync()
    torch.testing.assert_close(keep.cpu(), a + 1)


# --- eager mode -----------------------------------------------------------------------------------
def test_eager_mode_call_runs_each_op():
    a, x = _x()
    st.clear_counters()
    st.eager_mode(True)
    try:
        assert st.is_eager_mode()
        y = x * 2
        assert n("ExecuteReplicated") == 1
        z = y.sin()
        assert n("ExecuteReplicated") == 2
        w = z @ y.t()
        assert n("ExecuteReplicated") == 3
        y.add_(1)  # in place
        assert n("ExecuteReplicated") == 4
        st.sync()  # nothing is pending
        assert n("ExecuteReplicated") == 4
    finally:
        st.eager_mode(False)
    assert not st.is_eager_mode()
    torch.testing.assert_close(w.cpu(), (a * 2).sin() @ (a * 2).t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.cpu(), a * 2 + 1)
    assert n("ExecuteReplicated") == 4


def test_eager_mode_context_manager_restores_mode():
    a, x = _x()
    with st.eager_mode(True):
        assert st.is_eager_mode()
        y = x.exp()
        assert n("ExecuteReplicated") == 1
        with st.eager_mode(False):
            assert not st.is_eager_mode()
            z = y + 1
            assert n("ExecuteReplicated") == 1
        assert st.is_eager_mode()
    assert not st.is_eager_mode()
    torch.testing.assert_close(z.cpu(), a.exp() + 1)


def test_eager_mode_as_decorator():
    """eager_mode is a ContextDecorator: decorating must not switch the mode at definition time."""

    @st.eager_mode(True)
    def f(t):
        assert st.is_eager_mode()
        return t * 2

    assert not st.is_eager_mode()
    a, x = _x()
    torch.testing.assert_close(f(x).cpu(), a * 2)
    assert not st.is_eager_mode()


def test_switching_to_eager_runs_pending_work():
    a, x = _x()
    y = x + 1
    with st.eager_mode(True):
        assert n("ExecuteReplicated") == 1
    torch.testing.assert_close(y.cpu(), a + 1)


def test_eager_views_and_inplace_equal_torch():
    a = torch.randn(6, 4)
    ref = a.clone()
    with st.eager_mode(True):
        x = st.shard(a, mesh_4x2(), (None, "model"))
        x.t().mul_(2)
        x[:, 0] = 1
        x.view(-1).add_(1)
        x[:4].diagonal().zero_()
        s = x.sum(1)
    ref.t().mul_(2)
    ref[:, 0] = 1
    ref.view(-1).add_(1)
    ref[:4].diagonal().zero_()
    torch.testing.assert_close(x.cpu(), ref)
    torch.testing.assert_close(s.cpu(), ref.sum(1))


def test_eager_results_equal_lazy_and_torch():
    a, x = _x((8, 8), seed=4)
    fns = [lambda t: F.gelu(t) @ t.t(), lambda t: F.softmax(t, -1).cumsum(0), lambda t: F.layer_norm(t, (8,))]
    for fn in fns:
        with st.eager_mode(True):
            e = fn(x)
        lz = fn(x)
        torch.testing.assert_close(e.cpu(), fn(a), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lz.cpu(), fn(a), rtol=1e-5, atol=1e-5)


def test_eager_copy_from_the_host_into_a_whole_tensor_runs_no_program():
    # (cpu_tensor.to(st.device()) in eager mode: an empty tensor, then this copy) the upload becomes
    # the tensor's value, in the layout it had: replicated, or its spec's, padded where uneven
    host = torch.arange(30.0).reshape(6, 5)
    with st.eager_mode(True):
        plain = torch.zeros(6, 5, device=st.device())
        sharded = st.shard(torch.zeros(6, 5), mesh_4x2(), ("data", None))  # 6 rows over 4: padded storage
        runs = st.counter_value("ExecuteReplicated") or 0
        plain.copy_(host)
        sharded.copy_(host)
        assert (st.counter_value("ExecuteReplicated") or 0) == runs
        assert torch.equal(plain.cpu(), host) and torch.equal(sharded.cpu(), host)
        assert sharded.sharding_spec == st.shard(host, mesh_4x2(), ("data", None)).sharding_spec
        torch.testing.assert_close((sharded * 2 + plain).cpu(), host * 3, rtol=0, atol=0)
        moved = host.to(st.device())
        assert torch.equal(moved.cpu(), host)
