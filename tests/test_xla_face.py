"""Issue 49: the torch_xla face (``shardtensor.xla.install()``) in this process: ``'xla'`` devices are
``st.device()``, PyTorch/XLA's names answer as PyTorch/XLA does in SPMD mode, results equal eager
torch's, and what the face cannot do raises saying why."""

import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
import shardtensor.xla
from _training_helpers import reset_state


@pytest.fixture(scope="module", autouse=True)
def face():
    shardtensor.xla.install()
    yield
    shardtensor.xla.uninstall()


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ("XLA_USE_SPMD", "SHARDTENSOR_USE_SPMD"):
        monkeypatch.delenv(name, raising=False)
    reset_state()
    yield
    reset_state()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


# --------------------------------------------------------------------------- 'xla' devices


def test_every_spelling_of_the_xla_device_is_st_device():
    import torch_xla
    import torch_xla.core.xla_model as xm

    assert torch_xla.device() == xm.xla_device() == st.device()
    x = torch.arange(6.0).reshape(2, 3)
    made = [
        x.to("xla"),
        x.to("xla:0"),
        x.to(torch.device("xla")),
        x.to(device="xla", dtype=torch.float64),
        torch.tensor(x.tolist(), device="xla"),
        torch.as_tensor(x, device=torch.device("xla", 0)),
        x.new_tensor(x.tolist(), device="xla"),
    ]
    for t in made:
        assert isinstance(t, st.ShardedTensor) and t.device == torch_xla.device()
        torch.testing.assert_close(t.cpu(), x, check_dtype=False)
    assert made[3].dtype == torch.float64
    for t, want in [
        (torch.zeros(2, 3, device="xla"), torch.zeros(2, 3)),
        (torch.ones(4, device="xla:0", dtype=torch.int64), torch.ones(4, dtype=torch.int64)),
        (torch.arange(5, device="xla"), torch.arange(5)),
        (torch.full((2,), 7.0, device=torch.device("xla")), torch.full((2,), 7.0)),
        (torch.eye(3, device="xla"), torch.eye(3)),
        (x.new_zeros(3, device="xla"), torch.zeros(3)),
    ]:
        assert isinstance(t, st.ShardedTensor)
        torch.testing.assert_close(t.cpu(), want)


def test_a_module_moved_to_xla_trains_as_in_eager_torch():
    ref, model = _model(), _model()
    model.to("xla")
    assert all(isinstance(p, st.ShardedTensor) for p in model.parameters())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(8, 16, requires_grad=True)
    for _ in range(3):
        for m, o, inp in ((ref, opt_ref, x), (model, opt, x.to("xla"))):
            o.zero_grad()
            m(inp).pow(2).mean().backward()
            o.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, msg=name)
    # autograd through .to('xla') reaches the CPU leaf
    x.grad = None
    (x.to("xla") * 3).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


# --------------------------------------------------------------------------- runtime answers


def test_runtime_and_xla_model_answer_as_pytorch_xla_in_spmd_mode():
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    assert not xr.is_spmd()
    xr.use_spmd()
    assert xr.is_spmd() and os.environ["XLA_USE_SPMD"] == "1"
    assert xr.global_runtime_device_count() == xr.addressable_runtime_device_count() == 8
    assert xr.world_size() == xr.global_device_count() == xr.addressable_device_count() == 1
    assert xr.global_ordinal() == xr.local_ordinal() == xm.get_local_ordinal() == 0
    assert xm.is_master_ordinal() and xm.is_master_ordinal(local=False)
    assert xr.device_type() == "CPU" and xm.xla_device_hw(torch_xla.device()) == "CPU"
    assert torch_xla.devices() == [torch_xla.device()] and xm.get_xla_supported_devices() == [str(st.device())]
    assert torch_xla.real_devices() == [f"CPU:{i}" for i in range(8)] and torch_xla.device_count() == 8
    assert xm.xla_real_devices([torch_xla.device()]) == ["CPU:0"]
    assert [a["name"] for a in xr.global_runtime_device_attributes()] == [f"CPU:{i}" for i in range(8)]
    assert len(xm.xla_devices()) == 8
    xr.set_device_type("CPU")  # the platform it runs: accepted
    with pytest.raises(RuntimeError, match="Can't change device type to TPU"):
        xr.set_device_type("TPU")
    with pytest.raises(NotImplementedError, match="launch function does not support SPMD"):
        torch_xla.launch(print)
    with pytest.raises(NotImplementedError, match="auto-sharding"):
        xr.use_spmd(auto=True)


