"""Starting a multi-process job: `st.launch` (results, host values through `st.rendezvous` and
`st.mesh_reduce`, a process that raises, a process killed) and torchrun with
``SHARDTENSOR_AUTO_DISTRIBUTED=1`` (a job, and one whose rank 0 is killed); each job runs a computation
sharded over every process's devices, compared with eager torch. Also: process 0's coordination service
process (it ends after the job), and a job that cannot form."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import shardtensor as st
import shardtensor.runtime as rt
from _launch_worker import _global_inputs, kill_0, raise_in_1, sharded_rows
from shardtensor.runtime import service_process

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
        # host values across the processes: every process gets every payload, in process order
        assert r["rendezvous"] == [[b"p0", b"p1"], [b"again0", b"again1"]]
        torch.testing.assert_close(r["mesh_reduce"], _expected() * 3.0 * (1 + 2))
        assert r["mesh_reduce_int"] == [10, 11]
    message = results[0]["timed_out"]
    assert "rendezvous('only_0') in process 0: process 1 did not arrive within 0.5 s" in message, message
    assert results[1]["timed_out"] is None


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


def test_the_root_failure_is_the_killed_process_whichever_failure_was_seen_first():
    """A killed process's peer may fail (its collective) before the parent sees the death: the death
    is reported, as in the test above whichever order the two came in. SIGABRT is a runtime's own
    abort (a consequence), and without a death the first failure seen stays the one reported."""
    launching = sys.modules["shardtensor.distributed.launch"]  # (the package's `launch` is the function)

    assert launching._root_failure([1, 0], {0: -signal.SIGKILL}) == 0
    assert launching._root_failure([0, 1], {0: -signal.SIGKILL}) == 0
    assert launching._root_failure([1, 0], {0: -signal.SIGABRT}) == 1
    assert launching._root_failure([1, 0], {0: 1}) == 1
    assert launching._root_failure([1], {}) == 1


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


def _torchrun(report_dir, port: int, **env_vars) -> subprocess.CompletedProcess:
    """tests/_launch_worker.py under ``torchrun --nproc-per-node 2 --master-port port`` (joining at
    import), reporting to report_dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_"))}
    env.update(
        SHARDTENSOR_PLATFORM="cpu",
        SHARDTENSOR_AUTO_DISTRIBUTED="1",
        XLA_FLAGS=os.environ.get("SHARDTENSOR_TEST_COMPILE_FLAGS", ""),
        PYTHONPATH=os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]),
        REPORT_DIR=str(report_dir),
        **env_vars,
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1"]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(port), str(HERE / "_launch_worker.py")]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def _service_processes(port: int) -> list[int]:
    """The pids of live processes hosting a coordination service on port (process 0's service process)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:  # not a process, or it ended meanwhile
            continue
        if "service_process.py" in command and f':{port}"' in command:  # in its arguments: "[::]:port"
            found.append(int(entry.name))
    return found


def _gone(port: int) -> bool:
    """Whether process 0's service process on port has ended, given a few seconds to do so."""
    for _ in range(50):
        if not _service_processes(port):
            return True
        time.sleep(0.2)
    return False


def test_torchrun_with_auto_distributed(tmp_path):
    port = _two_free_ports()
    done = _torchrun(tmp_path, port, SHARDTENSOR_CPU_DEVICES="2")
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert (r["process_index"], r["process_count"], r["devices"]) == (r["rank"], 2, 4)
        torch.testing.assert_close(torch.tensor(r["result"]), _expected())
        assert r["all_reduce"] == [3.0, 3.0]  # torch.distributed's group of the job: 1 + 2
    assert _gone(port + 1)  # the job over, process 0's service process ended by itself


def test_torchrun_rank_0_killed_the_survivor_raises_and_exits(tmp_path):
    # rank 0, which starts the coordination service (in a process of its own), is SIGKILLed after a first
    # collective; rank 1's next collective fails when gloo sees the connection close, or after this timeout
    port = _two_free_ports()
    done = _torchrun(tmp_path, port, SHARDTENSOR_CPU_DEVICES="1", KILL_RANK_0="1", SHARDTENSOR_COLLECTIVE_TIMEOUT="5")
    assert done.returncode != 0 and "exitcode  : -9" in done.stderr  # torchrun reports rank 0's death
    survivor = json.loads((tmp_path / "1.json").read_text())
    assert survivor["raised"] is not None and "Gloo" in survivor["raised"], survivor
    # then it got through its exit, its last exit hook ran: no SIGABRT from JAX's client, no hang
    assert (tmp_path / "1.left").exists(), done.stderr[-3000:]
    assert "rank      : 1" not in done.stderr, done.stderr[-3000:]  # torchrun saw it end well
    assert _gone(port + 1)


def test_process_0s_service_process_lets_the_live_processes_leave_together_and_ends_after_the_last():
    # a port in use: a clear error at once
    taken = service_process._watch_socket("[::]:0")
    options = {"heartbeat_timeout": 10, "recoverable": True}
    with taken, pytest.raises(RuntimeError, match="could not start JAX's coordination service on .*Choose another"):
        service_process.ServiceProcess.start(f"[::]:{taken.getsockname()[1]}", 2, options, linger=60)
    service = service_process.ServiceProcess.start("[::]:0", 3, options, linger=60)
    first, second, third = (service_process.connect_watcher("127.0.0.1", service.watch_address(), i) for i in range(3))
    stranger = socket.create_connection(("127.0.0.1", service.port))
    stranger.sendall(b"not-the-token 1\n")
    assert not service_process.wait_to_leave(first, 0.5)  # the others are not leaving yet: it waits, times out
    third.close()  # a process that dies is not waited for
    assert service_process.wait_to_leave(second, 60) and service_process.wait_to_leave(first, 60)
    first.close()
    second.close()
    assert service.process.wait(timeout=60) == 0  # ended by itself, with the last process (a stranger aside)
    stranger.close()


