"""Issue 14 §2: ``st.checkpoint.CheckpointManager`` (PyTorch/XLA's), in one process, no process group.

Saves and loads across meshes, keeps the newest checkpoints by save order (across manager
instances), saves in the background from a host copy, surfaces background errors, works on an
fsspec URL, and a job killed after its step-3 save resumes with exactly the losses of an
uninterrupted run.
"""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardtensor as st
from _training_helpers import MLP, MLP_SPECS, mesh_8, mlp_batches, reset_state, shard_batches, shard_params, train
from shardtensor.checkpoint import CheckpointManager

# DCP warns that it assumes one process when torch.distributed is not initialized: that is the case here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def grid(scale=1.0):
    return torch.arange(70.0).reshape(7, 10) * scale


def sharded_grid(scale=1.0):
    return st.shard(grid(scale), st.Mesh(range(8), (4, 2)), (0, 1))  # 7 rows over 4: uneven


def loaded_grid(manager, step):
    target = {"x": torch.zeros(7, 10)}
    manager.load(step, target, strict=False)  # (x alone, whatever else the step saved)
    return target["x"]


def test_arguments_are_checked_and_should_save_follows_the_interval(tmp_path):
    for kwargs, name in [
        ({"save_interval": 0}, "save_interval"),
        ({"save_interval": 10, "max_to_keep": -1}, "max_to_keep"),
        ({"save_interval": 10, "async_queue_size": 0}, "async_queue_size"),
        ({"save_interval": 2.5}, "save_interval"),
    ]:
        with pytest.raises(ValueError, match=name):
            CheckpointManager(tmp_path, **kwargs)
    manager = CheckpointManager(tmp_path / "new", save_interval=10)
    assert [s for s in range(0, 35) if manager.should_save(s)] == [0, 10, 20, 30]
    assert manager.all_steps() == []


def test_save_and_load_into_another_mesh_and_spec(tmp_path):
    reset_state()
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    expected = {k: v.clone() for k, v in source.state_dict().items()}
    source.to(st.device())
    mesh = st.Mesh(range(8), (4, 2))
    st.mark_sharding(source[0].weight, mesh, (0, 1))
    st.mark_sharding(source[2].weight, mesh, (None, 0))
    manager = CheckpointManager(tmp_path, save_interval=10)
    assert manager.save(5, {"model": source.state_dict()}) is False  # not a save step
    assert manager.save(10, {"model": source.state_dict()}) is True
    assert manager.save(15, {"model": source.state_dict()}, force=True) is True
    assert manager.all_steps() == [10, 15]

    target = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).to(st.device())
    other = st.Mesh(range(8), (8,))
    st.mark_sharding(target[0].weight, other, (None, 0))
    st.mark_sharding(target[2].weight, other, (0, None))
    manager.load(10, {"model": target.state_dict()})
    for name, value in target.state_dict().items():
        assert torch.equal(value.cpu(), expected[name]), name
    assert target[0].weight.partition_spec == st.PartitionSpec(None, 0)
    assert target[2].weight.partition_spec == st.PartitionSpec(0, None)

    # all or nothing: a shape mismatch leaves the target as it was; a missing step names what exists
    wrong = {"model": {"0.weight": torch.full((7, 5), 3.0), "2.weight": torch.full((4, 7), 3.0)}}
    with pytest.raises(st.checkpoint.CheckpointMismatchError, match=r"model\.2\.weight"):
        manager.load(10, wrong)
    assert torch.equal(wrong["model"]["0.weight"], torch.full((7, 5), 3.0))
    with pytest.raises(ValueError, match=r"step 20 .*available are \[10, 15\]"):
        manager.restore(20, {"model": target.state_dict()})


@pytest.mark.parametrize("scheme", ["local", "memory"])
def test_max_to_keep_keeps_the_newest_saves_across_managers(tmp_path, scheme):
    reset_state()
    path = tmp_path if scheme == "local" else f"memory://ckpt-{uuid.uuid4().hex}"
    x = sharded_grid()
    manager = CheckpointManager(path, save_interval=10, max_to_keep=2)
    for step in (10, 20, 30):
        manager.save(step, {"x": x * step})
    assert manager.all_steps() == [20, 30]
    manager.save(10, {"x": x})  # the newest save now: 20 goes
    assert manager.all_steps() == [10, 30]
    manager = CheckpointManager(path, save_interval=10, max_to_keep=2)  # the order is on disk
    assert manager.all_steps() == [10, 30]
    manager.save(20, {"x": x * 20})  # 30 is the oldest save
    assert manager.all_steps() == [10, 20]
    assert torch.equal(loaded_grid(manager, 10), grid())
    assert torch.equal(loaded_grid(manager, 20), grid(20))
    manager.save(20, {"x": x * 2})  # replaces step 20
    assert manager.all_steps() == [10, 20]
    assert torch.equal(loaded_grid(manager, 20), grid(2))
    if scheme == "local":  # what is stored: the kept steps only, no temporary directory left
        assert sorted(p.name for p in tmp_path.iterdir()) == ["10", "20"]
        # a directory without the manager's metadata (a save cut short) is skipped with a warning
        (tmp_path / "40").mkdir()
        with pytest.warns(UserWarning, match=r"40.*\.manager_metadata"):
            assert CheckpointManager(path, save_interval=10).all_steps() == [10, 20]


