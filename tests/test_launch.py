"""Starting a multi-process job: `st.launch` (results, a process that raises, a process killed) and
torchrun with ``SHARDTENSOR_AUTO_DISTRIBUTED=1``; each job runs a computation sharded over every
process's devices, compared with eager torch."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

import shardtensor as st
import shardtensor.runtime as rt
from _launch_worker import _global_inputs, kill_0, raise_in_1, sharded_rows

HERE = pathlib.Path(__file__).parent


def _expected():
    X, W = _global_inputs()
    return X @ W


def test_launch_returns_each_process_result():
    # conftest's 8 simulated devices: 4 in each of the 2 processes
    results = st.launch(sharded_rows, args=(3.0,), nprocs=2)
    assert [r["index"] for r in results] == [0, 1]
    for index, r in enumerate(results):
        assert (r["process_index"], r["process_count"], r["devices"], r["local_devices"]) == (index, 2, 8, 4)
        torch.testing.assert_close(r["result"], _expected() * 3.0)


def test_a_process_that_raises_fails_the_launch_with_its_index_and_traceback():
    with pytest.raises(st.LaunchError, match="process 1 of 2 raised ValueError: process 1 refuses") as info:
        st.launch(raise_in_1, nprocs=2, devices_per_process=1)
    error = info.value
    assert error.index == 1 and error.exitcode in (1, -9)  # it exits with 1, or is stopped while leaving
    assert "in raise_in_1" in error.traceback and 'raise ValueError("process 1 refuses")' in error.traceback
    assert isinstance(error.__cause__, ValueError)
    # process 0 waited in a collective for process 1: stopped by launch (SIGKILL), or it saw process 1's
    # connection close within the grace period and raised itself
    stopped = error.others[0] == "was still running and was stopped" and error.exitcodes[0] == -9
    raised = error.others[0].startswith("raised ") and "Gloo" in error.others[0] and error.exitcodes[0] == 1
    assert stopped or raised, (error.others, error.exitcodes)


def test_a_killed_process_fails_the_launch_and_the_survivor_raises(monkeypatch):
    # the survivor's collective fails when gloo sees the connection close, or after this timeout
    monkeypatch.setenv(rt.COLLECTIVE_TIMEOUT_ENV, "5")
    with pytest.raises(st.LaunchError, match="process 0 of 2 died from SIGKILL") as info:
        st.launch(kill_0, nprocs=2, devices_per_process=1, grace_period=60)
    assert info.value.index == 0 and info.value.exitcode == -9
    survivor = info.value.others[1]
    # a Python exception from its next collective (the matmul's all-reduce or the readback's gather),
    # then an exit of its own: not SIGABRT from JAX's client, not stopped by launch
    assert survivor.startswith("raised ") and "Gloo" in survivor and "failed" in survivor
    assert info.value.exitcodes == [-9, 1]


def test_launch_refuses_bad_arguments():
    with pytest.raises(ValueError, match="only 'spawn'"):
        st.launch(sharded_rows, nprocs=2, start_method="fork")
    with pytest.raises(ValueError, match="do not split evenly over 3 processes"):
        st.launch(sharded_rows, nprocs=3)
    with pytest.raises(ValueError, match="nprocs must be a positive int"):
        st.launch(sharded_rows, nprocs=0)
    with pytest.raises(TypeError, match="args must be a tuple"):
        st.launch(sharded_rows, args=[1.0], nprocs=2)


def test_initialize_distributed_without_arguments_names_the_missing_torchrun_variables(monkeypatch):
    for name in rt.TORCHRUN_ENVS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(RuntimeError, match="MASTER_PORT, RANK, WORLD_SIZE are not set"):
        rt.initialize_distributed()
    with pytest.raises(ValueError, match="together"):
        rt.initialize_distributed("127.0.0.1:1234")


def _two_free_ports() -> int:
    """A port P with P + 1 free too: torchrun's store takes P, JAX's coordinator P + 1."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def test_torchrun_with_auto_distributed(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_"))}
    env.update(
        SHARDTENSOR_CPU_DEVICES="2",
        SHARDTENSOR_PLATFORM="cpu",
        SHARDTENSOR_AUTO_DISTRIBUTED="1",
        XLA_FLAGS=os.environ.get("SHARDTENSOR_TEST_COMPILE_FLAGS", ""),
        PYTHONPATH=os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]),
        REPORT_DIR=str(tmp_path),
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1"]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(_two_free_ports())]
    done = subprocess.run(
        command + [str(HERE / "_launch_worker.py")], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert (r["process_index"], r["process_count"], r["devices"]) == (r["rank"], 2, 4)
        torch.testing.assert_close(torch.tensor(r["result"]), _expected())
