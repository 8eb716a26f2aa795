"""st.export: StableHLO text with shardings, serialize / deserialize, and running in a fresh process."""
import os
import re
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
    exported = st.export(lambda p, q: torch.relu(p @ q) * 2.5,
                         st.shard(a, MESH, ("x", None)), st.shard(b, MESH, (None, "y")))
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
        run = st.deserialize(open({str(tmp_path / 'prog.bin')!r}, "rb").read())
        y = run(torch.from_numpy(np.load({str(tmp_path / 'x.npy')!r})))
        np.save({str(tmp_path / 'y.npy')!r}, y.cpu().numpy())
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
    torch.testing.assert_close(y.cpu(), F.batch_norm(x.cpu(), bn.running_mean.cpu(), bn.running_var.cpu(),
                                                     bn.weight.detach().cpu(), bn.bias.detach().cpu()))


def test_bad_arguments_and_bytes():
    exported = st.export(lambda t: t + 1, st.shard(torch.randn(8, 4), MESH, ("x", None)))
    run = st.deserialize(exported.serialize())
    with pytest.raises(TypeError, match=r"expected a tensor of shape \(8, 4\) and dtype torch.float32"):
        run(torch.randn(4, 4))
    with pytest.raises(TypeError, match="structure"):
        run(torch.randn(8, 4), torch.randn(8, 4))
    with pytest.raises(ValueError, match="not a serialized st.export program"):
        st.deserialize(b"not a program")
