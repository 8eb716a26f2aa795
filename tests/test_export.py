"""st.export: StableHLO text with shardings, serialize / deserialize, and running in a fresh process."""

import io
import json
import os
import re
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import shardtensor as st

MESH = st.Mesh(range(8), (4, 2), ("x", "y"))


def _main_signature(text):
    """The `func.func public @main(...) -> (...)` header of the module."""
    return re.search(r"func\.func public @main\((.*?)\)\s*->\s*(.*?)\{\n", text, re.S).group(0)


def _model():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    sharded = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    sharded.load_state_dict(ref.state_dict())
    sharded.to(st.device())
    st.mark_sharding(sharded[0].weight, MESH, ("y", None))
    st.mark_sharding(sharded[2].weight, MESH, (None, "y"))
    return ref, sharded


def test_mlir_text_carries_input_and_output_shardings():
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    exported = st.export(
        lambda p, q: torch.relu(p @ q) * 2.5, st.shard(a, MESH, ("x", None)), st.shard(b, MESH, (None, "y"))
    )
    header = _main_signature(exported.mlir_text())
    assert re.search(r'tensor<8x6xf32> \{sdy\.sharding = #sdy\.sharding<@mesh, \[\{"x"\}, \{\}\]>', header), header
    assert re.search(r'tensor<6x4xf32> \{sdy\.sharding = #sdy\.sharding<@mesh, \[\{\}, \{"y"\}\]>', header), header
    results = header.split("->", 1)[1]  # the layout XLA propagated: rows over 'x', as the input
    assert re.search(r'tensor<8x4xf32> \{.*sdy\.sharding = #sdy\.sharding<@mesh, \[\{"x"\}, ', results), results
    assert 'sdy.mesh @mesh = <["x"=4, "y"=2]>' in exported.mlir_text()


def test_output_annotation_is_kept():
    x = torch.randn(8, 4)

    def fn(t):
        y = t.exp()
        st.mark_sharding(y, MESH, (None, "y"))
        return y

    exported = st.export(fn, st.shard(x, MESH, ("x", None)))
    results = _main_signature(exported.mlir_text()).split("->", 1)[1]
    assert re.search(r'sdy\.sharding = #sdy\.sharding<@mesh, \[\{\}, \{"y"\}\]>', results), results
    y = st.deserialize(exported.serialize())(x)
    assert y.partition_spec == (None, "y")
    torch.testing.assert_close(y.cpu(), x.exp())


def test_module_round_trip_matches_eager_torch():
    ref, sharded = _model()
    x = torch.randn(12, 16)
    exported = st.export(sharded, st.shard(x, MESH, ("x", None)))
    run = st.deserialize(exported.serialize())
    for trial in range(2):  # new inputs, CPU or sharded, give new results
        x2 = torch.randn(12, 16)
        arg = x2 if trial == 0 else st.shard(x2, MESH, ("x", None))
        y = run(arg)
        assert isinstance(y, st.ShardedTensor)
        torch.testing.assert_close(y.cpu(), ref(x2).detach(), rtol=1e-5, atol=1e-5)


def test_uneven_input_and_pytree_outputs():
    x = torch.randn(10, 3)  # 10 rows over 4 devices: padded storage

    def fn(t):
        return {"sum": t.sum(0), "double": t * 2, "rows": 10}

    exported = st.export(fn, st.shard(x, MESH, ("x", None)))
    out = st.deserialize(exported.serialize())(x)
    assert out["rows"] == 10
    torch.testing.assert_close(out["sum"].cpu(), x.sum(0))
    torch.testing.assert_close(out["double"].cpu(), x * 2)


def test_runs_in_a_fresh_process_without_the_model(tmp_path):
    ref, sharded = _model()
    x = torch.randn(12, 16)
    blob = st.export(sharded, st.shard(x, MESH, ("x", None))).serialize()
    (tmp_path / "prog.bin").write_bytes(blob)
    np.save(tmp_path / "x.npy", x.numpy())
    script = textwrap.dedent(f"""
        import numpy as np, torch, shardtensor as st
        run = st.deserialize(open({str(tmp_path / "prog.bin")!r}, "rb").read())
        y = run(torch.from_numpy(np.load({str(tmp_path / "x.npy")!r})))
        np.save({str(tmp_path / "y.npy")!r}, y.cpu().numpy())
    """)
    env = dict(os.environ, SHARDTENSOR_CPU_DEVICES="8")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    y = torch.from_numpy(np.load(tmp_path / "y.npy"))
    torch.testing.assert_close(y, ref(x).detach(), rtol=1e-5, atol=1e-5)


def test_cpu_argument_is_a_clear_error():
    with pytest.raises(st.ExportError, match="argument 0 is a cpu tensor; pass ShardedTensors"):
        st.export(lambda t: t + 1, torch.randn(4))


def test_in_place_side_effects_are_a_clear_error():
    bn = torch.nn.BatchNorm1d(4).to(st.device())  # training mode updates running stats
    x = st.shard(torch.randn(8, 4), MESH, ("x", None))
    with pytest.raises(st.ExportError, match="updates 3 existing tensor"):
        st.export(bn, x)
    st.sync()  # the traced call's own updates still run, as for any call
    bn.eval()
    y = st.deserialize(st.export(bn, x).serialize())(x)
    torch.testing.assert_close(
        y.cpu(),
        F.batch_norm(
            x.cpu(), bn.running_mean.cpu(), bn.running_var.cpu(), bn.weight.detach().cpu(), bn.bias.detach().cpu()
        ),
    )


