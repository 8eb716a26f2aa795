"""Issue 14, bad input: a checkpoint that does not fit, or is not whole, raises a clear error naming the
key, file or path from ``st.checkpoint.load``, before anything is read: the target is unchanged."""

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import shardtensor as st
from _training_helpers import reset_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

W, B = torch.arange(70.0).reshape(7, 10), torch.arange(7.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    reset_state()
    mesh = st.Mesh(range(8), (4, 2))
    path = tmp_path_factory.mktemp("bad") / "ckpt"
    st.checkpoint.save({"model": {"w": st.shard(W, mesh, (0, 1)), "b": st.shard(B, mesh, (0,))}, "step": 3}, path)
    yield path, mesh
    reset_state()


def target(mesh, w_shape=(7, 10), dtype=torch.float32):
    """A sharded target filled with 5 (not the checkpoint's values)."""
    w = st.shard(torch.full(w_shape, 5.0, dtype=dtype), mesh, (0, 1))
    return {"model": {"w": w, "b": st.shard(torch.full((7,), 5.0), mesh, (0,))}, "step": 0}


def snapshot(state):
    return {
        k: (v.cpu().clone() if isinstance(v, torch.Tensor) else snapshot(v) if isinstance(v, dict) else v)
        for k, v in state.items()
    }


def assert_unchanged(state, before):
    now = snapshot(state)
    assert now.keys() == before.keys()
    for key in before:
        if isinstance(before[key], dict):
            assert_unchanged(state[key], before[key])
        elif isinstance(before[key], torch.Tensor):
            torch.testing.assert_close(now[key], before[key], rtol=0, atol=0, msg=key)
        else:
            assert now[key] == before[key], key


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s["model"].update(extra=torch.zeros(2)), r"missing from the checkpoint: model\.extra"),
        (lambda s: s["model"].pop("b"), r"in the checkpoint but not in the target: model\.b"),
        (
            lambda s: s["model"].update(w=s["model"]["w"][:, :9].clone()),
            r"shapes differ: model\.w \(checkpoint \(7, 10\), target \(7, 9\)\)",
        ),
        (
            lambda s: s["model"].update(w=s["model"]["w"].bfloat16()),
            r"dtypes differ: model\.w \(checkpoint torch\.float32, target torch\.bfloat16\)",
        ),
    ],
    ids=["missing", "unexpected", "shape", "dtype"],
)
def test_a_checkpoint_of_another_model_raises_naming_the_key_and_changes_nothing(checkpoint, change, message):
    path, mesh = checkpoint
    state = target(mesh)
    change(state)
    before = snapshot(state)
    with pytest.raises(st.checkpoint.CheckpointMismatchError, match=message):
        st.checkpoint.load(state, path)
    assert_unchanged(state, before)


def test_every_mismatch_is_named_at_once_and_strict_false_loads_what_fits(checkpoint):
    path, mesh = checkpoint
    state = target(mesh)
    state["model"]["extra"] = torch.zeros(2)
    del state["step"]
    with pytest.raises(st.checkpoint.CheckpointMismatchError, match=r"model\.extra.*step"):
        st.checkpoint.load(state, path)
    st.checkpoint.load(state, path, strict=False)  # the keys both have; "extra" keeps its value
    torch.testing.assert_close(state["model"]["w"].cpu(), W, rtol=0, atol=0)
    torch.testing.assert_close(state["model"]["extra"], torch.zeros(2), rtol=0, atol=0)
    assert state["model"]["w"].partition_spec == st.PartitionSpec(0, 1)
    bf16 = target(mesh, dtype=torch.bfloat16)
    st.checkpoint.load(bf16, path, cast_dtypes=True)  # converted, as plain dcp.load always does
    torch.testing.assert_close(bf16["model"]["w"].cpu(), W.bfloat16(), rtol=0, atol=0)
    assert bf16["step"] == 3


def test_a_truncated_file_a_missing_metadata_and_a_missing_directory_are_named(checkpoint, tmp_path):
    path, mesh = checkpoint
    state = target(mesh)
    before = snapshot(state)
    truncated = tmp_path / "truncated"
    shutil.copytree(path, truncated)
    data_file = sorted(truncated.glob("*.distcp"))[0]
    with open(data_file, "r+b") as f:
        f.truncate(data_file.stat().st_size - 10)
    with pytest.raises(st.checkpoint.CheckpointCorruptError, match=rf"{data_file.name}' is truncated"):
        st.checkpoint.load(state, truncated)
    no_metadata = tmp_path / "no_metadata"
    shutil.copytree(path, no_metadata)
    (no_metadata / ".metadata").unlink()
    with pytest.raises(st.checkpoint.CheckpointNotFoundError, match="no_metadata' has no .metadata"):
        st.checkpoint.load(state, no_metadata)
    with pytest.raises(st.checkpoint.CheckpointNotFoundError, match="no checkpoint at .*nowhere"):
        st.checkpoint.load(state, tmp_path / "nowhere")
    assert_unchanged(state, before)


def test_a_read_that_fails_half_way_changes_nothing(checkpoint, tmp_path):
    """Garbage over the last item of the data file (its size intact): the reads before it succeed,
    then DCP's own error; the values read so far never reach the target. (Without the checksums the
    save recorded, which would name the item first: tests/test_checkpoint_safety.py.)"""
    path, mesh = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / ".checksums.json").unlink()
    storage = dcp.FileSystemReader(broken).read_metadata().storage_data
    last = max(storage.values(), key=lambda info: info.offset)
    with open(broken / last.relative_path, "r+b") as f:
        f.seek(last.offset)
        f.write(b"\0" * last.length)
    state = target(mesh)
    before = snapshot(state)
    with pytest.raises(CheckpointException):
        st.checkpoint.load(state, broken)
    assert_unchanged(state, before)
    # DCP's default planner, for comparison: a tensor is written whole or not at all (its shards are
    # uploaded together once all are read), but those read before the failure are overwritten
    with pytest.raises(CheckpointException):
        dcp.load(state, checkpoint_id=broken)
    for key, saved in {"w": W, "b": B}.items():
        value = state["model"][key].cpu()
        assert torch.equal(value, saved) or torch.equal(value, before["model"][key]), key
    st.checkpoint.load(state, path)  # the intact checkpoint loads
    torch.testing.assert_close(state["model"]["b"].cpu(), B, rtol=0, atol=0)
    assert state["step"] == 3
