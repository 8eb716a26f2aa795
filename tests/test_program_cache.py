"""Issue 37 §4: shardtensor's own persistent program cache (``graph.program_store``).

A process with a warm ``st.initialize_cache`` directory loads each program under its recorded
graph's key and traces, lowers and compiles nothing; its results equal eager torch. Entries that are
corrupted, truncated, of another version or hostile are refused with a warning and compiled again;
two processes writing at once leave only whole entries. Everything that turns the cache on runs in
short subprocesses (the cache is process-wide), on a (4, 2) mesh of the 8 simulated devices.
"""

import json
import os
import struct
import subprocess
import sys
import textwrap

import jax
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardtensor as st
from shardtensor.graph import program_key, program_store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTERS = (
    "PersistentProgramHit",
    "PersistentProgramMiss",
    "PersistentProgramStored",
    "PersistentProgramUnusable",
    "PersistentProgramSkipped",
    "PersistentCacheHit",
)

# Three lazy training steps (an MLP, AdamW, a class-target loss with its on-device check, an uneven
# parameter stored padded), then three calls of the same step st.compile'd; each compared with eager torch.
# Prints the counters, the JAX traces and lowerings seen, and the results.
SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    import torch, torch.nn as nn, torch.nn.functional as F
    from jax import monitoring
    import shardtensor as st

    seen = {"traces": 0, "lowerings": 0}
    def on(event, duration, fun_name="", **_):  # shardtensor's programs (jax.random's own jits aside)
        if "replay" not in str(fun_name):
            return
        if event == "/jax/core/compile/jaxpr_trace_duration":
            seen["traces"] += 1
        elif event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            seen["lowerings"] += 1
    monitoring.register_event_duration_secs_listener(on)
    st.initialize_cache(sys.argv[1])
    mesh = st.Mesh(range(8), (4, 2), ("data", "model"))

    def train(device, compiled):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))  # 10 rows over 4: padded
        if device != "cpu":
            model = model.to(device)
            st.mark_sharding(model[0].weight, mesh, ("data", None))
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        if device != "cpu":
            x, y = st.shard(x, mesh, ("data", None)), y.to(device)

        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()
            return loss.detach()

        run = st.compile(step) if compiled else step
        losses = []
        for _ in range(3):
            if device == "cpu" or compiled:
                loss = run(x, y)
            else:
                with st.step():
                    loss = run(x, y)
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()], model, x

    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want, want_params, _, _ = train("cpu", False)
        for name, compiled in (("lazy", False), ("compiled", True)):
            losses, params, model, x = train(st.device(), compiled)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
            for p, q in zip(params, want_params):
                torch.testing.assert_close(p, q)
            out[name] = losses
        # a program drawing random numbers: the same numbers from a stored program (compared across processes)
        st.manual_seed(3)
        out["random"] = torch.rand(6, device=st.device()).tolist()
        # a stored program's on-device check still raises torch's error, with the user's line
        try:
            F.cross_entropy(model(x), torch.full((8,), 7).to(st.device())).item()
        except IndexError as e:
            out["check"] = str(e)
    out["warnings"] = [str(w.message) for w in caught if "program cache" in str(w.message)]
    out.update(seen)
    out.update({name: st.counter_value(name) for name in COUNTERS})
    print("RESULT" + json.dumps(out))
"""
).replace("in COUNTERS", f"in {COUNTERS!r}")


def _run(cache, env=None, script=SCRIPT):
    environ = dict(os.environ)
    environ["PYTHONPATH"] = ROOT + os.pathsep + environ.get("PYTHONPATH", "")
    environ.pop("SHARDTENSOR_DEBUG", None)
    environ.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-c", script, str(cache)],
        env=environ,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT") :])


def _entries(cache):
    directory = cache / "shardtensor-programs"
    return sorted(directory / n for n in os.listdir(directory)) if directory.exists() else []


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache filled by one process, and that process's result."""
    cache = tmp_path_factory.mktemp("programs") / "cache"
    first = _result(_run(cache, {"PYTHONHASHSEED": "1"}))
    return cache, first