# --------------------------------------------------------------------------- sharding


def test_mark_sharding_strings_types_and_the_reannotation_rule():
    import torch_xla
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(8), (4, 2), ("x", "y"))
    t = torch.arange(32.0).reshape(8, 4)
    xt = xs.mark_sharding(st.shard(t, mesh, (None, None)), mesh, ("x", "y"))  # replicated -> sharded: allowed
    assert isinstance(xt, xs.XLAShardedTensor) and xt.global_tensor is xt
    assert torch_xla._XLAC._get_xla_sharding_spec(xt) == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    assert xt.sharding_type == xs.ShardingType.TILED and torch_xla._XLAC._get_xla_sharding_type(xt) == 3
    assert xs.mark_sharding(xt, mesh, ("x", "y")) is xt  # the same spec again: nothing to do
    with pytest.raises(RuntimeError, match="Existing annotation must be cleared first"):
        xs.mark_sharding(xt, mesh, ("y", "x"))
    assert xt.sharding_spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    xs.clear_sharding(xt)
    xs.mark_sharding(xt, mesh, ("y", "x"))
    assert xt.sharding_spec == "{devices=[2,4]0,2,4,6,1,3,5,7}"
    torch.testing.assert_close(xt.cpu(), t)
    pending = xt * 2  # an intermediate: re-marked as constraints, as PyTorch/XLA does
    xs.mark_sharding(pending, mesh, ("x", None))
    xs.mark_sharding(pending, mesh, (None, "y"))
    assert pending.sharding_spec == "{devices=[1,2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}"
    assert pending.sharding_type == xs.ShardingType.PARTIAL
    torch.testing.assert_close(pending.cpu(), t * 2)
    assert str(mesh.get_op_sharding(("x", None))) == "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
    assert xs.get_1d_mesh("data").shape() == {"data": 8}
    info = torch_xla._XLAC._get_xla_tensor_debug_info(xt)
    assert "XLAShardedData" in info and "NumShards: 8" in info and "OpSharding: {devices=[2,4]" in info
    fresh = torch.zeros(2, device="xla") + 1
    assert torch_xla._XLAC._get_xla_sharding_spec(fresh) == "" and torch_xla._XLAC._get_xla_sharding_type(fresh) is None


def test_sharded_training_with_gradients_marked_and_the_patched_linear():
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(8), (8,), ("data",))
    x = torch.randn(8, 16)
    w = torch.randn(4, 16, requires_grad=True)
    xd = x.to("xla").requires_grad_()
    y = xs.mark_sharding_with_gradients(xd, mesh, ("data", None))
    assert y is not xd and y.sharding_spec == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    out = xs.XLAPatchedLinear.apply(y, w.detach().to("xla"), None)
    out.sum().backward()
    torch.testing.assert_close(out.cpu(), F.linear(x, w.detach()))
    torch.testing.assert_close(xd.grad.cpu(), w.detach().sum(0).expand(8, 16))


# --------------------------------------------------------------------------- the two silent traps


def test_flash_attention_defaults_to_sm_scale_1_and_takes_partition_spec():
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.custom_kernel import flash_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    unscaled = torch.softmax(q @ k.transpose(-1, -2), -1) @ v  # sm_scale=1.0: no 1/sqrt(d)
    got = flash_attention(q.to("xla"), k.to("xla"), v.to("xla"))
    torch.testing.assert_close(got.cpu(), unscaled, rtol=1e-4, atol=1e-5)
    # the examples' way: q pre-scaled, the global mesh, the batch split over 'fsdp'
    mesh = xs.Mesh(np.arange(8), (2, 4), ("fsdp", "model"))
    xs.set_global_mesh(mesh)
    sharded = [xs.mark_sharding(t.to("xla"), mesh, ("fsdp", "model", None, None)) for t in (q, k, v)]
    out = flash_attention(
        sharded[0] / math.sqrt(8), *sharded[1:], causal=True, partition_spec=("fsdp", "model", None, None)
    )
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(NotImplementedError, match="segment ids"):
        flash_attention(q, k, v, q_segment_ids=torch.zeros(2, 16), kv_segment_ids=torch.zeros(2, 16))


