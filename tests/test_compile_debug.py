"""Issue 4 §5: SHARDTENSOR_DEBUG=1 says why each compilation happened and warns about loops that keep
compiling. Shapes are unusual (x 37..) so that no earlier test has compiled these graphs."""

import re
import warnings

import pytest
import torch

import shardtensor as st
from _training_helpers import mesh_4x2, reset_state
from shardtensor.graph import recompile as compile_debug


@pytest.fixture(autouse=True)
def _debug(monkeypatch):
    reset_state()
    monkeypatch.setenv("SHARDTENSOR_DEBUG", "1")
    yield
    reset_state()


def _lines(capsys):
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[shardtensor] compile #")]


def _run(shape=(8, 37), spec=("data", None), dtype=torch.float32, scalar=3):
    x = st.shard(torch.ones(shape, dtype=dtype), mesh_4x2(), spec)
    return (x * scalar).sum(0).cpu()


def test_each_compilation_says_why(capsys):
    capsys.readouterr()
    _run((8, 37))
    first = _lines(capsys)
    assert len(first) == 1 and re.search(r"compile #\d+ at test_compile_debug\.py:\d+ \(\d+ ops", first[0])

    _run((8, 38))  # one input's shape changed
    (line,) = _lines(capsys)
    assert "input 0 ((8, 38) float32, ('data', None)) changed shape (8, 37) -> (8, 38)" in line
    assert "[compared with compile #" in line

    _run((8, 38), spec=(None, "model"))
    (line,) = _lines(capsys)
    assert "changed sharding P('data', None) -> P(None, 'model')" in line

    _run((8, 38), dtype=torch.float64)
    (line,) = _lines(capsys)
    assert "changed dtype float32 -> float64" in line and "changed shape" not in line

    _run((8, 38), scalar=3.0)  # a Python int became a float
    (line,) = _lines(capsys)
    assert "Python scalar 0 changed type: int -> float" in line

    _run((8, 38))  # cached: nothing to say
    assert _lines(capsys) == []


def test_a_new_graph_and_a_static_argument(capsys):
    x = st.shard(torch.ones(8, 41), mesh_4x2(), ("data", None))
    capsys.readouterr()
    torch.cumsum(x.exp(), 0).cpu()
    (line,) = _lines(capsys)
    assert "a new graph" in line
    torch.cumsum(x.exp(), 1).cpu()  # the dim is a static argument
    (line,) = _lines(capsys)
    assert "op 1 (aten.cumsum.default) arguments" in line and "-> " in line


def test_compiled_function_names_its_argument(capsys):
    @st.compile
    def scale(t):
        return t * 5 - 1

    mesh = mesh_4x2()
    capsys.readouterr()
    scale(st.shard(torch.ones(8, 43), mesh, ("data", None)))
    scale(st.shard(torch.ones(8, 44), mesh, ("data", None)))
    lines = _lines(capsys)
    assert any("input 0 (argument 0 of scale; (8, 44) float32" in ln and "(8, 43) -> (8, 44)" in ln for ln in lines), (
        lines
    )


def test_a_loop_that_keeps_compiling_warns_once(capsys, monkeypatch):
    monkeypatch.setattr(compile_debug, "RECOMPILE_WARNING_THRESHOLD", 2)
    mesh = mesh_4x2()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(50, 55):
            x = st.shard(torch.ones(8, n), mesh, ("data", None))
            (x + 2).cpu()  # the same line compiles a new graph each iteration
    found = [w for w in caught if issubclass(w.category, st.RecompilationWarning)]
    assert len(found) == 1, [str(w.message) for w in caught]
    assert "compiled 3 different graphs" in str(found[0].message)
    assert found[0].filename == __file__  # points at the user's line, not at shardtensor
    assert "changed shape" in str(found[0].message)


def test_silent_without_the_variable(capsys, monkeypatch):
    monkeypatch.delenv("SHARDTENSOR_DEBUG")
    capsys.readouterr()
    _run((8, 47))
    assert "[shardtensor]" not in capsys.readouterr().err
    monkeypatch.setenv("SHARDTENSOR_DEBUG", "0")
    _run((8, 48))
    assert "[shardtensor]" not in capsys.readouterr().err
