"""Seeing shardings: visualize_sharding tables, the Jupyter HTML grids, and st.explain."""

import io
import re

import jax
import jax.numpy as jnp
import pytest
import rich.box
import torch
import torch.nn.functional as F
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as JP
from rich.console import Console

import shardtensor as st
from shardtensor.debug import parse_sharding_string
from shardtensor.explain import collective_ops, collectives_in_hlo, result_bytes

MESH = st.Mesh(range(8), (4, 2), ("x", "y"))
MESH_8 = st.Mesh(range(8), (8,), ("x",))
IDS = ",".join(map(str, range(8)))


def _cells(table):
    """The table's cell texts, row by row."""
    return [[col._cells[r].renderable.renderable for col in table.columns] for r in range(table.row_count)]


def _rendered(table, width=120):
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(table)
    return console.export_text()


# --------------------------------------------------------------------------- visualize_sharding


@pytest.mark.parametrize(
    ("sharding", "cells"),
    [
        (f"{{devices=[2,4]{IDS}}}", [["CPU 0", "CPU 1", "CPU 2", "CPU 3"], ["CPU 4", "CPU 5", "CPU 6", "CPU 7"]]),
        (
            f"{{devices=[4,1,2]{IDS} last_tile_dim_replicate}}",
            [["CPU [0, 1]"], ["CPU [2, 3]"], ["CPU [4, 5]"], ["CPU [6, 7]"]],
        ),
        ("{replicated}", [["CPU [0, 1, 2, 3, 4, 5, 6, 7]"]]),
        ("", [["CPU [0, 1, 2, 3, 4, 5, 6, 7]"]]),
        # multi-host style: ids >= 10, the row-major order of the string
        (
            "{devices=[2,8]0,4,8,12,2,6,10,14,1,5,9,13,3,7,11,15}",
            [[f"CPU {i}" for i in (0, 4, 8, 12, 2, 6, 10, 14)], [f"CPU {i}" for i in (1, 5, 9, 13, 3, 7, 11, 15)]],
        ),
        # V2 (iota) strings, as jax prints them
        (
            "{devices=[4,2]<=[2,4]T(1,0)}",
            [["CPU 0", "CPU 4"], ["CPU 1", "CPU 5"], ["CPU 2", "CPU 6"], ["CPU 3", "CPU 7"]],
        ),
        # later tile dims are shown as groups in the first two
        ("{devices=[2,2,2]<=[8]}", [["CPU [0, 1]", "CPU [2, 3]"], ["CPU [4, 5]", "CPU [6, 7]"]]),
    ],
)
def test_visualize_sharding_cells(sharding, cells, capsys):
    table = st.visualize_sharding(sharding)
    assert _cells(table) == cells
    out = capsys.readouterr().out
    assert out.startswith(f"Visualizing {sharding} (showing up to the first two dimensions)\n")
    for row in cells:  # printed too, each row on one line, in order
        assert re.search(r"[\s│]*".join(re.escape(c) for c in row), out), (row, out)
    text = _rendered(table)
    assert all(c in text for row in cells for c in row)


def test_visualize_sharding_without_colour_is_boxed(capsys):
    table = st.visualize_sharding(f"{{devices=[2,4]{IDS}}}", use_color=False)
    assert table.box is rich.box.SQUARE and table.show_lines
    assert _rendered(table).splitlines()[0].startswith("┌")


def test_visualize_sharding_colours_when_the_console_can(monkeypatch, capsys):
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.delenv("NO_COLOR", raising=False)
    table = st.visualize_sharding(f"{{devices=[2,4]{IDS}}}")
    assert table.box is None and not table.show_lines
    backgrounds = {table.columns[j]._cells[i].style.bgcolor.name for i in range(2) for j in range(4)}
    assert len(backgrounds) == 8  # one colour per device
    assert st.visualize_sharding(f"{{devices=[2,4]{IDS}}}", use_color=False).box is rich.box.SQUARE


@pytest.mark.parametrize(
    "bad",
    [
        "{devices=[4]0,1,2,3}",  # rank-1 tiling
        f"{{devices=[4,2]{IDS} last_tile_dim_replicate}}",  # rank 1 plus replication
        "{devices=[2,2]0,1,2}",  # too few ids
        "{devices=[2,2]0,1,2,2}",  # repeated id
        "{manual}",
        "devices=[2,2]0,1,2,3",
        "nonsense",
    ],
)
def test_visualize_sharding_rejects_what_it_cannot_show(bad):
    with pytest.raises(ValueError, match="not organized as expected|distinct device ids"):
        st.visualize_sharding(bad)