def test_bad_arguments_and_bytes():
    exported = st.export(lambda t: t + 1, st.shard(torch.randn(8, 4), MESH, ("x", None)))
    run = st.deserialize(exported.serialize())
    with pytest.raises(TypeError, match=r"expected a tensor of shape \(8, 4\) and dtype torch.float32"):
        run(torch.randn(4, 4))
    with pytest.raises(TypeError, match="structure"):
        run(torch.randn(8, 4), torch.randn(8, 4))
    with pytest.raises(ValueError, match="not a serialized st.export program"):
        st.deserialize(b"not a program")


# --------------------------------------------------------------------------- untrusted bytes (issue 11 §6)


@pytest.fixture(scope="module")
def program_bytes():
    t = torch.arange(32.0).reshape(8, 4)
    return st.export(lambda x: x * 2 + 1, st.shard(t, MESH, ("x", None))).serialize()


def _members(blob):
    import zipfile

    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        return {n: z.read(n) for n in z.namelist()}


def _zip(members, method=None):
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method or zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def _npy(array):
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _with_meta(members, **changes):
    meta = json.loads(members["meta.json"])
    meta.update(changes)
    return _zip({**members, "meta.json": json.dumps(meta).encode()})


def _declare_size(data, name, size):
    """``data`` (a zip) with the uncompressed size of member ``name`` in its headers replaced by ``size``."""
    out, name = bytearray(data), name.encode()
    for signature, size_at, name_at in ((b"PK\x03\x04", 22, 30), (b"PK\x01\x02", 24, 46)):
        pos = out.find(signature)
        while pos >= 0:
            if out[pos + name_at : pos + name_at + len(name)] == name:
                out[pos + size_at : pos + size_at + 4] = struct.pack("<I", size)
            pos = out.find(signature, pos + 4)
    return bytes(out)


def _rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_deserialize_refuses_archives_that_declare_or_inflate_past_max_size(program_bytes):
    members = _members(program_bytes)
    x = torch.arange(32.0).reshape(8, 4)
    run = st.deserialize(program_bytes, max_size=2**20)  # the real program fits in 1 MiB
    torch.testing.assert_close(run(x).cpu(), x * 2 + 1)
    zeros = bytes(64 * 2**20)  # 64 MiB that deflate to ~64 KiB
    npz_bomb = _zip({"leaf0.npy": _npy(np.zeros(16 * 2**20, np.float32))})  # a bomb inside the inner zip
    start = _rss_mib()
    cases = {
        "a member declaring 64 MiB": _zip({**members, "program.bin": zeros}),
        "values.npz declaring 64 MiB inside": _zip({**members, "values.npz": npz_bomb}),
    }
    for what, blob in cases.items():
        assert len(blob) < 2**20, what
        with pytest.raises(ValueError, match=r"declares \d+ bytes.*max_size=16777216.*pass max_size="):
            st.deserialize(blob, max_size=16 * 2**20)
    # a header that declares less than its member inflates to: the read stops at what it declares
    lying = _declare_size(_zip({**members, "program.bin": zeros}), "program.bin", 1000)
    with pytest.raises(ValueError, match="st.deserialize"):
        st.deserialize(lying)
    assert _rss_mib() - start < 48  # nothing was inflated: each case would have added 64 MiB
    with pytest.raises(ValueError, match="max_size"):
        st.deserialize(program_bytes, max_size=0)


def test_deserialize_raises_value_error_for_malformed_input(program_bytes):
    members = _members(program_bytes)
    values = np.load(io.BytesIO(members["values.npz"]))
    header_says_more = _npy(np.zeros(4, np.float32)).replace(b"'shape': (4,)", b"'shape': (9999999,)")
    bad = {
        "random bytes": np.random.default_rng(0).bytes(4096),
        "empty": b"",
        "no program.bin": _zip({k: v for k, v in members.items() if k != "program.bin"}),
        "meta.json is not JSON": _zip({**members, "meta.json": b"{not json"}),
        "meta.json is not UTF-8": _zip({**members, "meta.json": b"\xff\xfe{}"}),
        "meta.json is a list": _zip({**members, "meta.json": b"[1, 2]"}),
        "another format": _with_meta(members, format="something-else"),
        "a bad mesh": _with_meta(members, mesh=3),
        "a mesh of the wrong size": _with_meta(
            members, mesh={"device_ids": [0, 1], "shape": [4, 2], "axis_names": ["x", "y"]}
        ),
        "a bad tree": _with_meta(members, in_tree="][garbage"),
        "a missing constant": _with_meta(members, constants=[0, 1, 2, 3]),
        "an unknown dtype": _with_meta(
            members, inputs=[{"leaf": 0, "arg": 0, "shape": [8, 4], "dtype": "float99", "spec": None}]
        ),
        "program.bin is garbage": _zip({**members, "program.bin": b"\x00" * 100}),
        "values.npz is not a zip": _zip({**members, "values.npz": b"PK\x03\x04 truncated"}),
        "a .npy header that claims more than its data": _zip(
            {
                **members,
                "values.npz": _zip(
                    {**{k + ".npy": _npy(values[k]) for k in values.files}, "leaf9.npy": header_says_more}, method=0
                ),
            }
        ),
    }
    for cut in (10, len(program_bytes) // 3, len(program_bytes) // 2, len(program_bytes) - 1):
        bad[f"truncated at {cut}"] = program_bytes[:cut]
    for what, blob in bad.items():
        with pytest.raises(ValueError, match="st.deserialize") as info:
            st.deserialize(blob)
        assert "st.deserialize" in str(info.value), what
    with pytest.raises(TypeError, match="bytes"):
        st.deserialize("a string")
