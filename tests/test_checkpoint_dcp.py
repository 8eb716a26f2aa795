"""Issue 14 §1: torch.distributed.checkpoint (DCP) of ShardedTensors, in one process, no process group.

A small MLP with uneven shapes and its AdamW state over a (4, 2) mesh is saved with plain
``dcp.save`` and loaded back with ``dcp.load`` into the same sharding, another mesh shape and spec,
plain CPU tensors, and (in a subprocess without shardtensor) plain PyTorch. Values compare exactly.
"""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardtensor as st
from _training_helpers import reset_state

# DCP warns that it assumes one process when torch.distributed is not initialized: that is the case here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def shard_mlp(model, mesh, specs):
    model.to(st.device())
    for name, spec in specs.items():
        st.mark_sharding(model.get_parameter(name), mesh, spec)
    return model


# uneven on purpose: 7 rows over 4 devices, 7 columns over 4, 5 over 2; "2.bias" stays replicated
SPECS_4x2 = {"0.weight": (0, 1), "0.bias": (0,), "2.weight": (None, 0)}


def train_one_step(model, optimizer):
    torch.manual_seed(1)
    x = torch.randn(6, 5)
    device = next(model.parameters()).device
    model(x.to(device)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def cpu_values(state):
    """{flat key: CPU copy} of every tensor in a nested state dict."""
    out = {}

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, torch.Tensor):
            out[prefix] = obj.detach().cpu().clone()

    walk("", state)
    return out


def part(values, prefix):
    return {k: v for k, v in values.items() if k.startswith(prefix)}