@pytest.mark.parametrize(
    ("spec", "first_row"),
    [
        (("x", "y"), ["CPU 0", "CPU 1"]),
        (("y", "x"), ["CPU 0", "CPU 2", "CPU 4", "CPU 6"]),
        (("x", None), ["CPU [0, 1]"]),
        ((None, "y"), ["CPU [0, 2, 4, 6]", "CPU [1, 3, 5, 7]"]),
        ((None, None), ["CPU [0, 1, 2, 3, 4, 5, 6, 7]"]),
    ],
)
def test_visualize_tensor_sharding(spec, first_row, capsys):
    x = st.shard(torch.randn(8, 4), MESH, spec)
    table = st.visualize_tensor_sharding(x, use_color=False)
    assert _cells(table)[0] == first_row
    assert f"Visualizing {x.sharding_spec} " in capsys.readouterr().out


def test_visualize_tensor_sharding_of_a_layout_xla_chose_on_an_unnamed_mesh(capsys):
    mesh = st.Mesh(range(8), (4, 2))
    y = st.shard(torch.randn(8, 4), mesh, (1, 0)) * 2  # pending, no annotation of its own
    assert _cells(st.visualize_tensor_sharding(y))[0] == ["CPU 0", "CPU 2", "CPU 4", "CPU 6"]


def test_parse_sharding_string_forms():
    v1 = parse_sharding_string("{devices=[1,2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}")
    v2 = parse_sharding_string("{devices=[1,2,4]<=[4,2]T(1,0) last_tile_dim_replicate}")
    assert v1 == v2 and v1.tile_dims == (1, 2) and v1.replicas == 4
    assert parse_sharding_string("{maximal device=3}").devices == (3,)
    assert parse_sharding_string("{replicated}", device_count=2).devices == (0, 1)


# --------------------------------------------------------------------------- HTML grids


def _td_texts(page):
    return [re.sub(r"<br>", " | ", m) for m in re.findall(r"<td[^>]*>(.*?)</td>", page)]


def test_tensor_html_grid():
    x = st.shard(torch.randn(8, 4), MESH, ("x", "y"))
    page = x._repr_html_()
    cells = _td_texts(page)
    assert len(cells) == 8 and len(re.findall(r"<tr>", page)) == 4
    assert cells[3] == "CPU 3 | rows 2:4, cols 2:4"  # PyTorch/XLA's placement: dev 3 holds rows 2:4, cols 2:4
    assert "{devices=[4,2]0,1,2,3,4,5,6,7}" in page and "(8, 4) float32" in page
    replicated_rows = _td_texts(st.shard(torch.randn(8, 4), MESH, ("x", None))._repr_html_())
    assert replicated_rows == [f"CPU [{2 * i}, {2 * i + 1}] | rows {2 * i}:{2 * i + 2}, cols 0:4" for i in range(4)]


def test_tensor_html_shows_the_real_extents_of_uneven_shards():
    cells = _td_texts(st.shard(torch.randn(10, 3), MESH, ("x", None))._repr_html_())
    assert [c.split(" | ")[1] for c in cells] == [
        "rows 0:3, cols 0:3",
        "rows 3:6, cols 0:3",
        "rows 6:9, cols 0:3",
        "rows 9:10, cols 0:3",
    ]
    cells = _td_texts(st.shard(torch.randn(5), st.Mesh(range(8), (4, 2), ("x", "y")), ("x",))._repr_html_())
    assert cells == [
        "CPU [0, 1] | elements 0:2",
        "CPU [2, 3] | elements 2:4",
        "CPU [4, 5] | elements 4:5",
        "CPU [6, 7] | elements 5:5, (padding only)",
    ]


def test_tensor_html_of_higher_rank_scalars_and_computed_layouts():
    mesh = st.Mesh(range(8), (2, 2, 2), ("a", "b", "c"))
    cells = _td_texts(st.shard(torch.randn(4, 6, 8), mesh, ("a", None, ("b", "c")))._repr_html_())
    assert len(cells) == 2  # dims 0 x 1 of the grid; dim 2's four blocks listed in each cell
    assert cells[0].startswith("CPU 0 | rows 0:2, cols 0:6, dim 2 0:2 | CPU 1 | rows 0:2, cols 0:6, dim 2 2:4")
    scalar = st.shard(torch.tensor(3.0), mesh, ())
    assert _td_texts(scalar._repr_html_()) == ["CPU [0, 1, 2, 3, 4, 5, 6, 7] | scalar"]
    y = st.shard(torch.randn(8, 4), st.Mesh(range(8), (4, 2)), (0, None)) + 1  # XLA's layout, unnamed mesh
    assert _td_texts(y._repr_html_())[0] == "CPU [0, 1] | rows 0:2, cols 0:4"


