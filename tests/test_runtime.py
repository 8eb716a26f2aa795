"""shardtensor.runtime: devices, attributes, SPMD mode, and how the environment configures JAX."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

import shardtensor.runtime as rt

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, timeout=120, **env_vars) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with no inherited JAX/shardtensor configuration."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_"))}
    env.update(env_vars)
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --------------------------------------------------------------------------- in-process


def test_device_counts():
    assert rt.global_runtime_device_count() == 8
    assert rt.addressable_runtime_device_count() == 8


def test_global_device_attributes_in_global_order():
    attributes = rt.global_runtime_device_attributes()
    assert [a["name"] for a in attributes] == [f"CPU:{i}" for i in range(8)]
    assert [a["id"] for a in attributes] == list(range(8))
    for a in attributes:
        assert a["platform"] == "cpu"
        assert a["device_kind"] == jax.devices()[0].device_kind
        assert a["process_index"] == 0
        assert "slice_index" not in a and "coords" not in a  # CPU devices have neither


def test_attributes_are_a_fresh_copy():
    rt.global_runtime_device_attributes()[0]["name"] = "changed"
    assert rt.global_runtime_device_attributes()[0]["name"] == "CPU:0"


def test_runtime_device_attributes_by_name():
    assert rt.runtime_device_attributes("CPU:3")["id"] == 3
    assert rt.runtime_device_attributes("cpu:5")["name"] == "CPU:5"
    with pytest.raises(ValueError, match="No device named 'TPU:0'"):
        rt.runtime_device_attributes("TPU:0")


def test_jax_devices_ordered_by_id():
    devices = rt.jax_devices()
    assert [d.id for d in devices] == list(range(8))
    assert set(devices) == set(jax.devices())


def test_platform_and_device_type():
    assert rt.platform() == "cpu"
    assert rt.device_type() == "CPU"


def test_single_process():
    assert rt.process_index() == 0
    assert rt.process_count() == 1


def test_64_bit_types_only_inside_the_scope():
    """shardtensor leaves JAX's process-wide x64 flag to the user (tests/test_x64_scope.py has more)."""
    assert not jax.config.jax_enable_x64
    with rt.x64_scope():
        assert jax.numpy.arange(3).dtype == jax.numpy.int64
        with rt.x64_scope():  # nested: nothing to do
            assert jax.numpy.arange(3).dtype == jax.numpy.int64
        assert jax.numpy.arange(3).dtype == jax.numpy.int64
    assert jax.numpy.arange(3).dtype == jax.numpy.int32


def test_is_spmd_follows_use_spmd_and_environment(monkeypatch):
    for name in rt.SPMD_ENVS:
        monkeypatch.delenv(name, raising=False)
    assert not rt.is_spmd()
    rt.use_spmd()
    assert rt.is_spmd()
    assert os.environ["XLA_USE_SPMD"] == "1"  # as PyTorch/XLA's use_spmd sets it (scripts read it)
    monkeypatch.delenv("SHARDTENSOR_USE_SPMD")  # as in PyTorch/XLA: the variables are the state
    monkeypatch.delenv("XLA_USE_SPMD")
    assert not rt.is_spmd()
    monkeypatch.setenv("XLA_USE_SPMD", "1")
    assert rt.is_spmd()
    monkeypatch.setenv("XLA_USE_SPMD", "0")
    assert not rt.is_spmd()


def test_use_spmd_auto_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("SHARDTENSOR_USE_SPMD", raising=False)
    with pytest.raises(NotImplementedError, match="auto-sharding"):
        rt.use_spmd(auto=True)


# --------------------------------------------------------------------------- start-up (subprocesses)


