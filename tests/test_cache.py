"""Issue 4 §3: the persistent compilation cache (st.initialize_cache) across processes.

The cache is process-wide and would make every later test write to disk, so everything that turns
it on runs in short subprocesses; this process only checks the errors raised before it is on.
"""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

import shardtensor as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One program, run by every subprocess; the read-only run adds a second, new program.
SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, shardtensor as st
    path, mode = sys.argv[1], sys.argv[2]
    st.initialize_cache(path, readonly=(mode == "readonly"))
    out = {}
    mesh = st.Mesh(range(8), (4, 2), ("data", "model"))
    x = st.shard(torch.arange(32.).reshape(8, 4), mesh, ("data", None))
    out["result"] = ((x * 2 + 1).sum(0)).cpu().tolist()
    if mode == "readonly":
        out["new"] = (x - 3).amax().item()
    if mode == "first":
        st.initialize_cache(path)  # the same path again: nothing happens
        try:
            st.initialize_cache(path + "_other")
        except RuntimeError as e:
            out["error"] = str(e)
    for name in ("PersistentCacheHit", "PersistentCacheMiss", "UncachedCompile"):
        out[name] = st.counter_value(name)
    print("RESULT" + json.dumps(out))
""")


def _start(path, mode, script=SCRIPT):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("SHARDTENSOR_DEBUG", None)
    return subprocess.Popen(
        [sys.executable, "-c", script, str(path), mode],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc, with_stderr=False):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT")][-1]
    result = json.loads(line[len("RESULT") :])
    return (result, err) if with_stderr else result


def _listing(path):
    """Every file with its size and modification time: any write changes it."""
    return sorted(
        (
            os.path.relpath(os.path.join(d, f), path),
            os.stat(os.path.join(d, f)).st_size,
            os.stat(os.path.join(d, f)).st_mtime_ns,
        )
        for d, _, files in os.walk(path)
        for f in files
    )


def test_second_process_hits_readonly_never_writes(tmp_path):
    cache = tmp_path / "cache"
    first = _result(_start(cache, "first"))
    want = [2.0 * (sum(range(i, 32, 4))) + 8 for i in range(4)]
    assert first["result"] == want
    assert first["PersistentCacheMiss"] >= 1 and first["PersistentCacheHit"] is None
    assert "already been initialized" in first["error"] and "_other" in first["error"]
    assert os.listdir(cache)

    # a second process (read-write) and a read-only one, side by side on the same directory (a
    # copy elsewhere would not hit: JAX's keys include a path inside the cache directory). The
    # read-write one only hits, so it writes nothing either.
    before = _listing(cache)
    second, readonly = _start(cache, "second"), _start(cache, "readonly")
    second, readonly = _result(second), _result(readonly)

    assert second["result"] == want
    assert second["PersistentCacheHit"] == first["PersistentCacheMiss"]  # every program loaded
    assert second["PersistentCacheMiss"] is None  # nothing compiled
    assert second["UncachedCompile"] == first["UncachedCompile"]  # new to this process's memory

    assert readonly["result"] == want and readonly["new"] == 28.0
    assert readonly["PersistentCacheHit"] == first["PersistentCacheMiss"]
    assert readonly["PersistentCacheMiss"] >= 1  # the new program was compiled...
    assert _listing(cache) == before  # ...and not written


def test_readonly_needs_an_existing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        st.initialize_cache(tmp_path / "missing", readonly=True)
    assert not (tmp_path / "missing").exists()


# --------------------------------------------------------------------------- issue 11 §6


@pytest.mark.parametrize("where", ["a file", "under a file", "read-only directory"])
def test_an_unusable_path_warns_once_and_leaves_caching_off(tmp_path, where):
    """Checked at initialize_cache, before JAX is configured, so this process stays cache-free."""
    (tmp_path / "file").write_text("not a directory")
    path = {
        "a file": tmp_path / "file",
        "under a file": tmp_path / "file" / "cache",
        "read-only directory": tmp_path / "locked",
    }[where]
    if where == "read-only directory":
        if os.geteuid() == 0:  # root writes into any mode-0500 directory, into no procfs one
            path = "/proc/self/fdinfo"
        else:
            path.mkdir(mode=0o500)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st.initialize_cache(path)
        st.initialize_cache(path)  # the same path again: no second warning
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "persistent compilation cache is off" in messages[0], messages
    assert "a file, not a directory" in messages[0] or "cannot be written" in messages[0]
    import jax

    assert not jax.config.jax_compilation_cache_dir and st.runtime.compilation_cache._CACHE is None


# One process: fill the cache, corrupt every entry (truncated, overwritten, one bit flipped), forget
# the programs in memory so the same graph is looked up on disk again, then once more.
CORRUPT_SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    import torch, shardtensor as st
    path = sys.argv[1]
    st.initialize_cache(path)
    mesh = st.Mesh(range(8), (4, 2), ("data", "model"))
    x = st.shard(torch.arange(32.).reshape(8, 4), mesh, ("data", None))
    run = lambda: ((x * 2 + 1).sum(0)).cpu().tolist()
    out = {"first": run(), "entries": sorted(f for f in os.listdir(path) if f.endswith("-cache"))}
    for i, name in enumerate(out["entries"]):
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        data = [data[:len(data) // 2], bytes(len(data)), data[:-1] + bytes([data[-1] ^ 1])][i % 3]
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    out["misses"] = st.counter_value("PersistentCacheMiss")
    for attempt in ("corrupted", "replaced"):
        st.clear_executables()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[attempt] = run()
        out[attempt + "_warnings"] = [str(w.message) for w in caught if "cache entry" in str(w.message)]
        out[attempt + "_hits"] = st.counter_value("PersistentCacheHit")
        out[attempt + "_misses"] = st.counter_value("PersistentCacheMiss")
    print("RESULT" + json.dumps(out))
""")


def test_a_corrupted_entry_warns_compiles_again_and_is_replaced(tmp_path, monkeypatch):
    # JAX's own entries: shardtensor's program cache (tests/test_program_cache.py) would serve the
    # programs before JAX's cache is read
    monkeypatch.setenv("SHARDTENSOR_PROGRAM_CACHE", "0")
    want = [2.0 * (sum(range(i, 32, 4))) + 8 for i in range(4)]
    out = _result(_start(tmp_path / "cache", "", script=CORRUPT_SCRIPT))
    n = len(out["entries"])
    assert out["first"] == want and n == out["misses"] >= 1
    # each entry that cannot be loaded: one warning, a new compilation (a miss), the same result
    assert out["corrupted"] == want and out["corrupted_hits"] is None
    assert out["corrupted_misses"] == 2 * n
    assert len(out["corrupted_warnings"]) == n, out["corrupted_warnings"]
    assert all("the program is compiled again and the entry replaced" in w for w in out["corrupted_warnings"])
    # the new compilations replaced the entries: the next lookups load them, without a warning
    assert out["replaced"] == want and out["replaced_hits"] == n and out["replaced_misses"] == 2 * n
    assert out["replaced_warnings"] == []
