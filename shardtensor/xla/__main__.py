"""``python -m shardtensor.xla script.py [args]`` (or ``-m module [args]``): run a PyTorch/XLA script
with ``torch_xla`` resolving to shardtensor's face (``shardtensor.xla.install()``), as ``python
script.py [args]`` would run it."""

from __future__ import annotations

import os
import runpy
import sys
import types

USAGE = "usage: python -m shardtensor.xla script.py [args ...]\n       python -m shardtensor.xla -m module [args ...]"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        raise SystemExit(0 if argv else 2)
    import shardtensor.xla as face

    face.install()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            raise SystemExit(2)
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    path = argv[0]
    sys.argv = argv
    _run_script(path, face._main_module_spec())


def _run_script(path: str, spec: object) -> None:
    """Run ``path`` as the main module, as ``python path`` does: its folder first on ``sys.path``, its
    code in a fresh ``__main__``. The module's spec names ``shardtensor.xla._mp_main`` so that processes
    spawned from it (multiprocessing's "spawn") install the face before re-running its top level."""
    path = os.path.abspath(path)
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    sys.path[0] = os.path.dirname(path)
    os.environ["SHARDTENSOR_XLA_SCRIPT"] = path
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__spec__ = spec  # type: ignore[assignment]
    main.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


if __name__ == "__main__":
    main()