def assert_same(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0, msg=key)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of the sharded MLP and its AdamW state after one step, and the saved values."""
    reset_state()
    mesh = st.Mesh(range(8), (4, 2))
    model = shard_mlp(mlp(), mesh, SPECS_4x2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_one_step(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    path = tmp_path_factory.mktemp("dcp") / "step1"
    dcp.save(state, checkpoint_id=path)
    expected = cpu_values(state)
    yield path, expected, mesh
    reset_state()


def test_save_writes_each_distinct_shard_once_without_padding(saved):
    path, expected, mesh = saved
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    weight = metadata["model.0.weight"]
    assert tuple(weight.size) == (7, 5)
    # 4 row shards (2, 2, 2, 1 real rows) x 2 column shards (3, 2): 8 chunks, no padding in any
    chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in weight.chunks)
    assert chunks == sorted(((r, c), (min(2, 7 - r), 3 if c == 0 else 2)) for r in (0, 2, 4, 6) for c in (0, 3))
    for key in ("model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias", "optim.state.0.weight.exp_avg"):
        md = metadata[key]
        # each element written exactly once: replicas (mesh axis 1 for biases, axis 0/1 for 2.*) once
        assert sum(torch.Size(c.sizes).numel() for c in md.chunks) == torch.Size(md.size).numel(), key
    assert len(metadata["model.0.bias"].chunks) == 4  # sharded over 4, replicated over 2
    assert len(metadata["model.2.bias"].chunks) == 1  # replicated over all 8


def test_save_copies_shards_not_the_full_tensor(tmp_path):
    reset_state()
    mesh = st.Mesh(range(8), (4, 2))
    x = st.shard(torch.arange(70.0).reshape(7, 10), mesh, (0, 1))
    shards = x.__create_write_items__("x", x)
    pieces = [x.__get_tensor_shard__(item.index) for item in shards]
    assert [tuple(p.shape) for p in pieces] == [tuple(i.tensor_data.chunk.sizes) for i in shards]
    assert all(p.device.type == "cpu" and p.numel() <= 10 for p in pieces)  # one shard each, 7x10 in all
    dcp.save({"x": x}, checkpoint_id=tmp_path)
    target = {"x": torch.zeros(7, 10)}
    dcp.load(target, checkpoint_id=tmp_path)
    torch.testing.assert_close(target["x"], torch.arange(70.0).reshape(7, 10), rtol=0, atol=0)


def test_saved_shards_are_views_of_cpu_devices_that_later_steps_leave_as_saved():
    """On CPU devices a shard handed to DCP is its device buffer seen from torch, not a host copy (DCP
    keeps what it wrote until the file is complete); a later in-place update of the tensor leaves it
    as it was saved."""
    reset_state()
    mesh = st.Mesh(range(8), (4, 2))
    expected = torch.arange(80.0).reshape(8, 10)
    x = st.shard(expected.clone(), mesh, (0, 1))
    items = x.__create_write_items__("x", x)
    pieces = [x.__get_tensor_shard__(item.index) for item in items]
    buffers = {s.data.unsafe_buffer_pointer() for s in x._concrete_array().addressable_shards}
    assert len(pieces) == 8 and all(p.data_ptr() in buffers for p in pieces)
    with torch.no_grad():
        x.mul_(-1)  # overwrites x: its program donates x's buffers unless a view of them exists
    st.sync()
    for item, piece in zip(items, pieces):
        (row, col), (rows, cols) = item.tensor_data.chunk.offsets, item.tensor_data.chunk.sizes
        torch.testing.assert_close(piece, expected[row : row + rows, col : col + cols], rtol=0, atol=0)
    torch.testing.assert_close(x.cpu(), -expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "mesh_shape, specs, staged",
    [
        ((4, 2), SPECS_4x2, False),  # the same mesh and specs, DCP's default planner
        # another mesh shape and specs, all or nothing, each shard read into a host buffer of its own
        ((2, 4), {"0.weight": (1, None), "2.weight": (0, 1), "2.bias": (1,)}, True),
    ],
)
def test_model_and_adamw_load_into_a_sharded_target(saved, mesh_shape, specs, staged):
    path, expected, _ = saved
    reset_state()
    mesh = st.Mesh(range(8), mesh_shape)
    model = shard_mlp(mlp(), mesh, specs)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_one_step(model, optimizer)  # creates the AdamW state that the load overwrites
    st.sync()
    before = {name: p.sharding_spec for name, p in model.named_parameters()}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    planner = st.checkpoint.StagedLoadPlanner() if staged else None
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, planner=planner)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert_same(cpu_values({"model": model.state_dict()}), part(expected, "model."))
    assert_same(cpu_values({"optim": get_state_dict(model, optimizer)[1]}), part(expected, "optim."))
    for name, p in model.named_parameters():  # the target's shardings are kept
        assert isinstance(p, st.ShardedTensor) and p.sharding_spec == before[name], name
        assert isinstance(optimizer.state[p]["exp_avg"], st.ShardedTensor), name


def test_load_into_plain_cpu_tensors(saved):
    path, expected, _ = saved
    cpu_model = mlp()
    model_sd = {k: torch.zeros_like(v) for k, v in cpu_model.state_dict().items()}
    dcp.load({"model": model_sd}, checkpoint_id=path)
    assert_same(cpu_values({"model": model_sd}), part(expected, "model."))


def test_plain_pytorch_reads_the_checkpoint_without_shardtensor(saved, tmp_path):
    path, expected, _ = saved
    torch.save(expected, tmp_path / "expected.pt")
    script = textwrap.dedent(
        """
        import sys, warnings
        warnings.simplefilter("ignore")
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        ckpt, out, expected_path = sys.argv[1:]
        expected = torch.load(expected_path)
        model = {k[len("model."):]: torch.zeros_like(v) for k, v in expected.items() if k.startswith("model.")}
        dcp.load({"model": model}, checkpoint_id=ckpt)
        for k, v in model.items():
            torch.testing.assert_close(v, expected["model." + k], rtol=0, atol=0)
        dcp_to_torch_save(ckpt, out)
        full = torch.load(out, weights_only=False)
        for k, v in full["model"].items():
            torch.testing.assert_close(v, expected["model." + k], rtol=0, atol=0)
        exp_avg = full["optim"]["state"]["0.weight"]["exp_avg"]
        torch.testing.assert_close(exp_avg, expected["optim.state.0.weight.exp_avg"], rtol=0, atol=0)
        assert "shardtensor" not in sys.modules and "jax" not in sys.modules
        print("read", len(full["model"]), "tensors")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", script, str(path), str(tmp_path / "full.pt"), str(tmp_path / "expected.pt")],
        capture_output=True,
        text=True,
        env=env,
        cwd=pathlib.Path(tmp_path),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "read 4 tensors" in result.stdout