def _copy(cache, tmp_path):
    import shutil

    target = tmp_path / "cache"
    shutil.copytree(cache, target)
    return target


def test_a_warm_process_loads_every_program_and_traces_nothing(filled, tmp_path):
    cache, first = filled
    n = first["PersistentProgramStored"]
    assert n and n == first["PersistentProgramMiss"] == len(_entries(cache))
    assert first["traces"] >= n and first["warnings"] == [] and first["PersistentProgramSkipped"] is None
    assert "Target 7 is out of bounds" in first["check"]

    second = _result(_run(cache, {"PYTHONHASHSEED": "2"}))  # (the key does not depend on str hashing)
    assert second["lazy"] == first["lazy"] and second["compiled"] == first["compiled"]
    assert second["random"] == first["random"] and len(set(first["random"])) == 6
    assert second["PersistentProgramHit"] == n and second["PersistentProgramMiss"] is None
    assert second["PersistentCacheHit"] >= n and second["PersistentProgramStored"] is None
    assert second["traces"] == 0 and second["lowerings"] == 0  # nothing traced, nothing lowered
    assert second["check"] == first["check"] and second["warnings"] == []


def test_loaded_programs_take_the_check_rows_own_program(filled, tmp_path):
    """A warm process on an accelerator (graph.early_rows turned on here) gives the programs it loads
    their check rows' own program, as the ones it compiles; results as before, the check still raises."""
    cache = _copy(filled[0], tmp_path)
    script = "from shardtensor.graph import early_rows\nearly_rows.ENABLED = True\n" + SCRIPT
    warm = _result(_run(cache, script=script))
    assert warm["PersistentProgramHit"] and warm["PersistentProgramMiss"] is None
    assert warm["lazy"] == filled[1]["lazy"] and warm["compiled"] == filled[1]["compiled"]
    assert warm["check"].split("(checked")[0] == filled[1]["check"].split("(checked")[0]  # (lines moved by 2)


DAMAGES = ["truncated", "a byte flipped", "emptied", "another version", "hostile header"]


def test_bad_entries_are_refused_compiled_again_and_replaced(filled, tmp_path):
    cache = _copy(filled[0], tmp_path)
    entries = _entries(cache)
    assert len(entries) >= len(DAMAGES)
    for i, path in enumerate(entries):
        data, damage = path.read_bytes(), DAMAGES[i % len(DAMAGES)]
        if damage == "truncated":
            data = data[: len(data) // 2]
        elif damage == "a byte flipped":
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1 :]
        elif damage == "emptied":
            data = b""
        else:  # a well-formed entry (its checksum right) whose header lies
            data = _rewrite_header(data, damage)
        path.write_bytes(data)
    n = len(entries)
    second = _result(_run(cache))
    assert second["lazy"] == filled[1]["lazy"] and second["compiled"] == filled[1]["compiled"]
    assert second["PersistentProgramUnusable"] == n and second["PersistentProgramHit"] is None
    warned = second["warnings"]
    assert len(warned) == n and all("compiled again and the entry replaced" in w for w in warned), warned
    for reason in ("checksum does not match", "not a shardtensor program entry", "written by other versions"):
        assert any(reason in w for w in warned), (reason, warned)
    assert any("check raising '__import__'" in w for w in warned), warned
    assert second["PersistentProgramStored"] == n and second["traces"] > 0
    third = _result(_run(cache))
    assert third["PersistentProgramHit"] == n and third["warnings"] == [] and third["traces"] == 0


