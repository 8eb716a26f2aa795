"""Issue 35: files a user loads never run code, and loads that would return wrong values raise.

Every loader of shardtensor (``st.checkpoint.load``, ``CheckpointManager``, ``st.serialization.load``,
``st.mesh_reduce``) meets a payload whose ``__reduce__`` would create a marker file: the file is never
created and the error names what was refused. A flipped byte or a file of another checkpoint is
detected by the checksums the save recorded; the manager's steps and ``load_file``'s specs are checked.
"""

import json
import pickle
import shutil
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardtensor as st
from _training_helpers import reset_state
from shardtensor.checkpoint import CheckpointManager
from shardtensor.checkpoint.safe_reading import UnsafeCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Payload:
    """Unpickled, it would create the file ``marker`` (what an attacker's code could do instead)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def grid(scale=1.0):
    return torch.arange(70.0).reshape(7, 10) * scale


@pytest.fixture
def mesh():
    reset_state()
    yield st.Mesh(range(8), (4, 2))
    reset_state()


def test_a_metadata_file_with_a_payload_is_refused_by_load_and_the_manager(mesh, tmp_path):
    marker = tmp_path / "marker"
    manager = CheckpointManager(tmp_path / "ckpts", save_interval=1)
    manager.save(1, {"x": st.shard(grid(), mesh, (0, 1))})
    checkpoint = tmp_path / "ckpts" / "1"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    target = {"x": torch.zeros(7, 10)}
    with pytest.raises(UnsafeCheckpointError, match=r"1/\.metadata refers to (io|builtins)\.open"):
        st.checkpoint.load(target, checkpoint)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata refers to"):
        manager.load(1, target)
    assert not marker.exists()
    assert torch.equal(target["x"], torch.zeros(7, 10))


def test_a_non_tensor_value_with_a_payload_is_refused_when_saved_and_when_loaded(mesh, tmp_path):
    marker = tmp_path / "marker"
    x = st.shard(grid(), mesh, (0, 1))
    with pytest.raises(TypeError, match=r"'opt\.step' is a Payload, which a load could read back only by running code"):
        st.checkpoint.save({"x": x, "opt": {"step": Payload(marker)}}, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    manager = CheckpointManager(tmp_path / "managed", save_interval=1)
    with pytest.raises(TypeError, match=r"'step' is a Payload"):  # (on the caller, not in the background)
        manager.save_async(1, {"x": x, "step": Payload(marker)})
    manager.join()
    assert manager.all_steps() == []
    # a checkpoint someone else wrote with plain DCP (which pickles the value as it is)
    dcp.save({"x": x, "step": Payload(marker)}, checkpoint_id=tmp_path / "ckpts" / "5")
    (tmp_path / "ckpts" / "5" / ".manager_metadata").write_text(json.dumps({"step": 5, "save_index": 1}))
    target = {"x": torch.zeros(7, 10), "step": 0}
    with pytest.raises(
        UnsafeCheckpointError, match=r"value of 'step' is not plain data \(.*it refers to (io|builtins)\.open\)"
    ):
        st.checkpoint.load(target, tmp_path / "ckpts" / "5")
    with pytest.raises(UnsafeCheckpointError, match="'step'"):
        CheckpointManager(tmp_path / "ckpts", save_interval=1).load(5, target)
    assert not marker.exists()
    assert torch.equal(target["x"], torch.zeros(7, 10)) and target["step"] == 0  # nothing was loaded
    # plain values load: numbers, strings, lists, dicts, tensors
    plain = {"x": x, "step": 7, "name": "run", "betas": (0.9, 0.99), "hist": [1.5, {"a": torch.ones(2)}]}
    st.checkpoint.save(plain, tmp_path / "plain")
    target = {"x": torch.zeros(7, 10), "step": 0, "name": "", "betas": (0, 0), "hist": [0.0, {"a": torch.zeros(2)}]}
    st.checkpoint.load(target, tmp_path / "plain")
    assert (target["step"], target["name"], target["betas"], target["hist"][0]) == (7, "run", (0.9, 0.99), 1.5)
    torch.testing.assert_close(target["hist"][1]["a"], torch.ones(2), rtol=0, atol=0)
    torch.testing.assert_close(target["x"], grid(), rtol=0, atol=0)


def test_the_managers_metadata_with_a_payload_is_skipped(mesh, tmp_path):
    marker = tmp_path / "marker"
    CheckpointManager(tmp_path, save_interval=1).save(2, {"x": st.shard(grid(), mesh, (0, 1))})
    (tmp_path / "2" / ".manager_metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.warns(UserWarning, match="skipping .*2: unreadable .manager_metadata"):
        assert CheckpointManager(tmp_path, save_interval=1).all_steps() == []
    assert not marker.exists()


def test_xser_files_with_a_payload_are_refused_naming_the_file(mesh, tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "state.pt"
    torch.save({"w": torch.ones(2), "evil": Payload(marker)}, path)
    with pytest.raises(pickle.UnpicklingError, match=r"state\.pt holds objects .*it refers to (io|builtins)\.open"):
        st.serialization.load(path)
    st.serialization.save({"w": st.shard(grid(), mesh, (0, 1))}, path)
    (folder,) = (tmp_path / "state.pt.tensors").iterdir()
    torch.save(Payload(marker), folder / "tensor_0.pt")
    with pytest.raises(pickle.UnpicklingError, match=r"tensor_0\.pt holds objects"):
        st.serialization.load(path)
    assert not marker.exists()


def test_mesh_reduce_exchanges_plain_data_and_refuses_a_payload(tmp_path):
    marker = tmp_path / "marker"
    values = [np.arange(3.0), np.float32(1.5), torch.ones(2, dtype=torch.bfloat16), {"loss": 0.25}, "ok"]
    (got,) = st.mesh_reduce("plain", values, lambda xs: xs)
    np.testing.assert_array_equal(got[0], values[0])
    assert got[1] == values[1] and got[1].dtype == np.float32 and got[3:] == values[3:]
    torch.testing.assert_close(got[2], values[2], rtol=0, atol=0)
    with pytest.raises(
        TypeError,
        match=r"mesh_reduce\('evil'\): the value of process 0 is not plain data \(it holds (io|builtins)\.open\)",
    ):
        st.mesh_reduce("evil", [1.0, Payload(marker)], lambda xs: xs)
    assert not marker.exists()


def test_a_flipped_byte_or_a_shard_of_another_checkpoint_is_named(mesh, tmp_path):
    manager = CheckpointManager(tmp_path / "ckpts", save_interval=1)
    manager.save(1, {"model": {"w": st.shard(grid(), mesh, (0, 1)), "b": st.shard(torch.arange(7.0), mesh, (0,))}})
    manager.save(2, {"model": {"w": st.shard(grid(2), mesh, (0, 1)), "b": st.shard(torch.arange(7.0), mesh, (0,))}})
    first, second = tmp_path / "ckpts" / "1", tmp_path / "ckpts" / "2"

    def target():
        return {"model": {"w": st.shard(torch.full((7, 10), 5.0), mesh, (1, 0)), "b": torch.zeros(7)}}

    shutil.copytree(first, tmp_path / "flipped")
    storage = dcp.FileSystemReader(first).read_metadata().storage_data
    item = next(info for index, info in storage.items() if index.fqn == "model.w" and tuple(index.offset) == (2, 5))
    data = bytearray((first / item.relative_path).read_bytes())
    data[item.offset + item.length - 3] ^= 0x10  # (inside the tensor's bytes: its value changes)
    (tmp_path / "flipped" / item.relative_path).write_bytes(bytes(data))
    state = target()
    with pytest.raises(
        st.checkpoint.CheckpointCorruptError,
        match=r"the bytes of 'model\.w' \(its shard at offsets \(2, 5\)\) do not match",
    ):
        st.checkpoint.load(state, tmp_path / "flipped")
    torch.testing.assert_close(state["model"]["w"].cpu(), torch.full((7, 10), 5.0), rtol=0, atol=0)
    # a data file of the same shapes from another checkpoint
    shutil.copy(second / item.relative_path, first / item.relative_path)
    with pytest.raises(st.checkpoint.CheckpointCorruptError, match=r"'model\.w'.* do not match the checksum"):
        manager.load(1, state)
    torch.testing.assert_close(state["model"]["b"], torch.zeros(7), rtol=0, atol=0)
    manager.load(2, state)  # (the intact checkpoint loads)
    torch.testing.assert_close(state["model"]["w"].cpu(), grid(2), rtol=0, atol=0)
    # plain dcp.save into the directory since: the checksums are another save's, and not used
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (DCP's own: "Detected an existing checkpoint ..., overwriting")
        dcp.save({"model": {"w": st.shard(grid(3), mesh, (0, 1)), "b": torch.arange(7.0)}}, checkpoint_id=second)
    with pytest.warns(UserWarning, match="belongs to another save"):
        st.checkpoint.load(state, second)
    torch.testing.assert_close(state["model"]["w"].cpu(), grid(3), rtol=0, atol=0)


def test_swapped_xser_files_are_detected(mesh, tmp_path):
    path = tmp_path / "state.pt"
    st.serialization.save({"a": st.shard(grid(), mesh, (0, 1)), "b": torch.ones(3), "c": torch.zeros(3)}, path)
    (folder,) = (tmp_path / "state.pt.tensors").iterdir()
    a, b, c = (folder / f"tensor_{i}.pt" for i in range(3))
    a.rename(tmp_path / "a"), b.rename(a), (tmp_path / "a").rename(b)
    with pytest.raises(ValueError, match=r"tensor_0\.pt holds shape \(3,\) torch\.float32, not \(7, 10\)"):
        st.serialization.load(path)
    b.rename(tmp_path / "a"), a.rename(b), (tmp_path / "a").rename(a)  # (back)
    b.rename(tmp_path / "b"), c.rename(b), (tmp_path / "b").rename(c)  # same shape and dtype
    with pytest.raises(ValueError, match=r"tensor_1\.pt holds other bytes than were saved"):
        st.serialization.load(path)


def test_manager_steps_are_non_negative_integers_checked_before_writing(mesh, tmp_path):
    manager = CheckpointManager(tmp_path, save_interval=1)
    x = {"x": st.shard(grid(), mesh, (0, 1))}
    for step, error in [(None, TypeError), (3.0, TypeError), (True, TypeError), ("4", TypeError), (-1, ValueError)]:
        with pytest.raises(error, match="a step is a non-negative int"):
            manager.save(step, x, force=True)
        with pytest.raises(error, match="a step is a non-negative int"):
            manager.save_async(step, x, force=True)
    assert list(tmp_path.iterdir()) == []
    assert manager.save(np.int64(4), x) and manager.all_steps() == [4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the directory is a valid checkpoint)
        assert CheckpointManager(tmp_path, save_interval=1).all_steps() == [4]
    assert type(manager.all_steps()[0]) is int


def test_load_file_refuses_a_spec_for_a_name_the_file_lacks(mesh, tmp_path):
    st.save_file({"weight": torch.ones(4, 2), "bias": torch.zeros(4)}, tmp_path / "m.safetensors")
    with pytest.raises(
        ValueError, match=r"specs names \['wieght'\], which .* does not hold; its tensors are \['bias', 'weight'\]"
    ):
        st.load_file(tmp_path / "m.safetensors", specs={"wieght": (mesh, (0, None))})
    loaded = st.load_file(tmp_path / "m.safetensors", specs={"weight": (mesh, (0, None))})
    torch.testing.assert_close(loaded["weight"].cpu(), torch.ones(4, 2), rtol=0, atol=0)


def test_save_refuses_to_replace_what_is_not_a_checkpoint(mesh, tmp_path):
    x = {"x": st.shard(grid(), mesh, (0, 1))}
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"notes\.txt is a file, not a checkpoint"):
        st.checkpoint.save(x, tmp_path / "notes.txt")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(b"jpg")
    with pytest.raises(FileExistsError, match=r"photos is a directory that is not a checkpoint \(no \.metadata\)"):
        st.checkpoint.save(x, tmp_path / "photos")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "photos"]
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "photos" / "a.jpg").read_bytes() == b"jpg"
