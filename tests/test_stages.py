"""Issue 50, items 4 and 5: a compiled step's stages, as JAX's. ``step.lower(*args)`` gives the
program a call runs (StableHLO with its shardings) without running it and without changing any
state (parameters, gradients, optimizer state, random keys: the next real call still gives eager
torch's result); ``.compile()`` gives the optimized HLO, XLA's memory and cost analysis and the
collectives with their bytes; ``st.explain(step, *args)`` prints them; a frozen step's lowered
program is the one its replays run; ``retarget``/``compile(devices=...)`` compiles it for other
devices (a TPU topology where libtpu is installed); bad input raises clear errors."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.experimental import topologies

import shardtensor as st
from _training_helpers import MLP, MLP_SPECS, Traces, make_pair, mesh_8, mlp_batches, reset_state, shard_params
from shardtensor import stages
from shardtensor.compiler import _key
from shardtensor.graph.state import UnexpectedExecutionError


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    st.clear_counters()
    yield
    reset_state()


def _step(model, opt, x, y):
    opt.zero_grad()  # (at the start: the gradients of the last call stay, and lower must keep them)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _setup():
    ref, dev = make_pair(MLP)
    mesh = mesh_8()
    shard_params(dev, mesh, MLP_SPECS)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(dev.parameters(), lr=1e-2)
    train_step = st.compile(lambda x, y: _step(dev, opt, x, y), name="train_step")
    batches = mlp_batches(4, torch.Generator().manual_seed(0))
    return ref, dev, ref_opt, opt, train_step, batches, mesh


def _on(mesh, x, y):
    return st.shard(x, mesh, ("d", None)), st.shard(y, mesh, ("d",))


def _snapshot(model, opt):
    """Each parameter, gradient and optimizer state entry (tensors by identity and value)."""
    params = [(p, p.detach().cpu().clone()) for p in model.parameters()]
    grads = [(p.grad, None if p.grad is None else p.grad.cpu().clone()) for p in model.parameters()]
    state = {
        id(p): {k: (v, v.cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
        for p, s in opt.state.items()
    }
    return params, grads, state, [dict(g) for g in opt.param_groups]


def _assert_same(before, model, opt):
    params, grads, state, groups = before
    for (p, value), q in zip(params, model.parameters()):
        assert p is q
        torch.testing.assert_close(q.detach().cpu(), value, rtol=0, atol=0)
    for (g, value), q in zip(grads, model.parameters()):
        assert q.grad is g
        if g is not None:
            torch.testing.assert_close(g.cpu(), value, rtol=0, atol=0)
    assert {id(p) for p in opt.state} == set(state)
    for p, s in opt.state.items():
        assert s.keys() == state[id(p)].keys()
        for k, v in s.items():
            old, value = state[id(p)][k]
            assert v is old
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(v.cpu(), value, rtol=0, atol=0)
    assert [dict(g) for g in opt.param_groups] == groups


def test_lower_changes_nothing_and_calls_still_match_eager():
    ref, dev, ref_opt, opt, train_step, batches, mesh = _setup()
    cpu_rng = torch.get_rng_state()
    texts = []
    for i, (x, y) in enumerate(batches):
        xs, ys = _on(mesh, x, y)
        before = _snapshot(dev, opt)
        lowered = train_step.lower(xs, ys)
        texts.append(lowered.as_text())
        compiled = lowered.compile()
        _assert_same(before, dev, opt)  # no parameter, gradient or optimizer state changed
        assert torch.equal(torch.get_rng_state(), cpu_rng)
        assert compiled.memory().total > 0 and any(o.label == "output 0" for o in compiled.outputs)
        if i == 0:  # the first call makes Adam's state
            assert not opt.state and all(p.grad is None for p in dev.parameters())
        del before  # (a gradient held elsewhere would not be overwritten by a replay: it traces instead)
        loss = train_step(xs, ys)
        ref_loss = _step(ref, ref_opt, x, y)
        torch.testing.assert_close(loss.cpu(), ref_loss, rtol=1e-5, atol=1e-6)
        for p, q in zip(ref.parameters(), dev.parameters()):
            torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-4, atol=1e-5)
    assert st.counter_value("CompileFrozen") == 1  # lowering did not keep the step from freezing
    assert texts[0] == texts[1]  # (Adam's first state made before the step records: step 2's program)
    # the frozen program: no Python runs, and it is the program a recording gives in the same state
    lowered = train_step.lower(xs, ys)
    assert lowered.frozen and "frozen" in repr(lowered)
    flat, _ = _key((xs, ys), {})
    recorded = stages.lower_call(train_step.fn, (xs, ys), {}, flat, name="again")
    assert not recorded.frozen
    assert lowered.as_text() == recorded.as_text()
    assert [o.shape for o in lowered.outputs] == [o.shape for o in recorded.outputs]
    before = _snapshot(dev, opt)
    assert lowered.compile().collectives() == recorded.compile().collectives()
    _assert_same(before, dev, opt)
    del before
    traces = Traces()
    x, y = batches[0]
    loss = train_step(*_on(mesh, x, y))  # still a replay: recording the step again left it frozen
    assert len(traces) == 0
    torch.testing.assert_close(loss.cpu(), _step(ref, ref_opt, x, y), rtol=1e-5, atol=1e-6)


def test_random_key_is_taken_back():
    mesh = mesh_8()
    x = st.shard(torch.ones(16, 8), mesh, ("d", None))
    noisy = st.compile(lambda t: F.dropout(t, 0.5) + torch.randn(t.shape, device=t.device))
    reseeds = st.compile(lambda t: (st.manual_seed(3), t + torch.randn(t.shape, device=t.device))[1])
    st.manual_seed(7)
    first = noisy(x).cpu()
    for lower in (noisy.lower, reseeds.lower):
        st.manual_seed(7)
        lower(x).compile()  # (the seed is applied while it records: it is given back unapplied)
        assert torch.equal(noisy(x).cpu(), first)
        noisy.lower(x)
        second = noisy(x).cpu()  # (the key after a draw: taken back too)
        st.manual_seed(7)
        noisy(x)
        assert torch.equal(noisy(x).cpu(), second)


def test_fsdp_matmul_text_collectives_memory_and_explain(capsys):
    mesh = mesh_8()
    w = st.shard(torch.randn(64, 32), mesh, ("d", None)).requires_grad_()  # FSDP: rows over the mesh
    x = st.shard(torch.randn(16, 64), mesh, ("d", None))  # the batch over the mesh

    @st.compile
    def fsdp_step(x):
        loss = (x @ w).square().mean()
        loss.backward()
        return loss.detach()

    lowered = fsdp_step.lower(x)
    text = lowered.as_text()
    assert "sdy.sharding" in text or "mhlo.sharding" in text
    assert '{"d"}' in text or "devices=[8" in text  # the inputs' shardings
    assert "func.func public @main" in text
    assert lowered.cost_analysis()["flops"] > 0
    compiled = lowered.compile()
    collectives = compiled.collectives()
    assert collectives["all-gather"].count >= 1  # w gathered for the matmul
    gathered = [op.bytes for op in compiled.collective_ops() if op.kind == "all-gather"]
    assert 64 * 32 * 4 in gathered  # the whole weight, float32, on each device
    # w's gradient is summed over the batch's shards: reduce-scattered (or all-reduced) back to rows
    assert collectives["reduce-scatter"].count + collectives["all-reduce"].count >= 1
    memory = compiled.memory()
    assert memory.argument >= (64 * 32 + 16 * 64) * 4 // 8 and memory.temp > 0 and memory.total > 0
    assert compiled.cost_analysis()["flops"] > 0
    assert "HloModule" in compiled.as_text()
    assert w.grad is None  # nothing ran
    text = str(compiled)
    assert "fsdp_step" in text and "all-gather" in text and "memory:" in text

    ex = st.explain(fsdp_step, x)
    print(ex)
    out = capsys.readouterr().out
    assert "fsdp_step" in out and "memory:" in out and "flops per device" in out and "all-gather" in out
    assert ex.memory == memory and ex.collectives == collectives
    assert [o.shape for o in ex.outputs if o.label == "output 0"] == [()]
    assert any(o.label == "new pending value" and o.shape == (64, 32) for o in ex.outputs)  # w.grad
    assert st.explain(lowered).memory == memory and "memory:" in ex._repr_html_()
    assert w.grad is None
    fsdp_step(x)
    torch.testing.assert_close(w.grad.cpu(), 2 * x.cpu().t() @ (x.cpu() @ w.detach().cpu()) / (16 * 32))


def test_retarget_to_other_devices():
    mesh = st.Mesh(range(8), (4, 2), ("data", "model"))
    x = st.shard(torch.randn(8, 16), mesh, ("data", None))
    w = st.shard(torch.randn(16, 12), mesh, (None, "model"))
    step = st.compile(lambda x, w: torch.relu(x @ w).sum(0), name="mm")
    lowered = step.lower(x, w)
    here = lowered.compile()
    devices = list(reversed(jax.devices()))
    there = lowered.compile(devices=devices)
    assert there.target is not None and there.target.description == "8 cpu devices"
    assert set(there.target.mesh.devices.flat) == set(devices)
    assert tuple(there.target.mesh.axis_names) == ("data", "model")
    assert there.memory() == here.memory() and there.collectives() == here.collectives()
    assert "for 8 cpu devices" in str(there) and "for 8 cpu devices" in repr(lowered.retarget(devices=devices))
    assert "mm for 8 cpu devices" in str(st.explain(there))
    described = topologies.TopologyDescription(devices)  # (what get_topology_desc returns)
    assert lowered.compile(topology=described).collectives() == here.collectives()
    grid = jax.sharding.Mesh(there.target.mesh.devices, ("a", "b"))  # a mesh of them: its layout, our names
    assert lowered.compile(devices=grid).target.mesh.axis_names == ("data", "model")


def test_bad_input_raises_clear_errors():
    mesh = mesh_8()
    x = st.shard(torch.randn(16, 4), mesh, ("d", None))
    w = st.shard(torch.randn(4, 4), mesh, (None, None))

    def reads(x):
        w.mul_(2)
        if (x @ w).sum().item() > 0:  # a value read on the host: more than one program
            return x * 2
        return x

    before = w.cpu()
    with pytest.raises(UnexpectedExecutionError, match=r"reads\.lower\(\.\.\.\).*Move that read out"):
        st.compile(reads).lower(x)
    assert torch.equal(w.cpu(), before)  # the in-place update before the read was taken back

    with pytest.raises(ValueError, match="recorded nothing"):
        st.compile(lambda t: 3, name="nothing").lower(x)

    lowered = st.compile(lambda t: t + 1, name="plus").lower(x)
    with pytest.raises(TypeError, match="one of the two"):
        lowered.retarget()
    with pytest.raises(TypeError, match="one of the two"):
        lowered.compile("v5e:2x4", devices=jax.devices())
    with pytest.raises(ValueError, match="mesh of 8 devices.*has 4.*SHARDTENSOR_CPU_DEVICES=4"):
        lowered.compile(devices=jax.devices()[:4])
    with pytest.raises(TypeError, match="jax devices"):
        lowered.compile(devices=[0, 1])
    with pytest.raises(ValueError, match=r"shape \(8,\).*has shape \(4, 2\)"):
        lowered.compile(devices=jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b")))
    with pytest.raises(TypeError, match="no further arguments"):
        st.explain(lowered, x)
    try:
        topologies.get_topology_desc("v5e:2x4", "tpu")
    except RuntimeError:  # no libtpu here: the error says what is missing and the way round
        with pytest.raises(RuntimeError, match="needs libtpu.*devices="):
            lowered.compile("v5e:2x4")
    except Exception:  # noqa: BLE001  (libtpu here, wanting more than a name: nothing to check on CPU)
        pass


def test_a_tpu_topology_compile_is_refused_rather_than_abort_the_process(monkeypatch):
    """libtpu aborts the process compiling an exported step for a TPU topology (a CHECK failure in
    Shardy's import): a user's process gets an exception instead, unless it asks to try."""
    mesh = mesh_8()
    x = st.shard(torch.randn(16, 4), mesh, ("d", None))
    lowered = st.compile(lambda t: t * 2, name="double").lower(x)
    on_tpu = lowered.retarget(devices=list(jax.devices()))
    on_tpu.target = on_tpu.target._replace(platform="tpu")  # (as a topology's target says)
    monkeypatch.delenv(stages.TRY_TPU_EXPORT, raising=False)
    with pytest.raises(RuntimeError, match=r"double: compiling for 8 cpu devices is refused: libtpu aborts.*TRY_TPU"):
        on_tpu.compile()
    monkeypatch.setenv(stages.TRY_TPU_EXPORT, "1")  # (here the devices are CPUs: it compiles)
    assert on_tpu.compile().memory().total > 0


def test_tpu_aot_bench_runs_on_cpu_devices():
    """bench/tpu_aot.py (the chip's ahead-of-time comparison) at tiny sizes, one simulated slice:
    a failure there costs a chip call."""
    pytest.importorskip("transformers")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root))
    env["XLA_FLAGS"] = os.environ.get("SHARDTENSOR_TEST_COMPILE_FLAGS", "")
    result = subprocess.run(
        [sys.executable, str(root / "bench" / "tpu_aot.py"), "--cpu-smoke", "--slice", "cpu4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "== cpu4: 4 chips" in result.stdout and "within 1.05x of JAX" in result.stdout
