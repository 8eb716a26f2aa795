"""Issue 49: the torch_xla face is opt-in. Without ``shardtensor.xla.install()`` or ``python -m
shardtensor.xla`` nothing changes (checked in a fresh process); ``uninstall()`` puts everything back;
a real torch_xla is never shadowed; the face imports only shardtensor's public API; and
``st.alias_device`` (the public API the face routes ``'xla'`` devices with) checks its input."""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import shardtensor as st
import shardtensor.xla

REPO = Path(__file__).resolve().parents[1]


def _python(args: list[str], cwd: Path, **env_vars) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_", "PJRT_"))}
    flags = os.environ.get("SHARDTENSOR_TEST_COMPILE_FLAGS", "")
    env.update(PYTHONPATH=str(REPO), SHARDTENSOR_CPU_DEVICES="8", SHARDTENSOR_PLATFORM="cpu", XLA_FLAGS=flags)
    env.update(env_vars)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


NOTHING_CHANGES = """
import importlib.util, os, sys
import torch
rdzv = importlib.import_module("torch.distributed.rendezvous")
import shardtensor as st, shardtensor.xla

TORCH_COMPILE = torch.compile


def state():
    return {
        "torch_xla importable": importlib.util.find_spec("torch_xla") is not None,
        "torch_xla modules": sorted(m for m in sys.modules if m.split(".")[0] == "torch_xla"),
        "Tensor.to": torch.Tensor.to is torch._C.TensorBase.to,
        "torch.tensor": type(torch.tensor).__name__,
        "torch.compile": torch.compile is TORCH_COMPILE,
        "autocast": torch.amp.autocast_mode.autocast.__init__.__module__,
        "xla://": "xla" in rdzv._rendezvous_handlers,
        "finders": [type(f).__name__ for f in sys.meta_path],
        "XLA_USE_SPMD": os.environ.get("XLA_USE_SPMD"),
    }

def xla_tensor_error():
    try:
        torch.randn(2).to("xla")
    except RuntimeError as e:
        return str(e)
    return "no error"

before = state()
assert before["torch_xla importable"] is False and before["torch_xla modules"] == [], before
assert before["Tensor.to"] and before["torch.tensor"] == "builtin_function_or_method", before
assert before["torch.compile"] and before["autocast"] == "torch.amp.autocast_mode", before
assert not before["xla://"] and before["XLA_USE_SPMD"] is None and not shardtensor.xla.installed(), before
assert "PyTorch is not linked with support for xla devices" in xla_tensor_error()
try:
    import torch_xla
    raise AssertionError("torch_xla imported without the opt-in")
except ModuleNotFoundError:
    pass

shardtensor.xla.install()
import torch_xla
assert torch_xla.device() == st.device() and isinstance(torch.randn(2).to("xla"), st.ShardedTensor)
assert torch.compile is not TORCH_COMPILE
shardtensor.xla.uninstall()
after = state()
assert after == before, (before, after)
assert "PyTorch is not linked with support for xla devices" in xla_tensor_error()
print("OK")
"""


def test_without_the_opt_in_nothing_changes_and_uninstall_puts_it_back(tmp_path):
    result = _python(["-c", NOTHING_CHANGES], tmp_path)
    assert result.returncode == 0 and result.stdout.split() == ["OK"], result.stdout + result.stderr[-3000:]


SCRIPT = """
import sys, torch
import torch_xla
import torch_xla.core.xla_model as xm
print("argv", sys.argv[1:], "main", __name__, "file", __file__.endswith("train.py"))
print("device", xm.xla_device() == torch_xla.device(), type(torch.ones(2, device="xla")).__name__)
try:
    import torch_xla.experimental.scan
except ModuleNotFoundError as e:
    print("missing", e)
sys.exit(3)
"""


def test_python_m_runs_a_script_as_python_would(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    result = _python(["-m", "shardtensor.xla", "train.py", "--steps", "2"], tmp_path)
    assert result.returncode == 3, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "argv ['--steps', '2'] main __main__ file True"
    assert lines[1] == "device True ShardedTensor"
    assert lines[2].startswith("missing No module named 'torch_xla.experimental.scan': shardtensor's torch_xla face")
    assert "Python loop" in lines[2]


def test_python_m_without_a_script_prints_its_usage(capsys):
    from shardtensor.xla.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2 and "usage: python -m shardtensor.xla script.py" in capsys.readouterr().err
    assert not shardtensor.xla.installed()


def test_a_real_torch_xla_is_never_shadowed(tmp_path, monkeypatch):
    fake = tmp_path / "site" / "torch_xla"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(fake.parent))
    with pytest.raises(shardtensor.xla.TorchXlaPresentError, match=r"a real torch_xla is importable here \(.*site"):
        shardtensor.xla.install()
    from shardtensor.xla.__main__ import main  # (python -m shardtensor.xla installs the same way)

    with pytest.raises(shardtensor.xla.TorchXlaPresentError, match="never shadows it"):
        main([str(tmp_path / "train.py")])
    assert not shardtensor.xla.installed() and "torch_xla" not in sys.modules


# the modules of the face may import these (the public API) and their own package only
_PUBLIC = {"shardtensor", "shardtensor.fsdp"}


def test_the_face_uses_only_the_public_api():
    root = REPO / "shardtensor" / "xla"
    wrong = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
                if node.module == "shardtensor":
                    targets += [f"shardtensor.{a.name}" for a in node.names if a.name.startswith("_")]
            else:
                private = isinstance(node, ast.Attribute) and node.attr.startswith("_")
                if private and isinstance(node.value, ast.Name) and node.value.id == "st":
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: st.{node.attr}")
                continue
            for target in targets:
                if (
                    target.split(".")[0] == "shardtensor"
                    and target not in _PUBLIC
                    and not target.startswith("shardtensor.xla")
                ):
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: imports {target}")
    assert not wrong, "the face reaches below shardtensor's public API:\n" + "\n".join(wrong)


def test_alias_device_refuses_what_it_cannot_alias_and_removes_cleanly():
    with pytest.raises(ValueError, match="a device torch runs itself"):
        st.alias_device("cpu")
    with pytest.raises(ValueError, match="a device torch runs itself"):
        st.alias_device(st.device().type)
    with pytest.raises(ValueError, match=r"takes a device type such as 'xla', got 'xla:0'"):
        st.alias_device("xla:0")
    with pytest.raises(ValueError, match="not a torch device type"):
        st.alias_device("nonsense")
    original = torch.Tensor.to
    alias = st.alias_device("xla")
    try:
        with pytest.raises(ValueError, match="already aliased"):
            st.alias_device("xla")
        assert alias.active and torch.Tensor.to is not original
        torch.testing.assert_close(torch.arange(3).to("xla").cpu(), torch.arange(3))
    finally:
        alias.remove()
    alias.remove()  # a second remove does nothing
    assert not alias.active and torch.Tensor.to is original
    with pytest.raises(RuntimeError, match="not linked with support for xla devices"):
        torch.arange(3).to("xla")
