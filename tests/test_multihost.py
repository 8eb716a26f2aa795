"""A multi-host job on this machine: two JAX processes with 4 CPU devices each (jax.distributed, gloo
collectives on 127.0.0.1) form one 8-device mesh. Device ids, uploads, readback (even and uneven),
MpDeviceLoader's per-process minibatches (also from a DistributedSampler) and FSDPv2 training (lazy
and st.compile), each compared with eager torch."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).parent
# DCP warns that it assumes one process when torch.distributed is not initialized: that is the case here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    port, torch_port = _free_port(), _free_port()
    checkpoint_dir = tmp_path_factory.mktemp("dcp")
    _write_from_one_process(checkpoint_dir / "from_one")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_"))}
    env.update(
        SHARDTENSOR_CPU_DEVICES="4",
        SHARDTENSOR_PLATFORM="cpu",
        PYTHONPATH=os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "_multihost_worker.py")]
            + [str(port), str(pid), str(torch_port), str(checkpoint_dir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    out = []
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(next(line for line in stdout.splitlines() if line.startswith("REPORT"))[7:]))
    return out, checkpoint_dir


def _write_from_one_process(path):
    """A checkpoint written by this one process (8 devices), for the two processes to load."""
    import shardtensor as st

    mesh = st.Mesh(range(8), (4, 2))
    st.checkpoint.save({"a": st.shard(torch.arange(54.0).reshape(9, 6), mesh, (0, 1)), "b": torch.ones(3)}, path)


@pytest.fixture(scope="module")
def reports(workers):
    return workers[0]


def _reference():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(16, 6, generator=g)
    W = torch.randn(6, 3, generator=g)
    Y = torch.randint(0, 3, (16,), generator=g)
    return X, W, Y


def test_device_ids_are_global_ordinals(reports):
    """JAX numbers process 1's CPU devices from 2048; shardtensor's ids (and a Mesh's) run 0..7."""
    for r in reports:
        assert r["ids"] == list(range(8))
        assert r["names"] == [f"CPU:{i}" for i in range(8)]
        assert r["owners"] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_uploads_and_readback_match_torch(reports):
    X, W, _ = _reference()
    for pid, r in enumerate(reports):
        assert r["matmul_sum"] == pytest.approx(float((X @ W).sum()), rel=1e-5)
        torch.testing.assert_close(torch.tensor(r["doubled"]), X * 2)
        torch.testing.assert_close(torch.tensor(r["uneven_plus_one"]), X[:13] + 1)
        # each process holds the rows of its own devices: 2 rows per device
        assert r["local_shards"] == [[f"CPU:{d}", 2 * d, 2 * d + 2] for d in range(4 * pid, 4 * pid + 4)]


def test_from_local_and_to_local_with_two_processes(reports):
    blocks = [torch.arange(12.0).reshape(4, 3) + 100 * pid for pid in range(2)]
    total = blocks[0] + blocks[1]
    for pid in range(2):
        shape, full, local = reports[pid]["from_local"]
        assert shape == [8, 3] and full == torch.cat(blocks).tolist() and local == blocks[pid].tolist()
        mine, replicated = reports[pid]["partial_sum"]
        assert mine == blocks[pid].tolist() and replicated == total.tolist()  # the all-reduced sum
        assert reports[pid]["partial_scatter"] == total[4 * pid : 4 * pid + 4].tolist()  # its rows of the sum


def test_loader_minibatches_form_the_global_batch(reports):
    X, _, _ = _reference()
    for r in reports:
        assert r["minibatch_shape"] == [16, 6]
        torch.testing.assert_close(torch.tensor(r["minibatch"]), X)


def test_distributed_sampler_shards_form_the_global_batch(reports):
    """Issue 15: each process loads its DistributedSampler shard (rank r: rows r, r + 2, ... without
    shuffling); MpDeviceLoader with minibatch=True hands the step the global batch, process 0's 4
    rows then process 1's, and a reduction over it is eager torch's on the whole batch."""
    data = torch.arange(32.0 * 3).reshape(32, 3)
    for pid, r in enumerate(reports):
        assert r["sampler_indices"] == list(range(pid, 32, 2))
    assert len(reports[0]["sampler_batches"]) == 4
    for r in reports:
        for step, (batch, row_sum) in enumerate(zip(r["sampler_batches"], r["sampler_row_sums"], strict=True)):
            shards = [reports[pid]["sampler_indices"][4 * step : 4 * step + 4] for pid in range(2)]
            want = data[shards[0] + shards[1]]
            torch.testing.assert_close(torch.tensor(batch), want, rtol=0, atol=0)
            torch.testing.assert_close(torch.tensor(row_sum), want.sum(0))


def test_fsdp_training_matches_eager(reports):
    X, _, Y = _reference()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for _ in range(7):
        loss = F.cross_entropy(model(X), Y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for r in reports:
        assert r["losses"] == pytest.approx(want[:3], rel=1e-5)
        assert r["compiles"] <= 2  # the step compiles once or twice, not per step
        # then 4 steps through st.compile: the last ones replay the frozen program
        assert r["compiled_losses"] == pytest.approx(want[3:], rel=1e-5)
        assert r["replays"] >= 1


def test_dcp_each_process_writes_its_own_shards_once_and_loads_into_another_mesh(reports):
    Z = torch.arange(70.0).reshape(7, 10)
    # mesh (4, 2): process 0's devices 0-3 hold rows 0-3 (both column halves), process 1's rows 4-6
    z_rows = [[0, 2], [4, 6]]
    for pid, r in enumerate(reports):
        z = [offset for fqn, offset in r["dcp_written"] if fqn == "z"]
        assert z == sorted([row, col] for row in z_rows[pid] for col in (0, 5))
        bias = [offset for fqn, offset in r["dcp_written"] if fqn == "bias"]
        assert bias == [[row] for row in z_rows[pid]]  # replicated over mesh axis 1: written once
        loaded_z, loaded_bias, spec = r["dcp_loaded"]
        torch.testing.assert_close(torch.tensor(loaded_z), Z, rtol=0, atol=0)
        torch.testing.assert_close(torch.tensor(loaded_bias), Z[0, :7], rtol=0, atol=0)
        assert spec == "{devices=[4,2]0,4,1,5,2,6,3,7}"
        staged_z, staged_spec = r["dcp_staged"]
        torch.testing.assert_close(torch.tensor(staged_z), Z, rtol=0, atol=0)
        assert staged_spec == "{devices=[1,8]0,1,2,3,4,5,6,7}"


def test_checkpoint_manager_saves_prunes_and_loads_with_two_processes(reports):
    for r in reports:
        steps, fresh_steps, loaded, listing = r["manager"]
        assert listing == ["2"]
        assert steps == fresh_steps == [2]  # max_to_keep=1: step 1 deleted (by rank 0)
        torch.testing.assert_close(torch.tensor(loaded), torch.arange(70.0).reshape(7, 10) * 2, rtol=0, atol=0)


def test_st_save_writes_from_process_0_only_unless_master_only_is_false(reports):
    Z = torch.arange(70.0).reshape(7, 10)
    for pid, r in enumerate(reports):
        master_only, every = r["st_save_paths"]
        assert os.path.exists(master_only) == (pid == 0)
        for path in [every] + [master_only] * (pid == 0):
            loaded = torch.load(path, weights_only=True)
            assert loaded["step"] == 3 and torch.equal(loaded["z"], Z)


def test_checkpoints_move_between_one_and_two_processes(workers):
    """Written atomically by 2 processes, loaded in 1 (sharded, CPU, dcp_to_torch_save); written by
    dcp.async_save in 2; written by 1, loaded in 2 into another mesh and spec, each process reading
    only its own devices' shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import shardtensor as st

    reports, checkpoint_dir = workers
    Z, W = torch.arange(70.0).reshape(7, 10), torch.arange(30.0).reshape(5, 6)
    path = checkpoint_dir / "atomic"
    for r in reports:  # in place, and no temporary directory left
        assert [n for n in r["atomic_listing"] if n.startswith((".atomic", "atomic"))] == ["atomic"]
    assert {p.name.split("_")[2] for p in path.glob("*.distcp")} == {"0", "1"}  # both processes wrote
    mesh = st.Mesh(range(8), (2, 4))
    sharded = {"z": st.shard(torch.zeros(7, 10), mesh, (None, 1)), "w": st.shard(torch.zeros(5, 6), mesh, (0, 1))}
    sharded["step"] = 0
    st.checkpoint.load(sharded, path)
    torch.testing.assert_close(sharded["z"].cpu(), Z, rtol=0, atol=0)
    torch.testing.assert_close(sharded["w"].cpu(), W, rtol=0, atol=0)
    assert sharded["step"] == 7 and sharded["w"].partition_spec == st.PartitionSpec(0, 1)
    cpu = {"z": torch.zeros(7, 10), "w": torch.zeros(5, 6)}
    dcp.load(cpu, checkpoint_id=path)
    torch.testing.assert_close(cpu["z"], Z, rtol=0, atol=0)
    dcp_to_torch_save(path, checkpoint_dir / "full.pt")
    full = torch.load(checkpoint_dir / "full.pt", weights_only=False)
    torch.testing.assert_close(full["w"], W, rtol=0, atol=0)
    assert full["step"] == 7
    async_saved = {"z": torch.zeros(7, 10)}
    dcp.load(async_saved, checkpoint_id=checkpoint_dir / "async")  # (dcp.async_save with HostStager)
    torch.testing.assert_close(async_saved["z"], Z, rtol=0, atol=0)
    A = torch.arange(54.0).reshape(9, 6)
    for pid, r in enumerate(reports):
        a, b, spec = r["from_one"]
        torch.testing.assert_close(torch.tensor(a), A, rtol=0, atol=0)
        assert b == [1.0, 1.0, 1.0] and spec == "{devices=[2,4]0,1,2,3,4,5,6,7}"
        # mesh (2, 4), spec (0, 1): process 0's devices 0-3 hold rows 0-4, process 1's rows 5-8;
        # 6 columns over 4 devices: 2, 2, 2 and one of padding only (no read)
        rows, n = (0, 5) if pid == 0 else (5, 4)
        assert r["from_one_chunks"] == [[[rows, col], [n, 2]] for col in (0, 2, 4)]
