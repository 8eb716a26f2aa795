"""Which torch_xla names PyTorch/XLA's SPMD users write, and what shardtensor's face does with each
(issue 49's measure).

The names are read from a checkout of github.com/pytorch/xla (not part of this repository): its
``examples/``, its ``test/spmd/`` tests and the Python blocks of its SPMD docs
(``docs/source/perf/{spmd_basic,spmd_advanced,fsdp_spmd,spmd_distributed_checkpoint}.md``). Every
reference to a torch_xla name (``xs.mark_sharding``, ``from torch_xla.runtime import ...``,
``torch_xla._XLAC._get_xla_sharding_spec``) counts as a use of the module-level name; attributes of
objects (``mesh.get_logical_mesh``) are not counted. Each name is then looked up in the face
(``shardtensor.xla.install()``):

- **provided**: the face has the name (it may still refuse some arguments, saying why);
- **raises saying why**: the face has a stand-in, or the lookup raises an error naming the reason and
  what to use instead;
- **missing**: the module or name is absent (the error says only that the face does not have it).

Example::

    python bench/xla_name_coverage.py /path/to/pytorch/xla            # the table
    python bench/xla_name_coverage.py /path/to/pytorch/xla --names    # and every name with its uses
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import importlib
import os
import re
import sys

DOCS = ("spmd_basic.md", "spmd_advanced.md", "fsdp_spmd.md", "spmd_distributed_checkpoint.md")
ROOT = "torch_xla"


def sources(repo: str) -> list[tuple[str, str]]:
    """(where, Python source) of every file and doc block measured."""
    out = []
    for folder in (os.path.join(repo, "examples"), os.path.join(repo, "test", "spmd")):
        for base, _, files in sorted(os.walk(folder)):
            out += [(os.path.join(base, f), _read(os.path.join(base, f))) for f in sorted(files) if f.endswith(".py")]
    for name in DOCS:
        path = os.path.join(repo, "docs", "source", "perf", name)
        text = _read(path) if os.path.exists(path) else ""
        out += [(f"{path}[{i}]", b) for i, b in enumerate(re.findall(r"```(?:python|py)\s*\n(.*?)```", text, re.S))]
    return out


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _parse(text: str) -> ast.Module:
    """The source, or (a doc fragment that does not parse whole) each line that parses on its own."""
    try:
        return ast.parse(text)
    except SyntaxError:
        body = []
        for line in text.splitlines():
            with contextlib.suppress(SyntaxError):
                body += ast.parse(line.strip()).body
        return ast.Module(body=body, type_ignores=[])


class _Modules:
    """Which dotted torch_xla paths are modules, from the checkout's ``torch_xla/`` tree."""

    def __init__(self, repo: str) -> None:
        self.repo = repo

    def is_module(self, dotted: str) -> bool:
        parts = dotted.split(".")
        if parts[:2] == [ROOT, "_XLAC"]:
            return len(parts) == 2  # the C++ binding
        path = os.path.join(self.repo, *parts)
        return os.path.exists(path + ".py") or os.path.exists(os.path.join(path, "__init__.py"))

    def name_of(self, dotted: str) -> str | None:
        """``torch_xla.<module path>.<first attribute>`` of a reference, or None for a bare module."""
        parts = dotted.split(".")
        for k in range(len(parts), 0, -1):
            if self.is_module(".".join(parts[:k])):
                return None if k == len(parts) else ".".join(parts[: k + 1])
        return None


def uses(tree: ast.Module, modules: _Modules) -> list[str]:
    """The torch_xla names a source refers to, once per reference."""
    aliases: dict[str, str] = {}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == ROOT:
                    aliases[a.asname or ROOT] = a.name if a.asname else ROOT
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == ROOT:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = full
                if not modules.is_module(full):
                    found.append(full)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Attribute, ast.Name)) or id(node) in inner:
            continue
        chain, n = [], node
        while isinstance(n, ast.Attribute):
            chain.append(n.attr)
            n = n.value
        if isinstance(n, ast.Name) and n.id in aliases:
            name = modules.name_of(".".join([aliases[n.id], *reversed(chain)]))
            if name:
                found.append(name)
    return found


def classify(name: str) -> tuple[str, str]:
    """('provided' | 'raises saying why' | 'missing', detail) of one name under the face."""
    from shardtensor.xla.face._support import UNSUPPORTED_ATTR

    module_name, attribute = name.rsplit(".", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:  # (the face's message gives a reason for modules it leaves out on purpose)
        text = str(e)
        return ("missing" if "see docs/xla.md" in text or "face" not in text else "raises saying why"), text
    try:
        value = getattr(module, attribute)
    except AttributeError as e:
        text = str(e)
        generic = "has no attribute" in text or "private binding" in text
        return ("missing" if generic else "raises saying why"), text
    if getattr(value, UNSUPPORTED_ATTR, None):
        return "raises saying why", getattr(value, UNSUPPORTED_ATTR)
    return "provided", ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("repo", help="a checkout of github.com/pytorch/xla")
    p.add_argument("--names", action="store_true", help="list every name with its uses and class")
    args = p.parse_args()
    modules = _Modules(os.path.abspath(args.repo))
    counts: collections.Counter = collections.Counter()
    for _, text in sources(args.repo):
        counts.update(uses(_parse(text), modules))
    import shardtensor.xla

    shardtensor.xla.install()
    classes = {name: classify(name) for name in counts}
    total_uses = sum(counts.values())
    print(f"{len(counts)} distinct torch_xla names, {total_uses} uses\n")
    print("| under shardtensor's face | names | uses |")
    print("|---|---|---|")
    for kind in ("provided", "raises saying why", "missing"):
        names = [n for n in counts if classes[n][0] == kind]
        used = sum(counts[n] for n in names)
        print(f"| {kind} | {len(names)} | {used} ({100 * used / total_uses:.0f}%) |")
    if args.names:
        print()
        for name, n in counts.most_common():
            kind, detail = classes[name]
            print(f"{n:4d}  {kind:<18} {name}" + (f"  ({detail[:110]})" if kind != "provided" else ""))


if __name__ == "__main__":
    sys.exit(main())