def sharded_target(mesh):
    model = shard_mlp(mlp(), mesh, SPECS_4x2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    return model


def test_a_target_key_missing_from_the_checkpoint_raises_and_changes_nothing(saved):
    path, _, mesh = saved
    reset_state()
    model = sharded_target(mesh)
    target = {f"model.{k}": v for k, v in model.state_dict().items()} | {"model.3.weight": torch.zeros(2)}
    before = cpu_values(target)
    with pytest.raises(CheckpointException, match=r"model\.3\.weight"):
        dcp.load(target, checkpoint_id=path)
    assert_same(cpu_values(target), before)
    # allow_partial_load: the keys found load, the missing one keeps its value (staged too)
    dcp.load(target, checkpoint_id=path, planner=st.checkpoint.StagedLoadPlanner(allow_partial_load=True))
    assert_same(cpu_values(target), part(saved[1], "model.") | {"model.3.weight": torch.zeros(2)})


def test_a_shape_mismatch_raises_and_changes_nothing(saved):
    path, _, _ = saved
    reset_state()
    mesh = st.Mesh(range(8), (4, 2))
    model = shard_mlp(nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 4)), mesh, SPECS_4x2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    target = {"model": model.state_dict()}
    before = cpu_values(target)
    with warnings.catch_warnings(), pytest.raises(CheckpointException, match=r"Size mismatch.*2\.weight"):
        dcp.load(target, checkpoint_id=path)
    assert_same(cpu_values(target), before)


def test_staged_load_leaves_the_target_unchanged_when_a_file_is_truncated(saved, tmp_path, monkeypatch):
    from shardtensor.checkpoint import StagedLoadPlanner

    path, expected, mesh = saved
    reset_state()
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    data_file = next(broken.glob("*.distcp"))
    with open(data_file, "r+b") as f:
        f.truncate(data_file.stat().st_size // 2)
    model = sharded_target(mesh)
    target = {"model": model.state_dict()}
    before = cpu_values(target)
    with pytest.raises(CheckpointException, match="EOFError|corrupted"):  # (DCP's own error)
        dcp.load(target, checkpoint_id=broken, planner=StagedLoadPlanner())
    assert_same(cpu_values(target), before)
    # the same planner on the intact checkpoint loads everything, into the target's shardings, each
    # sharded tensor through host buffers of its own distinct shards, uploaded device by device
    uploaded = []
    from shardtensor.checkpoint.shard_load import ShardLoad

    upload = ShardLoad.upload
    monkeypatch.setattr(ShardLoad, "upload", lambda load: uploaded.append(load.shape) or upload(load))
    dcp.load(target, checkpoint_id=path, planner=StagedLoadPlanner())
    assert sorted(uploaded) == [(3,), (3, 7), (7,), (7, 5)]
    assert_same(cpu_values(target), part(expected, "model."))
    assert model[0].weight.partition_spec == st.PartitionSpec(0, 1)


def test_a_load_reads_each_distinct_shard_once_into_the_targets_storage(tmp_path):
    """DCP's default planner: the chunks a load asks for are the target's distinct shards (replicas
    once, padding never), and the loaded shards become the target's storage without a program."""
    reset_state()
    mesh = st.Mesh(range(8), (4, 2))
    Z = torch.arange(70.0).reshape(7, 10)
    saved = st.shard(Z, mesh, (1, None))
    dcp.save({"z": saved, "tied": saved}, checkpoint_id=tmp_path)
    x = st.shard(torch.zeros(7, 10), mesh, (0, None))  # 7 rows over 4: 2, 2, 2, 1; replicated over 2
    chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in x.__create_chunk_list__())
    assert chunks == [((0, 0), (2, 10)), ((2, 0), (2, 10)), ((4, 0), (2, 10)), ((6, 0), (1, 10))]
    st.clear_counters()
    tied = x.detach()  # (shares the storage, as a parameter and its state-dict entry do)
    dcp.load({"z": x, "tied": x}, checkpoint_id=tmp_path)  # (one tensor under two keys)
    assert not st.counter_value("UncachedCompile") and not st.counter_value("CachedCompile")
    torch.testing.assert_close(tied.cpu(), Z, rtol=0, atol=0)
    assert x.partition_spec == st.PartitionSpec(0, None)
    # a load that fails half-way leaves no trace that would confuse a later save of the tensor
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tmp_path.iterdir():
        if f.is_file():
            shutil.copy(f, broken / f.name)
    next(broken.glob("*.distcp")).write_bytes(b"")
    with pytest.raises(CheckpointException):
        dcp.load({"z": x}, checkpoint_id=broken)
    dcp.save({"z": x}, checkpoint_id=tmp_path / "same")
    cpu = {"z": torch.zeros(7, 10)}
    dcp.load(cpu, checkpoint_id=tmp_path / "same")
    torch.testing.assert_close(cpu["z"], Z, rtol=0, atol=0)


