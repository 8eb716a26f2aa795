"""Start-up: ``import shardtensor`` against ``import torch, jax`` (with JAX's CPU backend started) in
the same environment, each in fresh processes; the best of N runs of each, and their ratio.

  warm    the C++ device extension already built (every import after the first)
  first   ``--first``: a fresh, empty torch extensions directory, so the import builds the extension
          (what a new install sees once; about a minute)

Targets (issue 12): warm <= 1.3x, first <= 2x ``import torch, jax``.

Usage::

    python bench/import_time.py            # warm, 5 runs each
    python bench/import_time.py --first    # also the first import after install
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

BASELINE = "import torch, jax; jax.devices()"
SHARDTENSOR = "import shardtensor"


def _time(code: str, env=None) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--first", action="store_true", help="also time the first import (builds the extension)")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_"))}
    _time(SHARDTENSOR, env)  # build the extension if needed, warm the file cache
    base = min(_time(BASELINE, env) for _ in range(args.runs))
    warm = min(_time(SHARDTENSOR, env) for _ in range(args.runs))
    print(f"import torch, jax (+ backend)  {base:6.2f} s   (best of {args.runs})")
    print(f"import shardtensor (warm)      {warm:6.2f} s   {warm / base:5.2f}x   target <= 1.3x")
    if args.first:
        with tempfile.TemporaryDirectory() as fresh:
            first = _time(SHARDTENSOR, dict(env, TORCH_EXTENSIONS_DIR=fresh))
        print(f"import shardtensor (first)     {first:6.2f} s   {first / base:5.2f}x   target <= 2x")


if __name__ == "__main__":
    main()
