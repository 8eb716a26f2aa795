"""Parameter aliasing (donation) and programs that fail while they run.

On (the default, as PyTorch/XLA's ``XLA_ENABLE_PARAM_ALIASING``), a step writes the new parameters
and optimizer state into the buffers of the old ones; a program that then fails on the devices has
consumed them, and reading one raises ``st.ConsumedInputError``. Off (``XLA_ENABLE_PARAM_ALIASING=0``,
``SHARDTENSOR_ENABLE_PARAM_ALIASING=0`` or ``st.set_param_aliasing(False)``), no program donates
anything, in every mode, and any failure leaves every tensor with its value from before the step.

A failure while a program runs is injected at the call of the executable: the program's results are
copied through a program whose host callback raises on every device, so they fail asynchronously, as
an out-of-memory on the devices does (the real one, on some devices only, runs in a subprocess in
``bench/reliability.py``, which ``test_reliability.py`` runs). Every number is compared with eager
torch on CPU.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as JaxSpec

import shardtensor as st
from _training_helpers import ATOL, MLP, MLP_SPECS, RTOL, mesh_8, reset_state, shard_params
from shardtensor.graph import execute, inflight
from shardtensor.graph.state import pending_cells

ENVS = ("SHARDTENSOR_ENABLE_PARAM_ALIASING", "XLA_ENABLE_PARAM_ALIASING")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)
    reset_state()
    yield
    st.set_param_aliasing(None)
    inflight.forget()  # a failed case must not leave its failed run to the next one
    reset_state()


# --- the knob -------------------------------------------------------------------------------------
def test_the_environment_sets_the_default(monkeypatch):
    assert st.param_aliasing_enabled()  # on by default, as in PyTorch/XLA
    for text, expected in (
        ("0", False),
        ("false", False),
        (" OFF ", False),
        ("no", False),
        ("1", True),
        ("TRUE", True),
        ("yes", True),
        ("2", True),
    ):
        monkeypatch.setenv("XLA_ENABLE_PARAM_ALIASING", text)
        assert st.param_aliasing_enabled() is expected, text
    monkeypatch.setenv("XLA_ENABLE_PARAM_ALIASING", "0")
    monkeypatch.setenv("SHARDTENSOR_ENABLE_PARAM_ALIASING", "1")  # shardtensor's own name wins
    assert st.param_aliasing_enabled()
    monkeypatch.setenv("SHARDTENSOR_ENABLE_PARAM_ALIASING", "")  # empty: as if unset
    assert not st.param_aliasing_enabled()


@pytest.mark.parametrize("name", ENVS)
def test_a_bad_value_names_the_variable(monkeypatch, name):
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=rf"^{name}='maybe' is not a boolean: set it to 1 .* or 0"):
        st.param_aliasing_enabled()
    x = st.shard(torch.ones(8, 4), mesh_8(), ("d", None))
    y = x * 2
    with pytest.raises(ValueError, match=name):
        st.sync()  # refused before anything runs: y is still pending
    monkeypatch.delenv(name)
    torch.testing.assert_close(y.cpu(), torch.full((8, 4), 2.0))


def test_set_param_aliasing_returns_the_previous_setting(monkeypatch):
    assert st.set_param_aliasing(False) is True
    monkeypatch.setenv("XLA_ENABLE_PARAM_ALIASING", "1")
    assert not st.param_aliasing_enabled()  # the call wins over the environment
    assert st.set_param_aliasing(True) is False
    monkeypatch.setenv("XLA_ENABLE_PARAM_ALIASING", "0")
    assert st.set_param_aliasing(None) is True
    assert not st.param_aliasing_enabled()  # back to the environment's
    with pytest.raises(TypeError, match="expects True, False or None"):
        st.set_param_aliasing("0")  # type: ignore[arg-type]


# --- off: nothing is donated, in any mode ----------------------------------------------------------
def _state_arrays(model, opt):
    """The stored arrays of every parameter and optimizer state tensor (all computed)."""
    tensors = list(model.parameters())
    for p in model.parameters():
        tensors += [v for v in opt.state.get(p, {}).values() if isinstance(v, st.ShardedTensor)]
    return [t._cell.value for t in tensors]


def _train_and_watch(mode, steps=3):
    """Train an MLP ``steps`` steps in ``mode`` beside eager torch (the parameters must end equal);
    returns (losses, reference losses, whether any old parameter or optimizer state buffer was
    deleted)."""
    mesh = mesh_8()
    torch.manual_seed(0)
    ref = MLP()
    dev = copy.deepcopy(ref).to(st.device())
    if mode == "fsdp":
        from shardtensor.fsdp import FSDPv2

        mesh = st.Mesh(range(8), (8, 1), ("fsdp", "model"))
        dev = FSDPv2(dev, mesh=mesh)
    else:
        shard_params(dev, mesh, MLP_SPECS)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(dev.parameters(), lr=0.1, momentum=0.9)
    forward = torch.compile(dev, backend="shardtensor") if mode == "dynamo" else dev

    def step(x, y):
        loss = F.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    compiled = st.compile(step)
    g = torch.Generator().manual_seed(1)
    losses, ref_losses, deleted = [], [], False
    for _ in range(steps):
        x, y = torch.randn(16, 16, generator=g), torch.randint(0, 5, (16,), generator=g)
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
        xs, ys = st.shard(x, mesh, (mesh.axis_names[0], None)), st.shard(y, mesh, (mesh.axis_names[0],))
        st.sync()
        before = _state_arrays(dev, opt)
        if mode == "compile":
            loss = compiled(xs, ys)
        elif mode == "eager":
            with st.eager_mode(True):
                loss = step(xs, ys)
        else:
            with st.step():
                loss = step(xs, ys)
        losses.append(loss.item())
        deleted = deleted or any(a.is_deleted() for a in before)
    for p, q in zip(dev.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu().reshape(q.shape), q, rtol=RTOL, atol=ATOL)
    return losses, ref_losses, deleted


@pytest.fixture
def donations(monkeypatch):
    """The number of donated inputs of every program called (whatever the path that calls it)."""
    seen: list[int] = []
    real, real_prepared = execute.call_executable, execute.call_prepared  # (frozen replays call the second)

    def counting(fn, arrays, scalars):
        seen.append(len(fn.program.donated))
        return real(fn, arrays, scalars)

    def counting_prepared(fn, *arguments):
        seen.append(len(fn.program.donated))
        return real_prepared(fn, *arguments)

    monkeypatch.setattr(execute, "call_executable", counting)
    monkeypatch.setattr(execute, "call_prepared", counting_prepared)
    return seen


@pytest.mark.parametrize("mode", ["lazy", "eager", "compile", "dynamo", "fsdp"])
def test_off_no_program_donates_anything(mode, donations):
    st.set_param_aliasing(False)
    replays = st.counter_value("CompileReplay") or 0
    losses, ref_losses, deleted = _train_and_watch(mode, steps=4 if mode == "compile" else 3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    assert not deleted, "an old parameter or optimizer state buffer was donated"
    assert donations and not any(donations), donations
    if mode == "compile":
        assert (st.counter_value("CompileReplay") or 0) > replays  # frozen replays too


def test_on_the_same_step_donates(donations):
    """The control: with aliasing on, the lazy step donates the old parameters and optimizer state."""
    losses, ref_losses, deleted = _train_and_watch("lazy")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    assert deleted and any(donations)


def test_switching_never_reuses_a_donating_executable():
    w = st.shard(torch.ones(16, 4), mesh_8(), ("d", None))
    st.sync()
    compiles = []
    for enabled in (True, False, True, False):
        st.set_param_aliasing(enabled)
        old = w._cell.value
        uncached = st.counter_value("UncachedCompile") or 0
        w.mul_(2)
        st.sync()
        compiles.append((st.counter_value("UncachedCompile") or 0) - uncached)
        assert old.is_deleted() is enabled
    assert compiles == [1, 1, 0, 0]  # one executable per setting, each reused
    torch.testing.assert_close(w.cpu(), torch.full((16, 4), 16.0))


def test_memory_analysis_counts_no_donation_when_off():
    """XLA's memory analysis of an SGD step: with aliasing off, nothing is written into donated
    inputs, so the step needs its outputs on top of its arguments."""
    analyses = {}
    for enabled in (True, False):
        st.set_param_aliasing(enabled)
        torch.manual_seed(0)
        model = nn.Linear(64, 64).to(st.device())
        st.mark_sharding(model.weight, mesh_8(), ("d", None))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):  # the second step overwrites the momentum buffers too
            model(torch.randn(8, 64).to(st.device())).sum().backward()
            opt.step()
            execution = execute.run_cells(pending_cells())
        analyses[enabled] = execution.executable.memory
    on, off = analyses[True], analyses[False]
    assert off.reused == 0 and "- 0 B written into donated inputs" in off.describe()
    assert on.reused >= 2 * (64 * 64 // 8) * 4  # weight and its momentum, a shard of each per device
    assert off.peak > on.peak


# --- failures while a program runs ------------------------------------------------------------------
def _fail_here():
    raise RuntimeError("injected device fault")


@functools.cache
def _poisoner(sharding):
    """A jitted copy to ``sharding`` whose host callback raises on every device of its mesh (no
    collective, so no device is left waiting for another)."""

    def copy_failing(x):
        fault = jax.shard_map(
            lambda: jax.pure_callback(_fail_here, jax.ShapeDtypeStruct((), jnp.int8)),
            mesh=sharding.mesh,
            in_specs=(),
            out_specs=JaxSpec(),
            check_vma=False,
        )()
        return x + fault.astype(x.dtype)

    return jax.jit(copy_failing, out_shardings=sharding)


def _poison(array):
    sharding = array.sharding
    if not isinstance(sharding, NamedSharding):  # (one device)
        sharding = NamedSharding(jax.sharding.Mesh(np.array(list(sharding.device_set)), ("one",)), JaxSpec())
    return _poisoner(sharding)(array)


def _reset_runtime_tokens():
    """JAX keeps each device's last host-callback token; a failed one would make jax's exit hook
    complain. One good callback program on each device replaces them."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
    ok = jax.shard_map(
        lambda: jax.pure_callback(lambda: np.int8(0), jax.ShapeDtypeStruct((), jnp.int8)),
        mesh=mesh,
        in_specs=(),
        out_specs=JaxSpec(),
        check_vma=False,
    )
    jax.jit(ok)().block_until_ready()


