"""Issue 38: the PyTorch/XLA calls a migrating user types (``xm.mark_step``, ``Mesh(xm.xla_devices(), ...)``,
``mark_sharding`` of a module, ``init_process_group("xla")``, ``PJRT_DEVICE``) work or say what to write, and
messages name the user's own variable, function or mesh."""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shardtensor as st
import shardtensor.runtime as rt
from _training_helpers import reset_state

REPO = Path(__file__).resolve().parents[1]
MESH = st.Mesh(range(8), (4, 2), ("data", "model"))


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    yield
    reset_state()


def _models():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    sharded = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    sharded.load_state_dict(ref.state_dict())
    return ref, sharded


# --------------------------------------------------------------------------- mark_step, xla_devices


@pytest.mark.parametrize("wait", [False, True])
def test_mark_step_runs_what_is_pending_as_sync_does(wait):
    x = torch.randn(8, 4)
    y = st.shard(x, MESH, ("data", None)) * 3 + 1
    before = st.counter_value("MarkStep") or 0
    if wait:
        st.mark_step(wait=True)
    else:
        st.mark_step()
    assert st.counter_value("MarkStep") == before + 1
    assert not y._cell.is_pending()
    torch.testing.assert_close(y.cpu(), x * 3 + 1)


def test_a_mesh_over_xla_devices_spans_every_device():
    devices = st.xla_devices()
    assert len(devices) == st.global_runtime_device_count() == 8
    mesh = st.Mesh(st.xla_devices(), (8,), ("data",))
    assert mesh.device_ids.tolist() == list(range(8))
    assert st.Mesh(st.xla_devices(), (4, 2)).get_logical_mesh().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    x = torch.randn(16, 4)
    torch.testing.assert_close(st.shard(x, mesh, ("data", None)).sum(0).cpu(), x.sum(0))


@pytest.mark.parametrize(
    "given",
    [lambda: st.devices(), lambda: [torch.device("xla", i) for i in range(8)], lambda: ["xla:0"] * 8],
    ids=["st.devices", "torch devices", "strings"],
)
def test_a_mesh_of_torch_devices_says_what_to_write(given):
    with pytest.raises(st.MeshError, match=r"not torch devices.*st\.Mesh\(st\.xla_devices\(\), \(8,\)\)"):
        st.Mesh(given(), (8,))
    assert st.devices() == [st.device()]  # (PyTorch/XLA's torch_xla.devices() in SPMD mode)


# --------------------------------------------------------------------------- mark_sharding of a module


def test_mark_sharding_of_a_module_shards_each_parameter_of_the_specs_rank():
    ref, model = _models()
    model.to(st.device())
    assert st.mark_sharding(model, MESH, ("model", None)) is model
    for layer in (model[0], model[2]):
        assert layer.weight.partition_spec == st.PartitionSpec("model", None)
        assert layer.bias.partition_spec is None  # a 1-d parameter under a 2-d spec stays as it was
    assert model[0].weight.sharding_spec == "{devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}"
    x = torch.randn(8, 16)
    out = model(st.shard(x, MESH, ("data", None)))
    torch.testing.assert_close(out.cpu(), ref(x).detach())
    out.sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(model[0].weight.grad.cpu(), ref[0].weight.grad)


def test_mark_sharding_of_other_inputs_says_what_is_wrong_and_what_to_write():
    _, model = _models()
    with pytest.raises(TypeError, match=r"parameter '0\.weight' is on cpu.*model\.to\(st\.device\(\)\)"):
        st.mark_sharding(model, MESH, ("model", None))
    with pytest.raises(TypeError, match=r"got a tensor on cpu\. Move it with t = t\.to\(st\.device\(\)\)"):
        st.mark_sharding(torch.randn(4, 4), MESH, ("model", None))
    with pytest.raises(TypeError, match=r"\(a ShardedTensor\) or an nn\.Module; got list"):
        st.mark_sharding([1, 2], MESH, ("model",))
    model.to(st.device())
    with pytest.raises(ValueError, match=r"the spec has 3 entries, and no parameter has 3 dimensions"):
        st.mark_sharding(model, MESH, ("model", None, None))
    with pytest.raises(TypeError, match=r"clear_sharding needs a tensor on st\.device\(\).*got a tensor on cpu"):
        st.clear_sharding(torch.randn(2))


# --------------------------------------------------------------------------- init_process_group("xla")