def _rewrite_header(data: bytes, damage: str) -> bytes:
    magic, length = program_store.MAGIC, struct.Struct("<Q")
    start = len(magic) + length.size
    (size,) = length.unpack_from(data, len(magic))
    header = json.loads(data[start : start + size])
    if damage == "another version":
        header["versions"]["jax"] = "0.0.1"
    else:  # names that must never resolve to anything but a builtin exception
        header["checks"] = [[0, "__import__", "os"]] + header["checks"]
    body = json.dumps(header).encode()
    payload = magic + length.pack(len(body)) + body + data[start + size : -32]
    import hashlib

    return payload + hashlib.sha256(payload).digest()


def test_two_writers_at_once_leave_whole_entries(tmp_path):
    cache = tmp_path / "cache"
    a, b = _run(cache), _run(cache)
    a, b = _result(a), _result(b)
    assert a["lazy"] == b["lazy"] and a["warnings"] == b["warnings"] == []
    assert not [p for p in _entries(cache) if not p.name.endswith(program_store.SUFFIX)]  # no temporary left
    third = _result(_run(cache))
    assert third["PersistentProgramHit"] == len(_entries(cache)) and third["warnings"] == []
    assert third["traces"] == 0


def test_turned_off_then_on_the_store_fills_with_programs_compiled_afresh(tmp_path):
    cache = tmp_path / "cache"
    off = _result(_run(cache, {"SHARDTENSOR_PROGRAM_CACHE": "0"}))
    assert off["PersistentProgramMiss"] is None and off["PersistentProgramStored"] is None
    assert _entries(cache) == [] and os.listdir(cache)  # JAX's own entries only
    # JAX's entries are there, but an executable JAX loaded does not serialize whole (on CPU, running
    # it after a round trip fails): the store compiles its programs afresh, and they run
    on = _result(_run(cache))
    assert on["PersistentProgramStored"] == off["traces"] == len(_entries(cache))
    warm = _result(_run(cache))
    assert warm["PersistentProgramHit"] == on["PersistentProgramStored"] and warm["traces"] == 0
    assert warm["lazy"] == on["lazy"] == off["lazy"]


# --------------------------------------------------------------------------- the key, in this process


def test_the_key_text_tells_apart_what_python_equality_confuses():
    texts = {program_key.encode((v,)) for v in (1, 1.0, True, 0.0, -0.0, "1", None)}
    assert len(texts) == 7
    assert program_key.encode((torch.float32, (2, 3))) == program_key.encode((torch.float32, (2, 3)))
    assert program_key.encode((torch.float32,)) != program_key.encode((torch.float16,))


def test_a_key_with_a_function_or_a_foreign_object_has_no_digest():
    assert program_key.digest(((lambda x: x),)) is None
    assert "function" in program_key.why_not()
    assert program_key.digest((object(),)) is None
    assert program_key.digest((("add", 1), torch.float32)) is not None


def test_the_digest_changes_with_versions_devices_meshes_and_flags(monkeypatch):
    key = (("mul", 2.0), torch.float32)
    base = program_key.digest(key)
    assert program_key.digest(key) == base
    mesh_a = st.Mesh(range(8), (4, 2), ("data", "model")).get_jax_mesh()
    mesh_b = st.Mesh(list(reversed(range(8))), (4, 2), ("data", "model")).get_jax_mesh()
    assert program_key.digest(key + (mesh_a,)) != program_key.digest(key + (mesh_b,))
    on_a = NamedSharding(mesh_a, P("data"))
    assert program_key.digest(key + (on_a,)) != program_key.digest(key + (NamedSharding(mesh_a, P("model")),))

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
    assert program_key.digest(key) != base
    monkeypatch.undo()
    assert program_key.digest(key) == base
    for module, name in ((jax, "jax"), (torch, "torch")):
        with monkeypatch.context() as m:
            m.setattr(module, "__version__", "0.0.1")
            program_key._static_environment.cache_clear()
            assert program_key.digest(key) != base, name
        program_key._static_environment.cache_clear()
    with monkeypatch.context() as m:
        m.setattr(program_key, "_devices", lambda: "another device set")
        assert program_key.digest(key) != base
    assert program_key.digest(key) == base