@contextlib.contextmanager
def failing_runs(monkeypatch, at_once=False):
    """Every program called inside fails on the devices after it ran (its results, check rows
    included, become errors; with ``at_once``, the call raises after consuming its donated inputs)."""
    real, real_prepared = execute.call_executable, execute.call_prepared  # (frozen replays call the second)

    def fail(outs):
        if at_once:
            raise RuntimeError("RESOURCE_EXHAUSTED: injected failure at dispatch")
        poisoned = execute.Results(_poison(o) for o in outs)
        poisoned.check_rows = None if outs.check_rows is None else _poison(outs.check_rows)
        return poisoned

    monkeypatch.setattr(execute, "call_executable", lambda fn, arrays, scalars: fail(real(fn, arrays, scalars)))
    monkeypatch.setattr(execute, "call_prepared", lambda fn, *arguments: fail(real_prepared(fn, *arguments)))
    try:
        yield
    finally:
        monkeypatch.setattr(execute, "call_executable", real)
        monkeypatch.setattr(execute, "call_prepared", real_prepared)
        _reset_runtime_tokens()


def _setup(seed=0):
    """(mesh, CPU model, device model, CPU optimizer, device optimizer); the ``fc2`` layer is frozen
    (the step only reads it)."""
    mesh = mesh_8()
    torch.manual_seed(seed)
    ref = MLP()
    dev = shard_params(copy.deepcopy(ref).to(st.device()), mesh, MLP_SPECS)
    for model in (ref, dev):
        model.fc2.requires_grad_(False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    dev_opt = torch.optim.SGD(dev.parameters(), lr=0.1, momentum=0.9)
    return mesh, ref, dev, ref_opt, dev_opt


def _step_fn(model, opt):
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def _device_step(mode, dev, opt, mesh):
    step = _step_fn(dev, opt)
    compiled = st.compile(step)

    def run(x, y):
        xs, ys = st.shard(x, mesh, ("d", None)), st.shard(y, mesh, ("d",))
        if mode == "compile":
            return compiled(xs, ys)
        if mode == "eager":
            with st.eager_mode(True):
                return step(xs, ys)
        with st.step():
            loss = step(xs, ys)
        return loss

    return run


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 16, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(n)]


