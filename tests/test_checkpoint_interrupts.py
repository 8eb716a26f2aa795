"""Issue 35: a save killed (SIGKILL) or interrupted (Ctrl-C, a real SIGINT) loses neither the last
good copy nor a later save. Each case runs in a subprocess that signals itself at a chosen point."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import shardtensor as st

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

_ENV = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join([str(pathlib.Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
)

KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import shardtensor as st
    kind, path = sys.argv[1], sys.argv[2]
    save = st.save if kind == "st.save" else st.serialization.save
    mesh = st.Mesh(range(8), (4, 2))
    save({"w": st.shard(torch.arange(70.0).reshape(7, 10), mesh, (0, 1)), "step": 1}, path)
    real_save, calls = torch.save, []

    def killed_half_way(obj, file, *args, **kwargs):
        calls.append(1)
        if len(calls) == (1 if kind == "st.save" else 3):  # xser: the structure, once both tensors are written
            file.write(b"PK half of a file")
            file.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, file, *args, **kwargs)

    torch.save = killed_half_way
    save({"w": st.shard(torch.zeros(7, 10), mesh, (0, 1)), "v": torch.ones(3), "step": 2}, path)
    """
)


@pytest.mark.parametrize("kind", ["st.save", "xser"])
def test_a_save_killed_half_way_leaves_the_previous_file_loadable(kind, tmp_path):
    path = tmp_path / "s.pt"
    result = subprocess.run(
        [sys.executable, "-c", KILLED_SAVE, kind, str(path)], env=_ENV, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    loaded = torch.load(path, weights_only=True) if kind == "st.save" else st.serialization.load(path)
    assert loaded.keys() == {"w", "step"} and loaded["step"] == 1
    torch.testing.assert_close(loaded["w"], torch.arange(70.0).reshape(7, 10), rtol=0, atol=0)
    # the next save replaces it, and removes what the killed one left
    save = st.save if kind == "st.save" else st.serialization.save
    save({"w": torch.ones(2), "step": 3}, path)
    loaded = torch.load(path, weights_only=True) if kind == "st.save" else st.serialization.load(path)
    assert loaded["step"] == 3 and torch.equal(loaded["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == (["s.pt"] if kind == "st.save" else ["s.pt", "s.pt.tensors"])
    if kind == "xser":
        assert len(list((tmp_path / "s.pt.tensors").iterdir())) == 1  # (this save's tensors only)


INTERRUPTED_SAVES = textwrap.dedent(
    """
    import json, os, shutil, signal, sys, threading, time, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed.checkpoint.filesystem as dcp_files
    import shardtensor as st
    from shardtensor.checkpoint import atomic

    root = sys.argv[1]
    path = os.path.join(root, "ck")
    mesh = st.Mesh(range(8), (4, 2))
    report = {}

    def state(scale):
        return {"x": st.shard(torch.arange(70.0).reshape(7, 10) * scale, mesh, (0, 1))}

    def saved_scale():
        target = {"x": torch.zeros(7, 10)}
        st.checkpoint.load(target, path)
        return target["x"][1, 1].item() / 11

    def ctrl_c():
        os.kill(os.getpid(), signal.SIGINT)

    def attempt(name, fn):
        try:
            fn()
            report[name] = "returned"
        except BaseException as e:
            report[name] = type(e).__name__
        report[name + " left"] = sorted(os.listdir(root))
        report[name + " scale"] = saved_scale()

    st.checkpoint.save(state(1), path)
    # Ctrl-C while DCP writes the new checkpoint (DCP wraps it in CheckpointException)
    write_item = dcp_files._write_item
    def interrupted_write(*args, **kwargs):
        ctrl_c()
        return write_item(*args, **kwargs)
    dcp_files._write_item = interrupted_write
    attempt("in DCP", lambda: st.checkpoint.save(state(2), path))
    dcp_files._write_item = write_item

    # Ctrl-C while the previous checkpoint is being removed, once the new one is in place
    rmtree = shutil.rmtree
    def interrupted_rmtree(p, *args, **kwargs):
        if ".old-" in str(p) and os.path.exists(p):
            ctrl_c()
        return rmtree(p, *args, **kwargs)
    shutil.rmtree = interrupted_rmtree
    attempt("replacing", lambda: st.checkpoint.save(state(3), path))
    shutil.rmtree = rmtree
    attempt("later", lambda: st.checkpoint.save(state(4), path))

    # Ctrl-C in CheckpointManager.join() while a background save is being written, then join() again
    manager = st.checkpoint.CheckpointManager(os.path.join(root, "managed"), save_interval=1)
    started, release, save = threading.Event(), threading.Event(), atomic.save
    def slow_save(*args, **kwargs):
        started.set()
        release.wait()
        return save(*args, **kwargs)
    atomic.save = slow_save
    manager.save_async(1, state(5))
    threading.Thread(target=lambda: (started.wait(), time.sleep(0.2), ctrl_c())).start()
    try:
        manager.join()
    except KeyboardInterrupt:
        report["join"] = "KeyboardInterrupt"
    threading.Timer(0.3, release.set).start()
    manager.join()
    report["steps after the second join"] = manager.all_steps()
    print(json.dumps(report))
    """
)


def test_ctrl_c_during_saves_and_join_loses_nothing(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_SAVES, str(tmp_path)], env=_ENV, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["in DCP"] in ("CheckpointException", "KeyboardInterrupt")
    assert report["in DCP left"] == ["ck"] and report["in DCP scale"] == 1  # the previous one, nothing else
    # delivered once the new checkpoint is in place and the old one is gone
    assert report["replacing"] == "KeyboardInterrupt"
    assert report["replacing left"] == ["ck"] and report["replacing scale"] == 3
    assert report["later"] == "returned" and report["later left"] == ["ck"] and report["later scale"] == 4
    assert report["join"] == "KeyboardInterrupt" and report["steps after the second join"] == [1]


def test_a_checkpoint_moved_aside_by_a_killed_save_is_put_back_by_the_next_save(tmp_path):
    """Killed between its two renames, a save leaves the previous checkpoint at ``.<name>.old-<host>-<pid>``
    and nothing at the path: the next save puts it back first, so a failure of that save keeps it."""
    import socket

    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class _FailingPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            raise RuntimeError("boom while writing")

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # (a process id that no longer runs)
    path = tmp_path / "ck"
    st.checkpoint.save({"x": torch.arange(6.0)}, path)
    moved = tmp_path / f".ck.old-{socket.gethostname()}-{gone.pid}"
    path.rename(moved)
    with pytest.raises(CheckpointException, match="boom while writing"):
        st.checkpoint.save({"x": torch.arange(6.0)}, path, planner=_FailingPlanner())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    target = {"x": torch.zeros(6)}
    st.checkpoint.load(target, path)
    torch.testing.assert_close(target["x"], torch.arange(6.0), rtol=0, atol=0)