def test_cpu_device_count_from_environment():
    result = run_python(
        """
        import shardtensor.runtime as rt, jax, os
        print(rt.global_runtime_device_count(), jax.config.jax_enable_x64, os.environ['XLA_FLAGS'])
        """,
        SHARDTENSOR_CPU_DEVICES="3",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3", "False", "--xla_force_host_platform_device_count=3"]


def test_cpu_device_count_when_jax_imported_but_not_started():
    result = run_python(
        """
        import jax, os
        os.environ['SHARDTENSOR_CPU_DEVICES'] = '4'
        import shardtensor.runtime as rt
        print(rt.global_runtime_device_count())
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["4"]


def test_platform_from_environment():
    result = run_python("import shardtensor.runtime as rt; print(rt.platform())", SHARDTENSOR_PLATFORM="CPU")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cpu"]


def test_device_count_mismatch_after_jax_started_is_an_error():
    result = run_python(
        """
        import jax, os
        jax.config.update('jax_num_cpu_devices', 2)
        jax.devices()                      # the backend starts with 2 devices
        os.environ['SHARDTENSOR_CPU_DEVICES'] = '4'
        import shardtensor.runtime
        """
    )
    assert result.returncode != 0
    assert "RuntimeError" in result.stderr
    assert "already started with 2 device(s)" in result.stderr
    assert "SHARDTENSOR_CPU_DEVICES=4" in result.stderr
    assert "before importing jax or shardtensor" in result.stderr


def test_device_count_asked_after_import_is_an_error():
    result = run_python(
        """
        import os
        import shardtensor.runtime as rt   # no count asked: JAX will start with XLA_FLAGS' 2
        os.environ['SHARDTENSOR_CPU_DEVICES'] = '4'
        rt.global_runtime_device_count()
        """,
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    assert result.returncode != 0
    assert "conflicts with XLA_FLAGS" in result.stderr


def test_device_count_set_after_import_applies_before_jax_starts():
    # `python -m shardtensor.demo` imports the package before the demo sets the variable
    result = run_python(
        """
        import os
        import shardtensor.runtime as rt
        os.environ['SHARDTENSOR_CPU_DEVICES'] = '4'
        print(rt.global_runtime_device_count())
        """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["4"]


def test_matching_count_after_jax_started_is_fine():
    result = run_python(
        """
        import jax
        jax.config.update('jax_num_cpu_devices', 2)
        jax.devices()
        import shardtensor.runtime as rt
        print(rt.global_runtime_device_count())
        """,
        SHARDTENSOR_CPU_DEVICES="2",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2"]


def test_xla_flags_with_another_count_is_an_error():
    result = run_python(
        "import shardtensor.runtime",
        SHARDTENSOR_CPU_DEVICES="4",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    assert result.returncode != 0
    assert "ValueError: SHARDTENSOR_CPU_DEVICES=4 conflicts with XLA_FLAGS" in result.stderr


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"SHARDTENSOR_PLATFORM": "metal"}, "SHARDTENSOR_PLATFORM='metal' is not a known platform"),
        ({"SHARDTENSOR_CPU_DEVICES": "eight"}, "SHARDTENSOR_CPU_DEVICES must be a positive integer"),
        ({"SHARDTENSOR_CPU_DEVICES": "0"}, "SHARDTENSOR_CPU_DEVICES must be a positive integer"),
    ],
)
def test_bad_environment_values(variables, message):
    result = run_python("import shardtensor.runtime", **variables)
    assert result.returncode != 0
    assert "ValueError: " + message in result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_initialize_distributed_two_cpu_processes():
    code = """
        import json, sys
        import shardtensor.runtime as rt
        rt.initialize_distributed('127.0.0.1:{port}', num_processes=2, process_id={pid})
        print(json.dumps([rt.process_index(), rt.process_count(),
                          rt.global_runtime_device_count(), rt.addressable_runtime_device_count(),
                          [a['process_index'] for a in rt.global_runtime_device_attributes()]]))
    """
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_"))}
    env.update(PYTHONPATH=str(REPO), SHARDTENSOR_CPU_DEVICES="2", SHARDTENSOR_PLATFORM="cpu")
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code.format(port=port, pid=pid))],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in range(2)
    ]
    outputs = [p.communicate(timeout=180) for p in processes]
    for p, (_out, err) in zip(processes, outputs):
        assert p.returncode == 0, err
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    for pid, (index, count, global_count, local_count, owners) in enumerate(reports):
        assert (index, count, global_count, local_count) == (pid, 2, 4, 2)
        assert owners == [0, 0, 1, 1]


def test_subprocess_tests_get_the_suites_compile_flags():
    # tests/conftest.py hands its cheap compile settings to subprocess tests; pytest-xdist's workers
    # inherit XLA_FLAGS with them already in, which once left the hand-over empty
    if os.environ.get("SHARDTENSOR_TEST_FULL_OPT"):
        pytest.skip("SHARDTENSOR_TEST_FULL_OPT: the suite compiles with XLA's defaults")
    handed = os.environ["SHARDTENSOR_TEST_COMPILE_FLAGS"].split()
    assert "--xla_backend_optimization_level=0" in handed and "--xla_cpu_parallel_codegen_split_count=1" in handed
    assert set(handed) <= set(os.environ["XLA_FLAGS"].split())
