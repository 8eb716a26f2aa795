"""Start-up: ``import shardtensor`` against ``import torch, jax`` (with JAX's CPU backend started) in
the same environment, each in fresh processes, and their ratios: in wall time and in CPU time (the
steadier figure on a machine whose other work comes and goes).

  warm    every import after the first (bytecode cached, C++ device extension loaded as it is)
  first   the first import after a fresh install: a copy of the installed package with no bytecode
          cache and an empty torch extensions directory, so only what the install left is there
          (the compiled device guard, built by setup.py)
  lazy    ``--lazy``: the same copy without the compiled module, as when the install could not build
          it: the import compiles it (``device_guard.cpp``) into the extensions directory

Targets (issue 12): warm <= 1.3x, first <= 2x ``import torch, jax``.

Usage::

    python bench/import_time.py            # the best of 5 runs of each (first: 5 fresh copies)
    python bench/import_time.py --lazy     # also the lazy build (one run)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

BASELINE = "import torch, jax; jax.devices()"
SHARDTENSOR = "import shardtensor"
# what the import loaded: the package's compiled module, or one it built
WHICH_EXT = "import shardtensor.tensor.device as d; print(d.EXT.__name__ if d.EXT else None)"
WHERE = "import importlib.util as u; print(u.find_spec('shardtensor').submodule_search_locations[0])"


def _cpu_seconds() -> float:
    """CPU time of the finished child processes and theirs (the compiler of a lazy build included)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(code: str, env, cwd=None) -> tuple[float, str, float]:
    """(wall seconds, stdout, CPU seconds) of ``python -c code``."""
    start, cpu = time.perf_counter(), _cpu_seconds()
    done = subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - start, done.stdout.strip(), _cpu_seconds() - cpu


def _fresh_import(package: pathlib.Path, env, with_module: bool) -> tuple[float, str, float]:
    """(wall seconds, the extension module it loaded, CPU seconds) of the first import of a fresh
    copy of ``package`` (no __pycache__, no extension cache)."""
    skip = ["__pycache__"] + ([] if with_module else ["_device_ext*.so"])
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as extensions:
        shutil.copytree(package, pathlib.Path(root) / "shardtensor", ignore=shutil.ignore_patterns(*skip))
        # cwd=root: `python -c` puts the working directory first on sys.path, so the copy is imported
        seconds, _, cpu = _run(SHARDTENSOR, dict(env, TORCH_EXTENSIONS_DIR=extensions), cwd=root)
        loaded = _run(WHICH_EXT, dict(env, TORCH_EXTENSIONS_DIR=extensions), cwd=root)[1]
    return seconds, loaded, cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--lazy", action="store_true", help="also the first import without the compiled module")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_"))}
    # the package `python -c` imports here (the working directory first, then the installed one)
    package = pathlib.Path(_run(WHERE, env)[1])
    _run(SHARDTENSOR, env)  # build the extension if needed, warm the file cache
    base, warm, first = [], [], []
    for _ in range(args.runs):  # interleaved, so that a change in the machine's load hits all three alike
        base.append(_run(BASELINE, env))
        warm.append(_run(SHARDTENSOR, env))
        first.append(_fresh_import(package, env, with_module=True))
    (base, _, base_cpu), (warm, _, warm_cpu), (first, loaded, first_cpu) = min(base), min(warm), min(first)
    print(f"shardtensor from {package}; wall time (the best of {args.runs}) and its ratio, CPU time and its ratio")
    print(f"import torch, jax (+ backend)  {base:6.2f} s           {base_cpu:6.2f} s CPU")
    print(
        f"import shardtensor (warm)      {warm:6.2f} s  {warm / base:5.2f}x   {warm_cpu:6.2f} s CPU  "
        f"{warm_cpu / base_cpu:5.2f}x   target <= 1.3x"
    )
    print(
        f"import shardtensor (first)     {first:6.2f} s  {first / base:5.2f}x   {first_cpu:6.2f} s CPU  "
        f"{first_cpu / base_cpu:5.2f}x   target <= 2x   (loaded {loaded})"
    )
    if loaded != "shardtensor.tensor._device_ext":
        print(
            "  (the package has no usable compiled module, so that first import built it: reinstall, or "
            "`python setup.py build_ext --inplace` in a checkout)"
        )
    if args.lazy:
        lazy, loaded, lazy_cpu = _fresh_import(package, env, with_module=False)
        print(
            f"import shardtensor (lazy)      {lazy:6.2f} s  {lazy / base:5.2f}x   {lazy_cpu:6.2f} s CPU  "
            f"{lazy_cpu / base_cpu:5.2f}x   (no compiled module: builds {loaded})"
        )


if __name__ == "__main__":
    main()