def test_mesh_html_and_escaping():
    page = st.Mesh(range(8), (4, 2), ("x", "y"))._repr_html_()
    assert "x=4 &times; y=2" in page and "(8 CPU devices)" in page
    assert _td_texts(page) == [f"CPU {i}" for i in range(8)]
    assert "x \\ y" in page and "y=1" in page and "x=3" in page
    page = st.Mesh([7, 6, 5, 4, 3, 2, 1, 0], (2, 2, 2), ("a", "b", "c"))._repr_html_()
    assert _td_texts(page) == [f"CPU {i}" for i in (7, 6, 5, 4, 3, 2, 1, 0)]
    assert "a=0" in page and "a=1" in page
    assert _td_texts(st.Mesh(range(8), (8,))._repr_html_()) == [f"CPU {i}" for i in range(8)]

    evil = st.Mesh(range(8), (4, 2), ("<script>", "a&b"))
    for page in (evil._repr_html_(), st.shard(torch.randn(8, 4), evil, ("<script>", None))._repr_html_()):
        assert "<script>" not in page and "&lt;script&gt;" in page and "a&amp;b" in page


# --------------------------------------------------------------------------- st.explain


def _jax_counts(fn, *avals):
    c = collectives_in_hlo(jax.jit(fn).lower(*avals).compile().as_text())
    return {k: v.count for k, v in c.items()}


def _engine_counters():
    # explain compiles outside the executable cache: nothing counted, nothing run (JAX's own
    # persistent-cache counters may see the compile when a cache is on, as documented)
    return {k: v for k, v in st.counters().items() if not k.startswith("Persistent")}


def _counts(ex):
    return {k: v.count for k, v in ex.collectives.items()}


def test_explain_contraction_sharded_matmul_compiles_without_running():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    sa, sb = st.shard(a, MESH_8, (None, "x")), st.shard(b, MESH_8, ("x", None))
    st.sync()
    before = _engine_counters()
    c = sa @ sb
    ex = st.explain(c)
    assert _engine_counters() == before  # no compile counted, nothing executed
    assert c._cell.is_pending()
    (out,) = ex.outputs
    assert out.shape == (8, 4) and out.dtype == torch.float32 and out.pending
    assert out.sharding == "{replicated}" and out.partition_spec == st.P(None, None)
    reduced = ex.collectives["all-reduce"].bytes + ex.collectives["reduce-scatter"].bytes
    assert ex.collectives["all-reduce"].count + ex.collectives["reduce-scatter"].count == 1
    assert reduced == 8 * 4 * 4  # the per-device partial product, f32[8,4]
    assert ex.collectives["all-gather"].count == 0 and ex.total_bytes == reduced
    jm = MESH_8.get_jax_mesh()
    assert _counts(ex) == _jax_counts(
        jnp.dot,
        jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(jm, JP(None, "x"))),
        jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(jm, JP("x", None))),
    )
    text = str(ex)
    assert "all-reduce" in text and "128 B" in text and "{replicated}" in text and "not run" in text
    torch.testing.assert_close(c.cpu(), a @ b)  # still runs normally afterwards


def test_explain_elementwise_has_no_collectives():
    x = st.shard(torch.randn(8, 6), MESH, ("x", "y"))
    ex = st.explain(torch.sin(x * 2 + 1))
    assert ex.total_count == 0 and ex.total_bytes == 0 and "collectives: none" in str(ex)
    assert ex.outputs[0].sharding == x.sharding_spec and ex.outputs[0].partition_spec == st.P("x", "y")