# --------------------------------------------------------------------------- steps, loader, compile


def test_a_torch_xla_training_loop_equals_eager_torch():
    """xu.SampleGenerator, pl.MpDeviceLoader with input_sharding, torch_xla.compile(step, full_graph=True),
    xm.add_step_closure and xm.RateTracker, as PyTorch/XLA's examples write them."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.distributed.spmd as xs
    import torch_xla.utils.utils as xu

    ref, model = _model(), _model()
    model.to(torch_xla.device())
    mesh = xs.Mesh(np.arange(8), (8,), ("data",))
    data = (torch.randn(16, 16), torch.randn(16, 4))
    loader = pl.MpDeviceLoader(
        xu.SampleGenerator(data, 4), torch_xla.device(), input_sharding=xs.ShardingSpec(mesh, ("data", None))
    )
    opt, opt_ref = torch.optim.Adam(model.parameters(), lr=0.01), torch.optim.Adam(ref.parameters(), lr=0.01)

    def step_fn(x, y):  # PyTorch/XLA's order: zero_grad first, the loss returned with its graph
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    compiled = torch_xla.compile(step_fn, full_graph=True, name="step_fn")
    seen, tracker = [], xm.RateTracker()
    for step, (x, y) in enumerate(loader):
        assert x.sharding_spec == "{devices=[8,1]0,1,2,3,4,5,6,7}"
        loss = compiled(x, y)
        tracker.add(16)
        xm.add_step_closure(lambda s, v: seen.append((s, v.item())), args=(step, loss))
    # each closure ran at the next sync: the next batch's, the last at the loader's end (as in PyTorch/XLA)
    assert len(loader) == 4 and [s for s, _ in seen] == [0, 1, 2, 3]
    want = []
    for _ in range(4):
        opt_ref.zero_grad()
        loss = F.mse_loss(ref(data[0]), data[1])
        loss.backward()
        opt_ref.step()
        want.append(loss.item())
    torch.testing.assert_close(torch.tensor([v for _, v in seen]), torch.tensor(want))
    assert tracker.global_rate() > 0
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q)
    with pytest.raises(NotImplementedError, match="custom_compile_options"):
        torch_xla.compile(step_fn, custom_compile_options={"xla_cpu_enable_fast_math": True})


def test_step_context_eager_mode_and_metrics():
    import torch_xla
    import torch_xla.debug.metrics as met

    met.clear_all()
    x = torch.ones(4, device="xla")
    with torch_xla.step():
        y = x * 2 + 1
    assert not y.pending and met.counter_value("MarkStep") >= 1
    torch_xla.experimental.eager_mode(True)
    try:
        assert torch_xla.experimental.is_eager_mode()
        z = x + 5
        assert not z.pending
    finally:
        torch_xla.experimental.eager_mode(False)
    with torch_xla.experimental.eager_mode_context(True) as before:
        assert before is False and torch_xla.experimental.is_eager_mode()
    torch.testing.assert_close(y.cpu(), torch.full((4,), 3.0))
    assert "ExecuteReplicatedTime" in met.metric_names() and met.executed_fallback_ops() == []
    assert "Metric: CompileTime" in torch_xla._XLAC._xla_metrics_report()


# --------------------------------------------------------------------------- saving


def test_xser_and_the_checkpoint_manager_round_trip(tmp_path):
    import torch_xla.distributed.spmd as xs
    import torch_xla.experimental.distributed_checkpoint as xc
    import torch_xla.utils.serialization as xser

    mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
    model = _model().to("xla")
    xs.mark_sharding(model[0].weight, mesh, ("fsdp", None))
    want = {k: v.cpu() for k, v in model.state_dict().items()}
    xser.save(model.state_dict(), tmp_path / "xser.pt")
    for k, v in xser.load(tmp_path / "xser.pt").items():
        assert v.device.type == "cpu"
        torch.testing.assert_close(v, want[k], msg=k)
    manager = xc.CheckpointManager(str(tmp_path / "ckpts"), save_interval=10, max_to_keep=2, chkpt_on_preemption=False)
    assert manager.should_save(10) and not manager.should_save(5) and not manager.reached_preemption(5)
    assert manager.save(10, {"model": model.state_dict()})
    target = _model().to("xla")
    xs.mark_sharding(target[0].weight, mesh, (None, "fsdp"))
    state = {"model": target.state_dict()}
    manager.restore(10, state)
    for k, v in target.state_dict().items():
        torch.testing.assert_close(v.cpu(), want[k], msg=k)
    assert target[0].weight.sharding_spec == "{devices=[1,8]0,1,2,3,4,5,6,7}"
    assert manager.all_steps() == [10]
    assert issubclass(xc.SPMDSavePlanner, torch.distributed.checkpoint.DefaultSavePlanner)


def test_a_preemption_notice_makes_the_next_step_a_checkpoint_step(tmp_path):
    import signal

    import torch_xla.experimental.distributed_checkpoint as xc

    before = signal.getsignal(signal.SIGTERM)
    try:
        manager = xc.CheckpointManager(str(tmp_path / "ckpts"), save_interval=100)
        assert not manager.should_save(3)
        os.kill(os.getpid(), signal.SIGTERM)  # noted, not fatal
        assert manager.should_save(4) and manager.reached_preemption(4) and not manager.reached_preemption(5)
    finally:
        signal.signal(signal.SIGTERM, before)


# --------------------------------------------------------------------------- what raises, and why


def test_what_the_face_cannot_do_raises_saying_why():
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    with pytest.raises(NotImplementedError, match=r"enable_manual_sharding.*st\.shard_map"):
        xs.enable_manual_sharding(torch.zeros(8, device="xla"), (0,), mesh=xs.get_1d_mesh())
    with pytest.raises(NotImplementedError, match="get_master_ip .*initialize_distributed"):
        xr.get_master_ip()
    with pytest.raises(NotImplementedError, match="get_stablehlo .*st.export"):
        xm.get_stablehlo()
    with pytest.raises(AttributeError, match=r"_XLAC._spmd_full_to_shard_shape .*st\.shard_map"):
        torch_xla._XLAC._spmd_full_to_shard_shape  # noqa: B018
    with pytest.raises(ModuleNotFoundError, match=r"torch_xla\.experimental\.scan.*does not provide it"):
        import torch_xla.experimental.scan  # noqa: F401
    with pytest.raises(AttributeError, match="scan .*Python loop"):
        torch_xla.experimental.scan  # noqa: B018
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

    with pytest.raises(NotImplementedError, match="FSDPv2"):
        XlaFullyShardedDataParallel(torch.nn.Linear(2, 2))


def test_xla_autocast_is_autocast_on_the_device_in_bfloat16():
    import torch_xla.amp

    a = torch.ones(2, 2, device="xla")
    for region in (torch.autocast("xla"), torch.autocast("xla", dtype=torch.bfloat16), torch_xla.amp.autocast("xla")):
        with region:
            product = a @ a
        assert product.dtype == torch.bfloat16
        torch.testing.assert_close(product.cpu(), torch.full((2, 2), 2.0, dtype=torch.bfloat16))
    with torch.autocast("xla", enabled=False):
        assert (a @ a).dtype == torch.float32


def test_torch_xla_is_the_face_only_while_installed():
    import torch_xla

    assert torch_xla.__name__ == "shardtensor.xla.face" and sys.modules["torch_xla.runtime"] is torch_xla.runtime


def test_profiler_regions_and_the_xla_rendezvous():
    import torch.distributed as dist
    import torch_xla.debug.profiler as xp

    # JAX's step annotation (the step runs at its end) around a named region
    with xp.StepTrace("train_step", step_num=0), xp.Trace("forward"):
        y = torch.ones(4, device="xla") * 2
    assert not y.pending
    torch.testing.assert_close(y.cpu(), torch.full((4,), 2.0))
    with pytest.raises(NotImplementedError, match="another host's server"):
        xp.trace("10.1.2.3:9012", "/nonexistent", duration_ms=1)
    dist.init_process_group("gloo", init_method="xla://")  # (registered by torch_xla.distributed.xla_backend)
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    finally:
        dist.destroy_process_group()
