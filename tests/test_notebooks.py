"""The notebooks in notebooks/ run from top to bottom, without Jupyter (CI has no Jupyter packages).

Each notebook's code cells are read from the .ipynb JSON and exec'd in order in ONE fresh Python
process (cwd: the notebook's directory), as a kernel would run them: IPython magic lines (``%...``,
``!...``) are skipped, and a cell's last expression is evaluated and rendered as Jupyter would show
it (``_repr_html_`` when it has one, else ``repr``; nothing when the line ends with ``;``), so the
display path the notebook relies on runs too. The asserts inside the notebooks (results against
eager torch, compile counts) are what makes this meaningful; an error in any cell fails the test
with the cell's number and its traceback.

The process starts without the device variables conftest.py sets, so the notebook's own first cell
is what configures JAX, as it is for a user.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIMEOUT = 480  # seconds per notebook; the per-test ceiling (pyproject.toml) is 600

# Runs in the child: python -c RUNNER path/to/notebook.ipynb
RUNNER = r'''
import ast, json, linecache, sys, traceback

path = sys.argv[1]
with open(path, encoding="utf-8") as f:
    notebook = json.load(f)
namespace = {"__name__": "__main__"}


def render(value):
    """What Jupyter would show for a cell's value: its HTML if it has some, else its repr."""
    if value is None:
        return
    html = getattr(type(value), "_repr_html_", None)
    text = html(value) if html is not None else repr(value)
    if not isinstance(text, str):
        raise TypeError(f"{type(value).__name__} displays as {type(text).__name__}, not str")
    print(f"[displayed {type(value).__name__}: {len(text)} characters]")


def display(*values, **kwargs):
    """IPython's display(), which a notebook may call without importing it."""
    for value in values:
        render(value)


namespace["display"] = display


def without_magics(source):
    # a magic line becomes `pass` at its indentation, so a block around it stays valid
    lines = []
    for line in source.splitlines():
        stripped = line.lstrip()
        lines.append(line[: len(line) - len(stripped)] + "pass" if stripped.startswith(("%", "!")) else line)
    return "\n".join(lines) + "\n"


number = 0
for index, cell in enumerate(notebook["cells"]):
    if cell["cell_type"] != "code":
        continue
    number += 1
    source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
    code = without_magics(source)
    name = f"<notebook cell {index}, code cell {number}>"
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # source lines in tracebacks
    print(f"----- code cell {number} (cell {index})", flush=True)
    try:
        tree = ast.parse(code, filename=name)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, name, "exec"), namespace)
        if last is not None:
            render(eval(compile(last, name, "eval"), namespace))
    except BaseException:
        sys.stdout.flush()
        print(f"{path}: code cell {number} (cell {index} of the notebook) failed:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
    sys.stdout.flush()
print(f"----- all {number} code cells ran")
'''


def _env():
    """The environment without the test suite's device set-up: the notebook does its own."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SHARDTENSOR_CPU_DEVICES", "SHARDTENSOR_PLATFORM", "XLA_FLAGS", "SHARDTENSOR_DEBUG")
    }
    env["XLA_FLAGS"] = os.environ.get("SHARDTENSOR_TEST_COMPILE_FLAGS", "")  # (no device count)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("MPLBACKEND", "Agg")  # a notebook that plots must not look for a display
    return env


def _code_cells(path):
    with open(path, encoding="utf-8") as f:
        return [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]


def test_there_are_notebooks():
    assert ROOT / "notebooks" / "quickstart.ipynb" in NOTEBOOKS, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path):
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(path)],
        cwd=path.parent,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, (
        f"{path.name} failed (exit {proc.returncode})\n--- stdout (end)\n{proc.stdout[-4000:]}\n"
        f"--- stderr (end)\n{proc.stderr[-8000:]}"
    )
    assert f"all {len(_code_cells(path))} code cells ran" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_stored_outputs_come_from_one_clean_run(path):
    """The committed outputs are those of one run from the top (execution counts 1, 2, 3, ...) in
    which no cell failed: re-run the whole notebook after editing it."""
    cells = _code_cells(path)
    counts = [c.get("execution_count") for c in cells]
    assert counts == list(range(1, len(cells) + 1)), f"{path.name}: execution counts {counts}"
    errors = [i + 1 for i, c in enumerate(cells) for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, f"{path.name}: code cells {errors} have an error output"
