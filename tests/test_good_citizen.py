"""Importing shardtensor changes nothing for plain PyTorch code: torch's own tools that ask the
registered accelerator for something (pinned memory, streams) keep working on CPU tensors."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader, TensorDataset

import shardtensor as st


def test_dataloader_pin_memory_works_on_cpu_tensors():
    data = TensorDataset(torch.arange(12.0).reshape(6, 2), torch.arange(6))
    batches = list(DataLoader(data, batch_size=4, pin_memory=True))
    assert torch.equal(torch.cat([b[0] for b in batches]), data.tensors[0])
    assert torch.equal(torch.cat([b[1] for b in batches]), data.tensors[1])
    # the pinned batches move to the device like any CPU tensor
    assert torch.equal(batches[0][0].to(st.device()).cpu(), data.tensors[0][:4])


def test_device_tensors_are_not_pinned_and_cannot_be_pinned():
    """DCP, DataLoader and others ask ``is_pinned``; ``pin_memory`` of a non-CPU tensor raises, as torch's
    does for a CUDA tensor."""
    x = st.shard(torch.arange(8.0), st.Mesh(range(8), (8,), ("d",)), ("d",))
    assert x.is_pinned() is False
    with pytest.raises(RuntimeError, match=r"cannot pin 'torch\.shardtensor\.FloatTensor' only dense CPU tensors"):
        x.pin_memory()
    assert torch.equal(x.cpu(), torch.arange(8.0))  # the tensor is untouched


def test_distributed_checkpoint_of_a_plain_state_dict(tmp_path):
    """torch.distributed.checkpoint's default writer overlaps copies on the accelerator's stream."""
    model = torch.nn.Linear(3, 2)
    dcp.save(model.state_dict(), checkpoint_id=tmp_path)
    restored = torch.nn.Linear(3, 2).state_dict()
    dcp.load(restored, checkpoint_id=tmp_path)
    for name, value in model.state_dict().items():
        assert torch.equal(restored[name], value), name


def test_the_torch_distributed_backend_adds_its_name_only():
    """Importing shardtensor registers the backend "shardtensor" (``init_process_group("shardtensor")``)."""
    assert "shardtensor" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["shardtensor"] == ["cpu", "shardtensor"]
    # torch's own choices stay: gloo for CPU tensors, nccl for CUDA
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"
    assert dist.Backend.default_device_backend_map["cuda"] == "nccl"


def test_streams_follow_torch_device_module_conventions():
    module = torch.shardtensor
    stream = module.current_stream()
    assert stream == module.current_stream() and stream.device == st.device()
    x = torch.ones(4).to(st.device()) * 3
    with module.stream(stream):
        stream.wait_stream(module.current_stream())
        stream.synchronize()  # computes what is pending
    module.synchronize()
    assert torch.equal(x.cpu(), torch.full((4,), 3.0))


def test_no_process_wide_warning_filters():
    """shardtensor silences JAX's donation notice only around its own compiles."""
    import warnings

    before = list(warnings.filters)
    w = torch.nn.Parameter(torch.ones(8, 4).to(st.device()))
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(2):
        (w * w).sum().backward()
        opt.step()
        opt.zero_grad()
        st.sync()
    assert torch.allclose(w.cpu(), torch.full((8, 4), 0.64))
    assert warnings.filters == before
    assert not any("donated" in str(f[1]) for f in warnings.filters)


