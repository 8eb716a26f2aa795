"""Issue 14 §3: the seeds' save calls on ShardedTensors, each read back by plain PyTorch or safetensors.

- ``st.save`` (PyTorch/XLA's ``xr.save``): one ``torch.save`` of CPU copies;
- ``st.serialization.save``/``load`` (``xser``): one file per tensor, peak host memory near the largest one;
- safetensors: ``safetensors.torch.save_file`` itself, and ``st.save_file``/``st.load_file`` (streaming).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import safetensors.torch
import torch
from torch.testing import assert_close

import shardtensor as st


@pytest.fixture
def mesh():
    return st.Mesh(range(8), (4, 2), ("x", "y"))


def sharded_state(mesh):
    """Sharded (one uneven: 10 rows on 4 devices), replicated, a view, bf16, int64 and 0-d tensors,
    with their CPU originals."""
    torch.manual_seed(0)
    cpu = {
        "w": torch.randn(8, 6),
        "uneven": torch.randn(10, 3),
        "bias": torch.randn(6),
        "half": torch.randn(4, 4).to(torch.bfloat16),
        "steps": torch.arange(5),
        "scalar": torch.tensor(2.5),
    }
    on_device = {
        "w": st.shard(cpu["w"], mesh, ("x", "y")),
        "uneven": st.shard(cpu["uneven"], mesh, ("x", None)),
        "bias": cpu["bias"].to(st.device()),
        "half": st.shard(cpu["half"], mesh, (None, "y")),
        "steps": cpu["steps"].to(st.device()),
        "scalar": cpu["scalar"].to(st.device()),
    }
    return cpu, on_device


def assert_same_cpu(loaded, expected):
    assert loaded.keys() == expected.keys()
    for name, value in expected.items():
        assert loaded[name].device.type == "cpu", name
        assert loaded[name].dtype == value.dtype, name
        assert_close(loaded[name], value, rtol=0, atol=0)


def test_storage_identity(mesh):
    """A ShardedTensor's storage answers data_ptr with its cell's identity: the same for detach() and
    views, another for another tensor (what safetensors and transformers group tied weights by)."""
    x = st.shard(torch.randn(8, 4), mesh, ("x", None))
    y = st.shard(torch.randn(8, 4), mesh, ("x", None))
    ptr = x.untyped_storage().data_ptr()
    assert ptr != 0
    assert x.detach().untyped_storage().data_ptr() == ptr
    assert x[2:].untyped_storage().data_ptr() == ptr
    assert y.untyped_storage().data_ptr() != ptr
    assert x.untyped_storage().nbytes() == 8 * 4 * 4
    # a tensor's data_ptr is its storage's plus its offset (safetensors' save_model keeps tensors starting it)
    assert x.data_ptr() == ptr and x[2:].data_ptr() == ptr + 2 * 4 * 4
    assert isinstance(x.untyped_storage(), torch.UntypedStorage)


def test_safetensors_save_file_of_sharded_tensors(mesh, tmp_path):
    """safetensors' own save_file on ShardedTensors, read back by safetensors on CPU."""
    cpu, on_device = sharded_state(mesh)
    safetensors.torch.save_file(on_device, tmp_path / "m.safetensors")
    assert_same_cpu(safetensors.torch.load_file(tmp_path / "m.safetensors"), cpu)
    # tensors sharing a storage cell are refused as for CPU tensors
    with pytest.raises(RuntimeError, match="share memory"):
        safetensors.torch.save_file({"a": on_device["w"], "b": on_device["w"].detach()}, tmp_path / "s.safetensors")


def test_st_save_file_and_load_file(mesh, tmp_path):
    """st.save_file writes safetensors' format (read by safetensors.torch.load_file); st.load_file shards
    each tensor by name or through a callable, and replicates the rest."""
    cpu, on_device = sharded_state(mesh)
    path = tmp_path / "m.safetensors"
    st.save_file(on_device, path, metadata={"format": "pt"})
    assert_same_cpu(safetensors.torch.load_file(path), cpu)
    assert not os.path.exists(str(path) + ".partial")

    loaded = st.load_file(path, specs={"w": (mesh, ("x", "y"))})
    assert all(isinstance(v, st.ShardedTensor) for v in loaded.values())
    assert loaded["w"].sharding_spec == on_device["w"].sharding_spec
    assert loaded["bias"].sharding_spec in ("", "{replicated}")
    assert_same_cpu({k: v.cpu() for k, v in loaded.items()}, cpu)

    by_rule = st.load_file(
        path, specs=lambda name, t: (mesh, ("x",) + (None,) * (t.dim() - 1)) if t.dim() == 2 else None
    )
    assert by_rule["uneven"].sharding_spec == on_device["uneven"].sharding_spec
    assert_close(by_rule["uneven"].cpu(), cpu["uneven"], rtol=0, atol=0)
    assert_same_cpu(st.load_file(path, device="cpu"), cpu)

    with pytest.raises(ValueError, match="specs shard tensors on st.device"):
        st.load_file(path, device="cpu", specs={"w": (mesh, ("x", "y"))})
    with pytest.raises(ValueError, match="'n' is a int, not a tensor"):
        st.save_file({"n": 3}, tmp_path / "bad.safetensors")  # type: ignore[dict-item]