def test_atomic_save_keeps_the_previous_checkpoint_when_the_writer_fails(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_files

    reset_state()
    mesh = st.Mesh(range(8), (4, 2))
    path = tmp_path / "latest"
    first = st.shard(torch.arange(70.0).reshape(7, 10), mesh, (0, 1))
    st.checkpoint.save({"x": first}, path)

    def failing(*args, **kwargs):
        raise RuntimeError("boom while writing")

    with monkeypatch.context() as patch:
        patch.setattr(dcp_files, "_write_item", failing)
        with pytest.raises(CheckpointException, match="boom while writing"):
            st.checkpoint.save({"x": first * 2}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]  # no temporary directory left
    target = {"x": torch.zeros(7, 10)}
    dcp.load(target, checkpoint_id=path)
    torch.testing.assert_close(target["x"], torch.arange(70.0).reshape(7, 10), rtol=0, atol=0)
    st.checkpoint.save({"x": first * 2}, path)  # replaces the previous one
    dcp.load(target, checkpoint_id=path)
    torch.testing.assert_close(target["x"], torch.arange(70.0).reshape(7, 10) * 2, rtol=0, atol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_dtypes_scalars_views_and_empty_padding_shards_round_trip(tmp_path):
    reset_state()
    mesh = st.Mesh(range(8), (4, 2))
    torch.manual_seed(2)
    values = {
        "bf16": torch.randn(5, 3).bfloat16(),  # rows 2, 2, 1 and a shard of padding only
        "scalar": torch.tensor(3.5),
        "int64": torch.arange(9),
        "view": torch.arange(40.0).reshape(8, 5)[1:6, ::2],
    }
    state = {
        "bf16": st.shard(values["bf16"], mesh, (0, None)),
        "scalar": values["scalar"].to(st.device()),
        "int64": st.shard(values["int64"], mesh, (1,)),
        "view": st.shard(torch.arange(40.0).reshape(8, 5), mesh, (0, 1))[1:6, ::2],
    }
    dcp.save(state, checkpoint_id=tmp_path)
    metadata = dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata
    assert metadata["bf16"].properties.dtype == torch.bfloat16 and len(metadata["bf16"].chunks) == 3
    assert len(metadata["int64"].chunks) == 2
    cpu = {k: torch.zeros_like(v) for k, v in values.items()}
    dcp.load(cpu, checkpoint_id=tmp_path)
    assert_same(cpu, values)
    sharded = {
        "int64": st.shard(torch.zeros(9, dtype=torch.long), mesh, (0,)),
        "scalar": torch.tensor(0.0).to(st.device()),
    }
    base = st.shard(torch.zeros(8, 5), mesh, (0, 1))
    sharded["view"] = base[1:6, ::2]  # (a view: read whole, written back through its chain)
    dcp.load(sharded, checkpoint_id=tmp_path)
    assert_same(cpu_values(sharded), {"int64": values["int64"], "scalar": values["scalar"], "view": values["view"]})
    assert torch.equal(base.cpu()[1:6, ::2], values["view"]) and base.cpu().sum() == values["view"].sum()
    assert sharded["int64"].partition_spec == st.PartitionSpec(0)


def test_atomic_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    """A process SIGKILLed while it writes a larger checkpoint (a slow writer: it says when it is in
    the middle, then waits) leaves ``latest`` as it was, and no other directory that looks complete;
    the next save removes the dead process's temporary directory."""
    script = textwrap.dedent(
        """
        import sys, time, warnings
        warnings.simplefilter("ignore")
        import torch
        import torch.distributed.checkpoint.filesystem as dcp_files
        import shardtensor as st
        path = sys.argv[1]
        mesh = st.Mesh(range(8), (4, 2))
        x = st.shard(torch.arange(70.0).reshape(7, 10), mesh, (0, 1))
        st.checkpoint.save({"x": x}, path)
        write_item, calls = dcp_files._write_item, []

        def slow(*args, **kwargs):
            calls.append(1)
            if len(calls) == 20:  # in the middle of the third of six tensors
                print("WRITING", flush=True)
                time.sleep(300)
            return write_item(*args, **kwargs)

        dcp_files._write_item = slow
        st.checkpoint.save({f"x{i}": st.shard(torch.full((7, 10), i), mesh, (0, 1)) for i in range(6)}, path)
        """
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(pathlib.Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    path = tmp_path / "latest"
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        line = child.stdout.readline()
        assert line == "WRITING\n", child.stderr.read()[-3000:]
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        child.kill()
        child.communicate()
    assert child.returncode == -signal.SIGKILL
    target = {"x": torch.zeros(7, 10)}
    st.checkpoint.load(target, path)
    torch.testing.assert_close(target["x"], torch.arange(70.0).reshape(7, 10), rtol=0, atol=0)
    # what the killed save left is a hidden temporary directory with data, no metadata: not a checkpoint
    leftovers = [p for p in tmp_path.iterdir() if p.name != "latest"]
    assert [p.name.startswith(".latest.tmp-") for p in leftovers] == [True]
    assert [p.name for p in leftovers[0].iterdir()] == ["__0_0.distcp"]  # (data, no .metadata)
    with pytest.raises(st.checkpoint.CheckpointNotFoundError, match="has no .metadata"):
        st.checkpoint.load(target, leftovers[0])
    st.checkpoint.save(target, path)  # the next save to that path removes what the killed one left
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_async_save_with_the_host_stager_writes_the_values_staged(tmp_path):
    """dcp.async_save's default stager cannot copy a ShardedTensor; HostStager copies each distinct
    shard to the host on the caller, and the background save writes those, as dcp.save would."""
    reset_state()
    mesh = st.Mesh(range(8), (4, 2))
    Z = torch.arange(70.0).reshape(7, 10)
    x = st.shard(Z.clone(), mesh, (0, 1))
    with pytest.raises(RuntimeError, match="invalid python storage"):  # (DCP's own stager)
        dcp.async_save({"x": x}, checkpoint_id=tmp_path / "default").result()
    stager = st.checkpoint.HostStager()
    staged = stager.stage({"x": x})["x"]
    assert sorted(staged.copies) == sorted((r, c) for r in (0, 2, 4, 6) for c in (0, 5))
    with pytest.raises(TypeError, match="StagedShards holds host copies"):
        staged.sum()
    future = dcp.async_save({"x": x, "step": 3}, checkpoint_id=tmp_path / "async", async_stager=stager)
    with torch.no_grad():
        x.mul_(0)  # training goes on: the checkpoint has the staged values
    future.result()
    metadata = dcp.FileSystemReader(tmp_path / "async").read_metadata().state_dict_metadata
    assert len(metadata["x"].chunks) == 8
    target = {"x": st.shard(torch.zeros(7, 10), mesh, (1, None)), "step": 0}
    st.checkpoint.load(target, tmp_path / "async")
    torch.testing.assert_close(target["x"].cpu(), Z, rtol=0, atol=0)
    assert target["step"] == 3
