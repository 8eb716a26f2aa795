"""Seeing shardings: PyTorch/XLA's ``visualize_sharding`` tables and the HTML grids Jupyter shows.

``visualize_sharding(string)`` and ``visualize_tensor_sharding(t)`` print (and return) a ``rich``
table of the first two tile dimensions of a sharding, one cell per block with the device(s)
holding it — ``'CPU 0'`` for a tile, ``'CPU [0, 1]'`` for a replica group — as PyTorch/XLA does.
In Jupyter, a ``ShardedTensor`` and a ``Mesh`` display as a coloured grid (``_repr_html_``): for a
tensor, each block of its first two dimensions with its devices and index ranges; for a mesh, the
device ids laid out along its named axes. A device has the same colour in every grid.

Example::

    mesh = st.Mesh(range(8), (4, 2), ("x", "y"))
    x = st.shard(torch.randn(8, 4), mesh, ("x", None))
    st.visualize_tensor_sharding(x)   # 4 rows: CPU [0, 1] / CPU [2, 3] / CPU [4, 5] / CPU [6, 7]
    x                                  # in Jupyter: the grid, "rows 0:2, cols 0:4" in the first cell
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import numpy as np

from shardtensor import runtime
from shardtensor import sharding as sh
from shardtensor.mesh import Mesh
from shardtensor.sharding import ParsedSharding, array_sharding, parse_sharding_string  # noqa: F401
from shardtensor.tensor import ShardedTensor

if TYPE_CHECKING:
    import rich.table  # imported when a table is drawn (rich is slow to import)


def tensor_sharding(t: ShardedTensor) -> tuple[str, Mesh | None, sh.PartitionSpec | None]:
    """(sharding string, mesh, spec) of ``t``'s stored value.

    A tensor sharded with ``shard``/``mark_sharding`` answers from its annotation without computing
    anything; for a value whose layout XLA chose (or a view) the pending graph runs first, as when
    printing it.

    Example::

        tensor_sharding(st.shard(x, mesh, ('x', None)))[0]   # '{devices=[4,1,2]0,...,7 last_tile_dim_replicate}'
    """
    if not isinstance(t, ShardedTensor):
        raise TypeError(f"expected a ShardedTensor (a tensor on st.device()), got {type(t).__name__}")
    cell = t._cell
    if cell.spec is not None and not t._chain:
        return sh.sharding_string(cell.mesh, cell.spec, t.dim()), cell.mesh, sh.PartitionSpec(*cell.spec)
    return array_sharding(t._concrete_array(), t.dim())


# --------------------------------------------------------------------------- rich tables

# tab20's dark hues then its light ones, so neighbouring device ids get different hues
_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#c7c7c7",
    "#dbdb8d",
    "#9edae5",
)


def _colour(device_id: int) -> tuple[str, str]:
    """(background, text colour) of a device: the same in every table and grid."""
    bg = _PALETTE[int(device_id) % len(_PALETTE)]
    r, g, b = (int(bg[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return bg, "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "#ffffff"


def _device_text(ids: list[int], platform: str, as_group: bool) -> str:
    # PyTorch/XLA's cell text: 'CPU 3' for a tile, 'CPU [0, 1]' (a Python list) for a group
    return f"{platform} {ids}" if as_group or len(ids) > 1 else f"{platform} {ids[0]}"


def _cells_2d(parsed: ParsedSharding, sharding: str) -> list[list[list[int]]]:
    """Rows of cells of device ids: the first two tile dims; later dims and replicas in each cell."""
    if parsed.kind != "tiled":
        return [[list(parsed.devices)]]
    if len(parsed.tile_dims) < 2:
        raise ValueError(
            f"sharding {sharding!r} is not organized as expected: visualize_sharding shows tilings of "
            f"at least two dimensions, this one tiles {len(parsed.tile_dims)} (as in PyTorch/XLA); "
            "in Jupyter, display the tensor itself to see a 1-D sharding"
        )
    grid = parsed.device_grid()
    rows, cols = parsed.tile_dims[:2]
    return [[grid[i, j].reshape(-1).tolist() for j in range(cols)] for i in range(rows)]


def visualize_sharding(
    sharding: str, use_color: bool = True, scale: float = 1.0, min_width: int = 9, max_width: int = 80
) -> rich.table.Table:
    """Print and return a ``rich`` table of which device holds which block of a sharding.

    Shows the first two tile dimensions: a tile's cell reads ``'CPU 0'``; a replica group's (from
    ``last_tile_dim_replicate``, or later tile dimensions) ``'CPU [0, 1]'``; ``'{replicated}'`` is
    one cell with every device. ``use_color`` colours the cells when the console can show colour
    (a terminal or Jupyter); otherwise cells are boxed (``box.SQUARE``, lines between rows).
    ``scale`` sets the height, ``min_width``/``max_width`` bound each cell's width. Strings that are
    not tilings of at least two dimensions (or ``{replicated}``) raise ValueError.

    Example::

        st.visualize_sharding('{devices=[2,4]0,1,2,3,4,5,6,7}')   # 2 rows: CPU 0 .. CPU 3 / CPU 4 .. CPU 7
    """
    import rich.align
    import rich.box
    import rich.console
    import rich.padding
    import rich.style
    import rich.table

    parsed = parse_sharding_string(sharding)
    cells = _cells_2d(parsed, sharding)
    platform = runtime.device_type()
    print(f"Visualizing {sharding} (showing up to the first two dimensions)")
    console = rich.console.Console(width=max_width)
    use_color = use_color and console.color_system is not None
    table = rich.table.Table(
        show_header=False,
        show_lines=not use_color,
        padding=0,
        highlight=not use_color,
        pad_edge=False,
        box=None if use_color else rich.box.SQUARE,
    )
    rows, cols = len(cells), len(cells[0])
    base_height = int(10 * scale)
    for row in cells:
        out = []
        for ids in row:
            text = _device_text(ids, platform, as_group=parsed.kind == "replicated")
            # each cell's share of a (10*scale)-line, 2.5:1 box, bounded by min/max width
            width = min(max(int(base_height * 2.5 / cols), min_width), max_width)
            height = max(int(base_height / rows), 1)
            left, extra = divmod(width - len(text) - 2, 2)
            top, extra_v = divmod(height - 2, 2)
            pad = [top, left + extra, top + extra_v, left]
            style = rich.style.Style()
            if use_color:
                bg, fg = _colour(ids[0])
                pad = [p + 1 for p in pad]
                style = rich.style.Style(bgcolor=bg, color=fg)
            top, right, bottom, left = (max(p, 0) for p in pad)
            out.append(
                rich.padding.Padding(
                    rich.align.Align(text, "center", vertical="middle"), (top, right, bottom, left), style=style
                )
            )
        table.add_row(*out)
    console.print(table, end="\n\n")
    return table


def visualize_tensor_sharding(t: ShardedTensor, **kwargs: Any) -> rich.table.Table:
    """``visualize_sharding`` of a tensor's sharding (the one XLA chose when nobody annotated it).

    Keyword arguments go to ``visualize_sharding``. A pending tensor without an annotation is
    computed first, as printing it would.

    Example::

        x = st.shard(torch.randn(8, 4), mesh, ('y', 'x'))
        st.visualize_tensor_sharding(x, use_color=False)   # rows CPU 0 CPU 2 CPU 4 CPU 6 / CPU 1 ...
    """
    return visualize_sharding(tensor_sharding(t)[0], **kwargs)


# --------------------------------------------------------------------------- HTML grids

_TABLE = "border-collapse:collapse;margin:2px 0"
_CELL = "border:2px solid #ffffff;padding:4px 10px;text-align:center;vertical-align:middle;white-space:nowrap"
_HEAD = "padding:2px 6px;text-align:center;font-weight:normal;color:#666666"


def _td(text_lines: list[str], device_id: int) -> str:
    bg, fg = _colour(device_id)
    body = "<br>".join(html.escape(line) for line in text_lines)
    return f'<td style="{_CELL};background:{bg};color:{fg}">{body}</td>'


def _ranges_text(shape: tuple, block: list[tuple[int, int]], shown: list[int]) -> str:
    names = {0: "rows", 1: "cols"} if len(shape) >= 2 else {0: "elements"}
    parts = [f"{names.get(d, f'dim {d}')} {block[d][0]}:{block[d][1]}" for d in shown]
    if any(lo == hi for lo, hi in block):
        parts.append("(padding only)")
    return ", ".join(parts) if parts else "scalar"


def _mesh_text(mesh: Mesh | None) -> str:
    if mesh is None:
        return ""
    axes = ", ".join(f"{name}={size}" for name, size in zip(_axis_labels(mesh), mesh.mesh_shape))
    return f" over mesh ({axes})"


def _tensor_html(t: ShardedTensor) -> str:
    """The Jupyter view of a ShardedTensor: its blocks, their devices and index ranges."""
    string, mesh, _ = tensor_sharding(t)
    shape = tuple(t.shape)
    parsed = parse_sharding_string(string)
    platform = runtime.device_type()
    grid_dims = (parsed.tile_dims or (1,) * len(shape)) if parsed.kind == "tiled" else (1,) * len(shape)
    devices = (
        parsed.device_grid() if parsed.kind == "tiled" else np.array(parsed.devices).reshape((1,) * len(shape) + (-1,))
    )
    sizes = [-(-n // k) for n, k in zip(shape, grid_dims)]  # ceil(N/k), padding at the end
    # the grid: dims 0 (rows) and 1 (cols); a 1-D tensor is one row; later split dims list blocks
    rows = grid_dims[0] if len(shape) >= 2 else 1
    cols = grid_dims[1] if len(shape) >= 2 else (grid_dims[0] if shape else 1)
    shown = [d for d in range(len(shape)) if d < 2 or grid_dims[d] > 1]
    lines = []
    for i in range(rows):
        tds = []
        for j in range(cols):
            lead = (i, j) if len(shape) >= 2 else ((j,) if shape else ())
            texts: list[str] = []
            first: int | None = None
            for rest in np.ndindex(*grid_dims[len(lead) :]):
                tile = lead + rest
                ids = devices[tile].reshape(-1).tolist()
                first = ids[0] if first is None else first
                block = [(min(k * s, n), min((k + 1) * s, n)) for k, s, n in zip(tile, sizes, shape)]
                texts += [
                    _device_text(ids, platform, as_group=parsed.kind == "replicated"),
                    _ranges_text(shape, block, shown),
                ]
            assert first is not None  # np.ndindex() yields at least one (possibly empty) index
            tds.append(_td(texts, first))
        lines.append(f"<tr>{''.join(tds)}</tr>")
    dtype = str(t.dtype).removeprefix("torch.")
    title = (
        f"<b>ShardedTensor</b> {html.escape(str(shape))} {html.escape(dtype)} &mdash; "
        f"{html.escape(string)}{html.escape(_mesh_text(mesh))}"
    )
    return (
        f'<div class="shardtensor-sharding" style="font-family:monospace;font-size:12px">'
        f'<div>{title}</div><table style="{_TABLE}">{"".join(lines)}</table></div>'
    )


def _axis_labels(mesh: Mesh) -> list[str]:
    return list(mesh.axis_names) if mesh.axis_names is not None else [f"axis {i}" for i in range(len(mesh.mesh_shape))]


def _mesh_html(mesh: Mesh) -> str:
    """The Jupyter view of a Mesh: device ids laid out along its axes (names and sizes)."""
    names: list[str | None] = list(_axis_labels(mesh))
    ids = mesh.get_logical_mesh()
    platform = runtime.device_type()
    if ids.ndim == 1:
        ids, names = ids.reshape(1, -1), [None, *names]
    # the last two axes form each grid; one grid per index of the leading axes
    grids = []
    for lead in np.ndindex(*ids.shape[:-2]):
        block = ids[lead]
        row_name, col_name = names[-2], names[-1]
        head = "".join(f'<th style="{_HEAD}">{html.escape(f"{col_name}={j}")}</th>' for j in range(block.shape[1]))
        corner = html.escape(f"{row_name} \\ {col_name}") if row_name is not None else ""
        rows = [f'<tr><th style="{_HEAD}">{corner}</th>{head}</tr>']
        for i, row in enumerate(block):
            label = html.escape(f"{row_name}={i}") if row_name is not None else ""
            cells = "".join(_td([f"{platform} {int(d)}"], int(d)) for d in row)
            rows.append(f'<tr><th style="{_HEAD}">{label}</th>{cells}</tr>')
        caption = ", ".join(f"{n}={k}" for n, k in zip(names, lead))
        caption = f'<div style="color:#666666">{html.escape(caption)}</div>' if caption else ""
        grids.append(f'{caption}<table style="{_TABLE}">{"".join(rows)}</table>')
    axes = " &times; ".join(html.escape(f"{n}={s}") for n, s in zip(_axis_labels(mesh), mesh.mesh_shape))
    title = f"<b>{html.escape(type(mesh).__name__)}</b> {axes} ({mesh.size()} {html.escape(platform)} devices)"
    return (
        f'<div class="shardtensor-mesh" style="font-family:monospace;font-size:12px">'
        f"<div>{title}</div>{''.join(grids)}</div>"
    )


# tensor.py and mesh.py sit below this module and must not import it (and tensor.py is edited
# elsewhere): the Jupyter hooks are attached here, when `import shardtensor` imports this module.
ShardedTensor._repr_html_ = _tensor_html  # type: ignore[attr-defined]  # attached here on purpose (above)
Mesh._repr_html_ = _mesh_html  # type: ignore[attr-defined]