def _state(model, opt):
    """name -> tensor: the trained parameters and their optimizer state."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[name] = p
            out.update({f"{name}.{k}": v for k, v in opt.state.get(p, {}).items() if isinstance(v, torch.Tensor)})
    return out


def _cpu_state(model, opt):
    return {k: v.detach().cpu().clone() for k, v in _state(model, opt).items()}


def _assert_state(dev, dev_opt, expected):
    got = _cpu_state(dev, dev_opt)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


def _train_alike(device_step, ref, ref_opt, dev, dev_opt, batches):
    ref_step = _step_fn(ref, ref_opt)
    for x, y in batches:
        torch.testing.assert_close(device_step(x, y).cpu(), ref_step(x, y), rtol=RTOL, atol=ATOL)
    _assert_state(dev, dev_opt, _cpu_state(ref, ref_opt))


def _warm_up(mode, monkeypatch=None):
    """Two good steps on both models (three for st.compile: trace, trace and freeze, replay)."""
    st.set_param_aliasing(mode[1])
    mesh, ref, dev, ref_opt, dev_opt = _setup()
    device_step = _device_step(mode[0], dev, dev_opt, mesh)
    batches = _batches(6)
    _train_alike(device_step, ref, ref_opt, dev, dev_opt, batches[: 3 if mode[0] == "compile" else 2])
    return ref, dev, ref_opt, dev_opt, device_step, batches


@pytest.mark.parametrize("mode", ["lazy", "compile"])
def test_off_a_failure_while_running_keeps_every_input(mode, monkeypatch):
    ref, dev, ref_opt, dev_opt, device_step, batches = _warm_up((mode, False))
    replays = st.counter_value("CompileReplay") or 0
    before = _cpu_state(dev, dev_opt)
    x, y = batches[3]
    with failing_runs(monkeypatch):
        loss = device_step(x, y)  # dispatched: the failure shows only on the devices
    if mode == "compile":
        assert (st.counter_value("CompileReplay") or 0) == replays + 1  # a frozen replay failed
    with pytest.raises(
        st.ExecutionFailedError,
        match=r"injected device fault\. The \d+ tensor\(s\) it was updating "
        r"in place \(parameters, optimizer state\) keep their values from before it",
    ) as failure:
        loss.item()
    assert "test_param_aliasing.py:" in str(failure.value)  # the user's line that ran it
    assert not isinstance(failure.value, st.ConsumedInputError)
    with pytest.raises(st.ExecutionFailedError, match="injected device fault"):
        loss.item()  # the failed result keeps raising
    _assert_state(dev, dev_opt, before)
    # the step is retried with the same batch and training goes on exactly as in eager torch
    _train_alike(device_step, ref, ref_opt, dev, dev_opt, batches[3:5])


def test_off_a_failure_found_at_the_next_step_drops_what_was_recorded_from_it(monkeypatch):
    """Nobody reads the failed step's loss: the next step records its update from the failed results
    and raises at its sync; every parameter is back at its value before the failed step."""
    ref, dev, ref_opt, dev_opt, device_step, batches = _warm_up(("lazy", False))
    before = _cpu_state(dev, dev_opt)
    with failing_runs(monkeypatch):
        lost = device_step(*batches[3])
    with pytest.raises(st.ExecutionFailedError, match="keep their values from before it"):
        device_step(*batches[4])
    _assert_state(dev, dev_opt, before)
    with pytest.raises(st.ExecutionFailedError, match="injected device fault"):
        lost.item()
    _train_alike(device_step, ref, ref_opt, dev, dev_opt, batches[3:5])


def test_off_a_failure_inside_an_eager_optimizer_step_keeps_every_input(monkeypatch):
    """Eager mode runs each op alone: the first update of the optimizer fails on the devices, the next
    op finds it and raises; the half-updated buffers are back at their values before the step."""
    ref, dev, ref_opt, dev_opt, _, batches = _warm_up(("eager", False))
    x, y = batches[3]
    ref_step = _step_fn(ref, ref_opt)
    with st.eager_mode(True):
        loss = F.cross_entropy(dev(st.shard(x, mesh_8(), ("d", None))), st.shard(y, mesh_8(), ("d",)))
        loss.backward()
        before = _cpu_state(dev, dev_opt)
        with failing_runs(monkeypatch), pytest.raises(st.ExecutionFailedError, match="keep their values"):
            dev_opt.step()
        _assert_state(dev, dev_opt, before)
        dev_opt.step()  # retried: the gradients are still there
        dev_opt.zero_grad()
    torch.testing.assert_close(loss.detach().cpu(), ref_step(x, y), rtol=RTOL, atol=ATOL)
    _assert_state(dev, dev_opt, _cpu_state(ref, ref_opt))


@pytest.mark.parametrize("mode", ["lazy", "compile"])
def test_on_a_consumed_input_says_so_when_read(mode, monkeypatch):
    ref, dev, ref_opt, dev_opt, device_step, batches = _warm_up((mode, True))
    x, y = batches[3]
    with failing_runs(monkeypatch):
        loss = device_step(x, y)
    program = "compiled function step" if mode == "compile" else r"a program of \d+ ops"
    with pytest.raises(
        st.ExecutionFailedError,
        match=rf"^{program} .*\(run from test_param_aliasing\.py:\d+\) failed "
        r"while it ran on the devices: .*injected device fault\. It had consumed the buffers of "
        r"\d+ tensor\(s\)",
    ):
        loss.item()
    state = _state(dev, dev_opt)
    for name, t in state.items():
        with pytest.raises(st.ConsumedInputError) as consumed:
            t.cpu()
        text = str(consumed.value)
        assert text.startswith(f"this tensor's value (a {tuple(t.shape)} torch.float32 tensor) was consumed by"), text
        for part in (
            "failed while it ran on the devices",
            "injected device fault",
            "test_param_aliasing.py:",
            "checkpoint",
            "XLA_ENABLE_PARAM_ALIASING=0",
            "st.set_param_aliasing(False)",
        ):
            assert part in text, (name, part, text)
        assert "deleted" not in text
    # what the step only read is intact
    torch.testing.assert_close(dev.fc2.weight.cpu(), ref.fc2.weight)
    mesh = mesh_8()
    xs = st.shard(x, mesh, ("d", None))
    torch.testing.assert_close(xs.cpu(), x)
    # restored from a checkpoint (the CPU model's state), training goes on as in eager torch
    dev.load_state_dict(ref.state_dict())
    dev_opt.load_state_dict(ref_opt.state_dict())
    _train_alike(device_step, ref, ref_opt, dev, dev_opt, batches[3:5])


def test_on_a_failure_found_later_still_names_the_consumed_tensors(monkeypatch):
    """Nobody reads the failed step's loss: the next step raises (at its sync if the failure is seen
    by then, else when its own loss, computed from the failed results, is read), and every updated
    tensor says it was consumed."""
    ref, dev, ref_opt, dev_opt, device_step, batches = _warm_up(("lazy", True))
    with failing_runs(monkeypatch):
        device_step(*batches[3])
    with pytest.raises(st.ExecutionFailedError, match="injected device fault"):
        device_step(*batches[4]).item()
    for t in _state(dev, dev_opt).values():
        with pytest.raises(st.ConsumedInputError, match="injected device fault"):
            t.cpu()
    torch.testing.assert_close(dev.fc2.weight.cpu(), ref.fc2.weight)


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("mode", ["lazy", "compile"])
def test_a_call_that_fails_after_taking_its_inputs(mode, enabled, monkeypatch):
    """The call raises at once, after consuming its donated inputs: never "Array has been deleted"."""
    ref, dev, ref_opt, dev_opt, device_step, batches = _warm_up((mode, enabled))
    before = _cpu_state(dev, dev_opt)
    with failing_runs(monkeypatch, at_once=True), pytest.raises(RuntimeError, match="injected failure at dispatch"):
        device_step(*batches[3])
    if not enabled:
        _assert_state(dev, dev_opt, before)
        _train_alike(device_step, ref, ref_opt, dev, dev_opt, batches[3:5])
        return
    for t in _state(dev, dev_opt).values():
        with pytest.raises(st.ConsumedInputError, match=r"was consumed by .* RESOURCE_EXHAUSTED: injected failure"):
            t.cpu()
    torch.testing.assert_close(dev.fc2.weight.cpu(), ref.fc2.weight)


@pytest.mark.parametrize("capturable", [False, True])
def test_each_update_is_written_into_its_own_tensors_buffer(capturable):
    """jit gives each output the first donated input of its shape and dtype: a float32 parameter and
    its AdamW moments (one shape, one dtype) must be ordered so that each update lands in the buffer
    of the tensor it overwrites (else XLA copies them all every step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).to(st.device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True, capturable=capturable)
    x = torch.randn(4, 8).to(st.device())

    def step():
        with st.step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def buffers():
        tensors = [p for p in model.parameters()]
        tensors += [opt.state[p][name] for p in model.parameters() for name in ("exp_avg", "exp_avg_sq")]
        return [tuple(s.data.unsafe_buffer_pointer() for s in t._cell.value.addressable_shards) for t in tensors]

    step()  # the optimizer state exists from here
    st.sync()
    before = buffers()
    step()
    st.sync()
    assert buffers() == before


def test_a_new_value_of_a_donated_kind_takes_the_buffer_needed_last():
    """Unit check of the pairing: outputs m', new, W', v' (one kind) over donated leaves W, m, v."""
    from shardtensor.graph.program import _paired_order

    class Cell:
        def __init__(self):
            self.shape, self.dtype = (4, 4), torch.float32

    w, m, v, new = Cell(), Cell(), Cell(), Cell()
    leaf_cells = [w, m, v]
    outputs = [(None, None, None)] * 4
    # jit pairs in order: m' <- m, new <- v (needed last; v' then gets a new buffer), W' <- W
    assert _paired_order([0, 1, 2], leaf_cells, [m, new, w, v], outputs) == [1, 2, 0]
    assert _paired_order([0, 1, 2], leaf_cells, [m, w, v], outputs) == [1, 0, 2]
    other = Cell()
    other.shape = (2,)  # another kind: never takes these buffers
    assert _paired_order([0, 1, 2], leaf_cells, [other, v, m, w], outputs) == [2, 1, 0]