# ------------------------------------------------------------------ the C++ extension's first build
def test_without_a_prebuilt_module_the_first_import_builds_it_says_so_and_a_failed_build_warns_in_one_line(
    monkeypatch, tmp_path, capsys
):
    import pytest
    from torch.utils import cpp_extension

    from shardtensor.tensor import device

    monkeypatch.setattr(device, "_prebuilt_extension", lambda: (None, "no prebuilt module"))
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda name, **kw: name)
    assert device._load_cpp_extension().startswith("shardtensor_device_ext_")
    err = capsys.readouterr().err
    assert "building its C++ device extension (no prebuilt module)" in err and "built in" in err
    assert str(tmp_path) in err

    def fail(name, **kw):
        raise RuntimeError("Error building extension 'x'\n" + "g++: fatal error\n" * 50)

    monkeypatch.setattr(cpp_extension, "load", fail)
    with pytest.warns(RuntimeWarning) as caught:
        assert device._load_cpp_extension() is None
    (message,) = [str(w.message) for w in caught]
    assert "\n" not in message and "Error building extension 'x'" in message and "pip install ninja" in message


def test_a_prebuilt_module_for_another_torch_or_an_older_source_is_not_used(monkeypatch):
    """A module compiled against another torch release, or from an older device_guard.cpp (an
    editable install), is left unregistered; the lazy build takes over and says why."""
    import sys
    import types

    from shardtensor.tensor import device

    stale = types.ModuleType("shardtensor.tensor._device_ext")
    stale.TORCH_VERSION = "2.12.0"
    stale.SOURCE_ID = device._source_id(device._source_bytes())
    monkeypatch.setitem(sys.modules, "shardtensor.tensor._device_ext", stale)
    ext, why_not = device._prebuilt_extension()
    assert ext is None and "2.12.0" in why_not and torch.__version__.split("+")[0] in why_not
    monkeypatch.setattr(device, "_build_cpp_extension", lambda why: ("built", why))
    assert device._load_cpp_extension() == ("built", why_not)

    stale.TORCH_VERSION = torch.__version__.split("+")[0]
    assert device._prebuilt_extension()[0] is stale
    stale.SOURCE_ID = device._source_id(b"// an older device_guard.cpp")
    assert device._prebuilt_extension() == (None, "the prebuilt module is older than device_guard.cpp")

    monkeypatch.setitem(sys.modules, "shardtensor.tensor._device_ext", None)  # (absent: import fails)
    assert device._prebuilt_extension() == (None, "no prebuilt module")


def test_the_extension_name_is_per_source_and_torch_version():
    from shardtensor.tensor import device

    assert device._extension_name("a") == device._extension_name("a") != device._extension_name("b")


def test_ninja_is_found_without_an_activated_venv(monkeypatch, tmp_path):
    import os
    import shutil
    import sys

    from shardtensor.tensor import device

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "ninja").write_text("#!/bin/sh\n")
    (fake_bin / "ninja").chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "executable", str(fake_bin / "python"))
    monkeypatch.setitem(sys.modules, "ninja", None)  # (no ninja package: the interpreter's directory)
    assert device._ninja_dir() == str(fake_bin)
    path = os.environ.get("PATH")
    with device._ninja_on_path():
        assert os.environ["PATH"].split(os.pathsep)[0] == str(fake_bin)
    assert os.environ.get("PATH") == path


# ------------------------------------------------------------------ the first run says what it does
def test_a_slow_compile_is_logged_at_info_under_the_shardtensor_logger(monkeypatch, caplog):
    import logging

    from shardtensor.graph import execute

    monkeypatch.setattr(execute, "SLOW_COMPILE_SECONDS", 0.0)  # every compile counts as slow here
    x = torch.arange(8.0).to(st.device())
    with caplog.at_level(logging.INFO, logger="shardtensor"):
        assert torch.equal((x * 3 + 1.5).cpu(), torch.arange(8.0) * 3 + 1.5)
    said = [r for r in caplog.records if r.name == "shardtensor" and r.levelno == logging.INFO]
    assert said and "compiled a program of" in said[-1].getMessage() and " s;" in said[-1].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardtensor"):  # the user's level decides
        (x * 5 - 1).cpu()
    assert not [r for r in caplog.records if r.name == "shardtensor"]


def test_the_demo_progress_bar_is_a_jupyter_widget_there():
    import inspect

    from shardtensor import demo

    assert "from tqdm.auto import tqdm" in inspect.getsource(demo)