def test_st_save_loads_with_weights_only(mesh, tmp_path):
    """st.save (xr.save): CPU copies in one torch.save; nested structure, non-tensor leaves kept."""
    cpu, on_device = sharded_state(mesh)
    st.save({"model": on_device, "step": 3, "names": ["a", "b"]}, tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)
    assert loaded["step"] == 3 and loaded["names"] == ["a", "b"]
    assert_same_cpu(loaded["model"], cpu)


def test_st_save_master_only(mesh, tmp_path, monkeypatch):
    """In a job of several processes only process 0 writes, unless master_only=False."""
    _, on_device = sharded_state(mesh)
    monkeypatch.setattr(st.runtime, "process_index", lambda: 1)
    st.save(on_device, tmp_path / "skipped.pt")
    st.serialization.save(on_device, tmp_path / "skipped_x.pt")
    st.save_file(on_device, tmp_path / "skipped.safetensors")
    assert os.listdir(tmp_path) == []
    st.save(on_device, tmp_path / "mine.pt", master_only=False)
    assert os.listdir(tmp_path) == ["mine.pt"]


def test_serialization_roundtrip_into_sharded_model(mesh, tmp_path):
    """xser: structure plus one file per tensor; load gives CPU tensors, which load into a sharded model
    and give the same state dict as the original."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).to(st.device())
    st.mark_sharding(model[0].weight, mesh, ("x", "y"))
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    path = tmp_path / "ckpt.pt"
    st.serialization.save({"model": model.state_dict(), "epoch": 2}, path)
    (save_id,) = os.listdir(str(path) + ".tensors")  # (one folder per save)
    assert sorted(os.listdir(f"{path}.tensors/{save_id}")) == [f"tensor_{i}.pt" for i in range(4)]
    loaded = st.serialization.load(path)
    assert loaded["epoch"] == 2
    assert_same_cpu(loaded["model"], expected)

    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).to(st.device())
    other.load_state_dict(loaded["model"])
    assert_same_cpu({k: v.cpu() for k, v in other.state_dict().items()}, expected)

    os.remove(f"{path}.tensors/{save_id}/tensor_3.pt")
    with pytest.raises(FileNotFoundError, match="tensor_3.pt is missing"):
        st.serialization.load(path)


PEAK_SCRIPT = textwrap.dedent(
    """
    import os, resource, sys, torch
    import shardtensor as st
    mesh = st.Mesh(range(8), (8,), ("x",))
    count, rows = 16, 8 * 1024 * 1024 // 4 // 256  # 16 tensors of 8 MiB, float32 [8192, 256]
    state = {}
    for i in range(count):
        state[f"t{i}"] = st.shard(torch.full((rows, 256), float(i)), mesh, ("x", None))
    st.sync()
    torch.save({"warm": torch.zeros(4)}, sys.argv[2] + ".warm")  # (import torch.save's lazy modules first)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    getattr(st.serialization if sys.argv[1] == "xser" else st, "save")(state, sys.argv[2])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(after - before)
    """
)


def test_serialization_peak_host_memory(tmp_path):
    """xser's streaming: saving 16 tensors of 8 MiB raises the peak RSS by at most 1.5x the largest tensor
    + 64 MiB (torch.save of the whole state dict would need 128 MiB of CPU copies at once)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("SHARDTENSOR_TEST_COMPILE_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env["SHARDTENSOR_CPU_DEVICES"] = "8"
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, "xser", str(tmp_path / "x.pt")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    growth = int(out.stdout.split()[-1])
    largest = 8 * 1024 * 1024
    assert growth <= 1.5 * largest + 64 * 1024 * 1024, f"peak RSS grew by {growth / 2**20:.1f} MiB"
    (save_id,) = os.listdir(str(tmp_path / "x.pt") + ".tensors")
    assert len(os.listdir(str(tmp_path / "x.pt") + f".tensors/{save_id}")) == 16