def _join_script(call: str) -> list[str]:
    """A process that tries ``initialize_distributed(call)`` (1 s to join) and prints what it raised."""
    lines = ["import os", "import shardtensor.runtime as rt", "os.environ[rt.INIT_TIMEOUT_ENV] = '1'"]
    lines += ["try:", f"    rt.initialize_distributed({call})", "    print('joined', flush=True)"]
    lines += ["except Exception as e:", "    print(type(e).__name__, e, flush=True)"]
    return [sys.executable, "-c", "\n".join(lines)]


def _run_together(*commands: list[str]) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_"))}
    env.update(PYTHONPATH=str(HERE.parent), SHARDTENSOR_CPU_DEVICES="1", SHARDTENSOR_PLATFORM="cpu")
    started = [
        subprocess.Popen(c, cwd=HERE.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in commands
    ]
    outputs = [p.communicate(timeout=120) for p in started]
    for p, (_out, err) in zip(started, outputs):
        assert p.returncode == 0, err[-3000:]  # an exception, caught: no abort
    return [out for out, _err in outputs]


def test_a_job_that_cannot_form_raises_in_every_process():
    # four processes at once: process 1 where no coordinator ever comes up; process 0 of 2 whose
    # coordinator starts but whose process 1 never comes (both with the 1 s join timeout); and a job
    # whose process 0 expects 2 processes and process 1 expects 3 (JAX's coordinator, process 0's, lets
    # 1 in; 30 s to join, however slowly the two start)
    ports: set[int] = set()
    while len(ports) < 3:
        ports.add(_two_free_ports())
    nobody, alone, mismatched = (f"'127.0.0.1:{port}'" for port in ports)
    patient = "initialization_timeout=30"
    calls = [f"{nobody}, 2, 1", f"{alone}, 2, 0", f"{mismatched}, 2, 0, {patient}", f"{mismatched}, 3, 1, {patient}"]
    missing_coordinator, missing_process, *mismatch = (
        out.strip() for out in _run_together(*(_join_script(call) for call in calls))
    )
    assert missing_coordinator.startswith("TimeoutError initialize_distributed: process 1 of 2 could not join")
    assert f"No coordinator answers at {nobody[1:-1]}: start process 0" in missing_coordinator
    assert missing_process.startswith("TimeoutError initialize_distributed: process 0 of 2 could not join")
    assert "The coordinator answers, but not all processes joined" in missing_process
    assert mismatch == 2 * [
        "ValueError initialize_distributed: the processes were started with different numbers of processes "
        "(num_processes / WORLD_SIZE, by process id: {0: 2, 1: 3}). Start every process with the same number."
    ]


_SETS_ITS_OWN_COUNT = """
import os
os.environ["SHARDTENSOR_CPU_DEVICES"] = "8"  # an assignment: it runs again in each spawned process
import shardtensor as st

def count(index):
    return st.global_runtime_device_count()

if __name__ == "__main__":
    try:
        st.launch(count, nprocs=2, grace_period=0)
    except st.LaunchError as e:
        print("LaunchError:", e)
"""


def test_a_script_that_sets_the_device_count_again_in_launchs_processes_is_told_why(tmp_path):
    # the processes re-run the script's top, which replaces launch's 4 devices each by 8 again:
    # each says that launch split the 8 devices and what to write instead, and launch reports it
    script = tmp_path / "sets_its_own_count.py"
    script.write_text(_SETS_ITS_OWN_COUNT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_"))}
    env.update(PYTHONPATH=str(HERE.parent), SHARDTENSOR_PLATFORM="cpu")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "LaunchError: process " in done.stdout, done.stdout + done.stderr[-3000:]
    told = (
        "SHARDTENSOR_CPU_DEVICES=8 was set again in a process of shardtensor.launch, which gave each of its 2 "
        "processes 4 simulated CPU devices"
    )
    assert done.stderr.count(told) >= 1, done.stderr[-3000:]
    assert "os.environ.setdefault('SHARDTENSOR_CPU_DEVICES', '8') instead" in done.stderr
    assert "devices_per_process=N" in done.stderr


def test_launchs_count_set_again_after_import_is_told_why(monkeypatch):
    # the same, where the script imports shardtensor before it sets the count (checked when the
    # devices are first listed): the message of the process's configuration, in this process
    monkeypatch.setenv(rt.LAUNCH_DEVICES_ENV, "4 2")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    with pytest.raises(ValueError, match=r"gave each of its 2 processes 4 simulated CPU devices \(8 in all"):
        rt._add_device_count_flag(8)
    monkeypatch.delenv(rt.LAUNCH_DEVICES_ENV)  # not launch's: the general message
    with pytest.raises(ValueError, match="conflicts with XLA_FLAGS"):
        rt._add_device_count_flag(8)
