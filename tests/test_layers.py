"""The package's imports point one way: down the layers of DESIGN.md ("Parts"), with no cycles.

The import graph is built from the source with ``ast``, imports inside functions included, so a
lazy import cannot hide an upward dependency. A module may import modules of its own layer or of
lower ones; the package itself (``import shardtensor``, the public API) only from the top layer.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "shardtensor"

# The layers, bottom up: each part is a module or a folder of shardtensor/ (DESIGN.md, "Parts").
LAYERS = [
    ("L0", {"runtime", "metrics", "dtypes", "trees"}),
    ("L1", {"mesh", "sharding"}),
    ("L2", {"ops"}),
    ("L3", {"graph"}),
    ("L4", {"tensor"}),
    ("L5", {"dispatch"}),
    (
        "L6",
        {
            "annotate",
            "device_alias",
            "compiler",
            "frozen_replay",
            "replay_guard",
            "replay_check",
            "trace_reads",
            "exporter",
            "explain",
            "stages",
            "hlo_collectives",
            "debug",
            "nn_utils",
            "optim_prime",
            "optim_steps",
            "dynamo_backend",
            "checkpoint",
            "distributed",
            "serialization",
            "jax_ops",
            "manual",
            "integrations",
        },
    ),
    ("L7", {"fsdp", "data", "tensor_parallel", "demo", "generation", "decode_loop", "kernels", "xla"}),
]
PUBLIC_API = "<the package: import shardtensor>"


def _rank(part: str) -> int:
    return next(i for i, (_, parts) in enumerate(LAYERS) if part in parts)


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(module: str) -> str:
    """'shardtensor.graph.program' -> 'graph'; the package itself -> PUBLIC_API."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else PUBLIC_API


def _imports(root, path, modules):
    """(line, imported module of the package) for every import in the file, at any depth."""
    me = _module_name(root, path)
    top = root.name
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == top:
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, up level - 1
                base = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != top:
                continue
            for alias in node.names:  # `from shardtensor import graph` imports a module, not a name
                sub = f"{target}.{alias.name}"
                yield node.lineno, sub if sub in modules else target


def import_graph(root: pathlib.Path) -> dict:
    """module -> (file relative to root's parent, [(line, imported module)]) for every module under ``root``."""
    files = sorted(root.rglob("*.py"))
    modules = {_module_name(root, f) for f in files}
    return {_module_name(root, f): (f.relative_to(root.parent), list(_imports(root, f, modules))) for f in files}


def parts_without_layer(graph) -> list:
    parts = {_part(m) for m in graph} - {PUBLIC_API}
    return sorted(p for p in parts if not any(p in ps for _, ps in LAYERS))


def upward_imports(graph) -> list:
    """'file:line: module (Lk) imports target (Lm)' for every import from a lower layer to a higher one."""
    wrong = []
    for module, (path, imports) in graph.items():
        mine = _part(module)
        if mine == PUBLIC_API:
            continue  # the package's __init__ gathers the API from every layer
        for line, target in imports:
            theirs, where = _part(target), f"{path}:{line}"
            if theirs == PUBLIC_API:
                if _rank(mine) != len(LAYERS) - 1:
                    wrong.append(
                        f"{where}: {module} ({LAYERS[_rank(mine)][0]}) imports the package itself "
                        "(the public API), which only the top layer may"
                    )
            elif _rank(theirs) > _rank(mine):
                wrong.append(
                    f"{where}: {module} ({LAYERS[_rank(mine)][0]}) imports {target} "
                    f"({LAYERS[_rank(theirs)][0]}), a higher layer"
                )
    return wrong


def import_cycles(graph) -> list:
    """Each cycle of module imports once, as a list of modules (a folder's __init__ importing its own
    modules is how the folder exposes them, not a cycle)."""
    edges = {}
    for m, (path, imports) in graph.items():
        if _part(m) == PUBLIC_API:
            continue
        own = path.name == "__init__.py"
        edges[m] = sorted(
            {
                t
                for _, t in imports
                if t in graph and t != m and _part(t) != PUBLIC_API and not (own and t.startswith(m + "."))
            }
        )
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        stack.append(m)
        for t in edges.get(m, ()):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    return cycles


GRAPH = import_graph(PACKAGE)


def test_every_part_has_a_layer():
    missing = parts_without_layer(GRAPH)
    assert not missing, f"parts of shardtensor/ with no layer in tests/test_layers.py and DESIGN.md: {missing}"


def test_imports_point_down():
    wrong = upward_imports(GRAPH)
    assert not wrong, "imports that point up a layer:\n" + "\n".join(wrong)


def test_no_import_cycles():
    cycles = import_cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _fake_package(tmp_path, files: dict) -> pathlib.Path:
    root = tmp_path / "shardtensor"
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


def test_the_checks_see_imports_inside_functions_and_cycles(tmp_path):
    root = _fake_package(
        tmp_path,
        {
            "__init__.py": "from shardtensor import graph, tensor\n",
            "graph/__init__.py": "",
            "graph/state.py": "def f():\n    from shardtensor.tensor import sharded\n",  # up: L3 -> L4
            "graph/program.py": "from . import execute\n",
            "graph/execute.py": "from shardtensor.graph import program\n",  # a cycle within L3
            "tensor/__init__.py": "",
            "tensor/sharded.py": "import shardtensor\n",  # the public API below the top layer
            "fsdp/__init__.py": "import shardtensor as st\nfrom shardtensor.graph import state\n",  # fine
        },
    )
    graph = import_graph(root)
    wrong = upward_imports(graph)
    assert len(wrong) == 2, wrong
    assert (
        "shardtensor/graph/state.py:2: shardtensor.graph.state (L3) imports shardtensor.tensor.sharded (L4)" in wrong[0]
    )
    assert "shardtensor/tensor/sharded.py:1" in wrong[1] and "public API" in wrong[1]
    assert import_cycles(graph) == [
        ["shardtensor.graph.execute", "shardtensor.graph.program", "shardtensor.graph.execute"]
    ]
    assert parts_without_layer(import_graph(_fake_package(tmp_path, {"newpart.py": ""}))) == ["newpart"]