def test_explain_batch_sharded_cross_entropy_matches_jax():
    logits, targets = torch.randn(32, 10), torch.randint(0, 10, (32,))
    sl, stg = st.shard(logits, MESH_8, ("x", None)), st.shard(targets, MESH_8, ("x",))
    checked = st.explain(F.cross_entropy, sl, stg)
    st.set_checks(False)  # the loss's own collectives (the on-device target check adds scalar all-reduces)
    try:
        ex = st.explain(F.cross_entropy, sl, stg)
    finally:
        st.set_checks(True)
    assert ex.collectives["all-gather"].count == 0 and checked.collectives["all-gather"].count == 0
    extra = checked.collectives["all-reduce"].count - ex.collectives["all-reduce"].count
    assert extra == 2 and checked.collectives["all-reduce"].bytes - ex.collectives["all-reduce"].bytes == 2 * 8

    def reference(lg, t):  # torch's mean over the targets that are not ignore_index
        valid = t != -100
        picked = jnp.take_along_axis(jax.nn.log_softmax(lg, axis=-1), jnp.where(valid, t, 0)[:, None], axis=1)[:, 0]
        return -jnp.sum(jnp.where(valid, picked, 0.0)) / jnp.sum(valid.astype(lg.dtype))

    jm = MESH_8.get_jax_mesh()
    expected = _jax_counts(
        reference,
        jax.ShapeDtypeStruct((32, 10), jnp.float32, sharding=NamedSharding(jm, JP("x", None))),
        jax.ShapeDtypeStruct((32,), jnp.int64, sharding=NamedSharding(jm, JP("x"))),
    )
    assert _counts(ex) == expected
    assert ex.outputs[0].shape == () and ex.outputs[0].sharding == "{replicated}"
    torch.testing.assert_close(F.cross_entropy(sl, stg).cpu(), F.cross_entropy(logits, targets))


def test_explain_computed_tensors_views_and_lists():
    x = st.shard(torch.randn(8, 16), st.Mesh(range(8), (4, 2)), (0, 1))
    ex = st.explain(x)
    assert not ex.compiled and ex.hlo == "" and ex.total_count == 0
    assert ex.outputs[0].sharding == "{devices=[4,2]0,1,2,3,4,5,6,7}" and not ex.outputs[0].pending
    assert "[computed]" in str(ex)
    ex = st.explain([x.t(), x.sum(0)])  # a view of a computed tensor is a (tiny) graph of its own
    assert [o.partition_spec for o in ex.outputs] == [st.P(1, 0), st.P(1)]
    assert ex.collectives["all-reduce"].count == 1 and ex.collectives["all-reduce"].bytes == 8 * 4
    with pytest.raises(TypeError):
        st.explain(torch.zeros(2))


def test_explain_function_keeps_its_effects_pending():
    w = st.shard(torch.ones(8, 4), MESH, ("x", None))
    x = st.shard(torch.arange(32.0).reshape(8, 4), MESH, ("x", "y"))
    st.sync()
    before = _engine_counters()

    def step(inp):
        w.add_(inp)  # an in-place update: an effect of the call
        return (w * inp).sum()

    ex = st.explain(step, x)
    assert _engine_counters() == before
    labels = [o.label for o in ex.outputs]
    assert labels == ["output 0", "updated in place"]
    assert ex.outputs[1].partition_spec == st.P("x", None)
    assert ex.collectives["all-reduce"].count >= 1
    st.sync()  # the recorded call runs as usual
    torch.testing.assert_close(w.cpu(), 1 + torch.arange(32.0).reshape(8, 4))
    with pytest.raises(ValueError, match="recorded nothing"):
        st.explain(lambda: 3)


def test_explanation_html_escapes():
    mesh = st.Mesh(range(8), (4, 2), ("<b>", "y"))
    ex = st.explain(st.shard(torch.randn(8, 4), mesh, ("<b>", None)) * 2)
    page = ex._repr_html_()
    assert "P(&#x27;&lt;b&gt;&#x27;, None)" in page and "'<b>'" not in page and "collectives: none" in page
    assert repr(ex) == str(ex)


def test_hlo_collective_parser():
    hlo = """
  %all-gather-start = (f32[2,4]{1,0}, f32[16,4]{1,0}) all-gather-start(%p), dimensions={0}
  %all-gather-done = f32[16,4]{1,0} all-gather-done(%all-gather-start)
  %ar = (f32[], bf16[3,5]{1,0}) all-reduce(%a, %b), replica_groups={{0,1}}, to_apply=%add
  ROOT %rs = pred[7]{0} reduce-scatter(%c), dimensions={0}
  %cp = s64[2]{0} collective-permute(%d), source_target_pairs={{0,1}}
  %fusion = f32[4]{0} fusion(%e), calls=%all-reduce-like
"""
    c = collectives_in_hlo(hlo)
    assert c["all-gather"] == (1, 16 * 4 * 4)  # the -done's result, once
    assert c["all-reduce"] == (1, 4 + 2 * 15)
    assert c["reduce-scatter"] == (1, 7) and c["collective-permute"] == (1, 16) and c["all-to-all"] == (0, 0)
    assert [op.kind for op in collective_ops(hlo)] == [
        "all-gather",
        "all-reduce",
        "reduce-scatter",
        "collective-permute",
    ]
    assert result_bytes("c64[2]") == 16 and result_bytes("f8e4m3fn[3]") == 3 and result_bytes("token[]") == 0