def test_init_process_group_xla_is_the_shardtensor_backend():
    assert dist.Backend.backend_capability["xla"] == ["cpu", "shardtensor"]
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # torch's own choice stays
    dist.init_process_group("xla", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.get_backend() == "xla"
        on_device = torch.arange(4.0).to(st.device())
        dist.all_reduce(on_device)  # recorded as a shardtensor collective: a world of one keeps the value
        on_cpu = torch.arange(4.0)
        dist.all_reduce(on_cpu)  # gloo
        torch.testing.assert_close(on_device.cpu(), torch.arange(4.0))
        torch.testing.assert_close(on_cpu, torch.arange(4.0))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the platform variables


def _python(code: str, **env_vars) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_", "PJRT_"))}
    env.update(env_vars, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_pjrt_device_cpu_chooses_the_cpu():
    result = _python("import shardtensor.runtime as rt; print(rt.platform())", PJRT_DEVICE="CPU")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cpu"]


@pytest.mark.parametrize(
    "variables, message",
    [
        (
            {"PJRT_DEVICE": "TPU", "SHARDTENSOR_PLATFORM": "cpu"},
            "ValueError: SHARDTENSOR_PLATFORM=cpu and PJRT_DEVICE=TPU ask for different platforms",
        ),
        ({"PJRT_DEVICE": "NEURON"}, "ValueError: PJRT_DEVICE='NEURON' (PyTorch/XLA's platform variable) is not a"),
    ],
    ids=["conflict", "unknown"],
)
def test_pjrt_device_that_cannot_be_honoured_is_an_error(variables, message):
    result = _python("import shardtensor.runtime", **variables)
    assert result.returncode != 0
    assert message in result.stderr


@pytest.mark.parametrize(
    "variable, value, platform, extra",
    [("SHARDTENSOR_PLATFORM", "tpu", "tpu", "tpu"), ("PJRT_DEVICE", "CUDA", "gpu", "cuda")],
)
def test_an_accelerator_that_cannot_start_names_the_variable_and_the_extra(variable, value, platform, extra):
    result = _python("import shardtensor.runtime as rt; print(rt.platform())", **{variable: value})
    if result.returncode == 0:  # (a machine with that accelerator and its runtime)
        assert result.stdout.split() == [platform]
        return
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"RuntimeError: {variable}={value} asks for the {extra} platform, but it cannot start")
    assert f"pip install 'shardtensor[{extra}]'" in last
    assert f"set {variable} to another platform" in last
    assert "JAX_PLATFORMS" not in last


def test_initialize_distributed_after_a_device_query_names_itself():
    rt.global_runtime_device_count()  # the devices have started in this process
    with pytest.raises(RuntimeError, match=r"shardtensor\.runtime\.initialize_distributed\(\) must be called before"):
        rt.initialize_distributed("127.0.0.1:1", num_processes=2, process_id=0)


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_checkpoint_load_takes_the_keyword_its_mismatch_error_names(tmp_path):
    w = torch.arange(32.0).reshape(8, 4)
    st.checkpoint.save({"w": st.shard(w, MESH, ("data", None))}, tmp_path / "ckpt")
    target = {"w": st.shard(torch.zeros(8, 4), MESH, ("data", None)), "extra": torch.ones(3)}
    with pytest.raises(st.checkpoint.CheckpointMismatchError, match=r"extra.*allow_partial_load=True"):
        st.checkpoint.load(target, tmp_path / "ckpt")
    st.checkpoint.load(target, tmp_path / "ckpt", allow_partial_load=True)
    torch.testing.assert_close(target["w"].cpu(), w)
    torch.testing.assert_close(target["extra"], torch.ones(3))  # missing from the checkpoint: kept


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_async_save_with_the_default_stager_names_host_stager(tmp_path):
    state = {"w": st.shard(torch.randn(8, 4), MESH, ("data", None))}
    with pytest.raises(RuntimeError, match=r"async_stager=st\.checkpoint\.HostStager\(\)"):
        dcp.async_save(state, checkpoint_id=str(tmp_path / "ckpt")).result()


# --------------------------------------------------------------------------- the recompilation warning


def test_the_recompilation_warning_shows_the_users_spec_and_mesh(caplog):
    specs = [("data", None), (None, "model"), ("model", "data")]
    with caplog.at_level(logging.WARNING, logger="shardtensor"):
        for spec in specs:
            y = torch.zeros(8, 24).to(st.device()) + 1  # (a shape no other test compiles)
            st.mark_sharding(y, MESH, spec)
            st.sync()
    messages = [r.getMessage() for r in caplog.records if r.name == "shardtensor" and r.levelno == logging.WARNING]
    assert len(messages) == 1, messages
    assert "(mark_sharding) arguments (P(None, 'model') on mesh {'data': 4, 'model': 2}) -> " in messages[0]
    assert "(P('model', 'data') on mesh {'data': 4, 'model': 2})" in messages[0]
    assert "NamedSharding" not in messages[0] and "axis_types" not in messages[0]
    torch.testing.assert_close(y.cpu(), torch.ones(8, 24))


# --------------------------------------------------------------------------- st.export of st.compile


def test_export_of_a_compiled_step_is_refused_before_anything_runs():
    ref, model = _models()
    model.to(st.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    @st.compile
    def train_step(x):
        calls.append(1)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    x = torch.randn(8, 16)
    xs = st.shard(x, MESH, ("data", None))
    with pytest.raises(st.ExportError, match=r"train_step is an st\.compile'd function.*train_step\.__wrapped__"):
        st.export(train_step, xs)
    st.sync()
    assert calls == []
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name].cpu(), value, rtol=0, atol=0, msg=name)

    forward = st.compile(lambda t: model(t) * 2)
    exported = st.export(forward.__wrapped__, xs)  # the same program st.compile runs
    torch.testing.assert_close(st.deserialize(exported.serialize())(xs).cpu(), ref(x).detach() * 2)
    torch.testing.assert_close(forward(xs).cpu(), ref(x).detach() * 2)