def test_save_async_writes_a_host_copy_in_the_background(tmp_path, monkeypatch):
    reset_state()
    release = threading.Event()
    write = dcp.save

    def held_write(*args, **kwargs):
        assert release.wait(60), "the test never released the writer"
        write(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", held_write)
    manager = CheckpointManager(f"file://{tmp_path}", save_interval=10, async_queue_size=1)
    x = sharded_grid()
    st.sync()
    copies = st.counter_value("TransferFromDevice") or 0
    assert manager.save_async(10, {"x": x, "meta": {"lr": 0.5}}) is True
    # the device-to-host copy happened on the caller: 8 distinct shards (4 x 2), one copy each
    assert (st.counter_value("TransferFromDevice") or 0) - copies == 8
    assert manager.all_steps() == []  # nothing listed before the write ends
    x.mul_(0)  # training goes on and changes the tensor: the save has its own copy
    assert manager.save_async(11, {"x": x}) is False
    second = threading.Thread(target=manager.save_async, args=(20, {"x": x + 1}))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive()  # the queue holds one save: the second waits for the first
    release.set()
    second.join()
    manager.join()
    assert manager.all_steps() == [10, 20]
    assert torch.equal(loaded_grid(manager, 10), grid())
    assert torch.equal(loaded_grid(manager, 20), torch.ones(7, 10))
    meta = {"meta": {"lr": 0.0}}
    manager.load(10, meta, strict=False)
    assert meta == {"meta": {"lr": 0.5}}


def test_a_background_error_surfaces_on_the_next_call_and_at_join(tmp_path, monkeypatch):
    reset_state()
    write, failing = dcp.save, {10, 20}

    def flaky_write(state_dict, checkpoint_id, **kwargs):
        if int(pathlib.Path(checkpoint_id).name.split(".")[1]) in failing:  # (".<step>.tmp-<pid>")
            raise OSError("disk full")
        write(state_dict, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(dcp, "save", flaky_write)
    manager = CheckpointManager(tmp_path, save_interval=10)
    x = sharded_grid()
    manager.save_async(10, {"x": x})
    with pytest.raises(RuntimeError, match="background save of step 10 .*OSError: disk full"):
        manager.join()
    manager.join()  # raised once
    manager.save_async(20, {"x": x})
    with pytest.raises(RuntimeError, match="background save of step 20"):
        manager.save_async(30, {"x": x})  # the next call raises it (having waited for the write)
    manager.save_async(30, {"x": x})
    manager.join()
    assert manager.all_steps() == [30]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["30"]


# --- resuming a killed job --------------------------------------------------------------------------
LR, STEPS, SAVE_AT = 0.05, 6, 3


def make_job(seed):
    """A sharded MLP (uneven specs) and its AdamW, on mesh (8,)."""
    torch.manual_seed(seed)
    model = shard_params(MLP().to(st.device()), mesh_8(), MLP_SPECS)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def job_batches():
    return shard_batches(mlp_batches(STEPS, torch.Generator().manual_seed(7)), mesh_8(), ("d", None), ("d",))


# the job as a user writes it: train, save every SAVE_AT steps; killed right after its first save
KILLED_JOB = textwrap.dedent(
    f"""
    import os, signal, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict
    import shardtensor as st
    from test_checkpoint_manager import job_batches, make_job
    from _training_helpers import train

    model, opt = make_job(seed=0)
    manager = st.checkpoint.CheckpointManager(sys.argv[1], save_interval={SAVE_AT})
    for step, batch in enumerate(job_batches(), start=1):
        loss = train(model, opt, [batch], F.cross_entropy, mode="lazy")
        print("loss", step, loss[0].hex(), flush=True)
        if manager.should_save(step):
            model_sd, optim_sd = get_state_dict(model, opt)
            manager.save(step, {{"model": model_sd, "optim": optim_sd}})
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_killed_job_resumes_with_identical_losses(tmp_path):
    import torch.nn.functional as F

    tests = pathlib.Path(__file__).parent
    path = os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    killed = subprocess.Popen(
        [sys.executable, "-c", KILLED_JOB, str(tmp_path / "ckpts")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:  # meanwhile, the uninterrupted run
        reset_state()
        model, opt = make_job(seed=0)
        losses = train(model, opt, job_batches(), F.cross_entropy, mode="lazy")
        out, err = killed.communicate(timeout=300)
    finally:
        killed.kill()  # (a no-op once it is gone)
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    killed_losses = [float.fromhex(line.split()[2]) for line in out.splitlines() if line.startswith("loss")]
    assert killed_losses == losses[:SAVE_AT]

    # resume with fresh objects (another initialisation: everything comes from the checkpoint)
    reset_state()
    model, opt = make_job(seed=1)
    manager = CheckpointManager(tmp_path / "ckpts", save_interval=SAVE_AT)
    start = max(manager.all_steps())
    assert start == SAVE_AT
    model_sd, optim_sd = get_state_dict(model, opt)  # (creates the optimizer's state to load into)
    manager.load(start, {"model": model_sd, "optim": optim_sd})
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    resumed = train(model, opt, job_batches()[start:], F.cross_entropy, mode="lazy")
    assert resumed == losses[start:]  # exactly
    for p in model.parameters():  # the optimizer's state is sharded like its parameter, as before saving
        assert opt.state[p]["exp_avg"].sharding_spec == p.sharding_spec
