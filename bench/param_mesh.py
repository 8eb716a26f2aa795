"""Parameters moved to the device before any global mesh exists (issue 18, fourth point).

An MLP of ~8.4M parameters (1024 -> 2048 -> 2048 -> 1024) is moved with ``model.to(st.device())``
and synced; a batch of 64 is sharded over ``Mesh(range(n), (n,), ("data",))``; the forward runs
under ``torch.no_grad()`` and its output is read back. Two set-ups:

  global mesh first   ``st.set_global_mesh(mesh)`` before the move: the parameters land on the
                      batch's mesh
  no global mesh      the parameters land on the 1-D mesh of all devices (another jax mesh); the
                      first call copies them onto the batch's mesh and keeps them there

Printed per set-up: the fastest of ``--iters`` calls after ``--warmup`` (ms) and the copies onto
the graph's mesh (``ReplicateToGraphMesh``) per call after the first; then three SGD training steps:
the programs they compiled (one: the same program every step) and the copies after the first step.
Each set-up runs in its own process (the global mesh is process-wide). Outputs are checked against eager torch.

On CPU with jax 0.10.2 a replicated array moved between two meshes over the same devices keeps its
buffers (``device_put`` re-wraps them: ~0.1 ms for 16 MB), so the per-call time hardly differs; what
differs is the copies per call and the training step's second compile.

Usage::

    python bench/param_mesh.py [--iters 20] [--warmup 3]
"""

from __future__ import annotations

import os

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

SETUPS = ("global mesh first", "no global mesh")
TAG = "@@param-mesh "


def run_one(setup: str, iters: int, warmup: int) -> dict:
    import torch

    import shardtensor as st

    n = st.global_runtime_device_count()
    mesh = st.Mesh(range(n), (n,), ("data",))
    if setup == "global mesh first":
        st.set_global_mesh(mesh)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 2048),
        torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048),
        torch.nn.ReLU(),
        torch.nn.Linear(2048, 1024),
    )
    x = torch.randn(64, 1024)
    with torch.no_grad():
        ref = model(x)
    model.to(st.device())
    st.sync()
    batch = st.shard(x, mesh, ("data", None))
    times, copies = [], []
    with torch.no_grad():
        for i in range(warmup + iters):
            before = st.counter_value("ReplicateToGraphMesh") or 0
            start = time.perf_counter()
            out = model(batch).cpu()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times.append(elapsed)
            if i >= 1:
                copies.append((st.counter_value("ReplicateToGraphMesh") or 0) - before)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # then training steps (SGD): programs compiled over the steps, and copies after the first step
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiles = st.counter_value("UncachedCompile") or 0
    train_copies = 0
    for i in range(3):
        before = st.counter_value("ReplicateToGraphMesh") or 0
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
        st.sync()
        if i >= 1:
            train_copies += (st.counter_value("ReplicateToGraphMesh") or 0) - before
    return {
        "train_compiles": (st.counter_value("UncachedCompile") or 0) - compiles,
        "train_copies": train_copies,
        "setup": setup,
        "params": sum(p.numel() for p in model.parameters()),
        "ms": min(times) * 1e3,
        "copies_per_call": max(copies),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--setup", choices=SETUPS, help=argparse.SUPPRESS)  # (one set-up, in a child)
    args = p.parse_args(argv)
    if args.setup is not None:
        print(TAG + json.dumps(run_one(args.setup, args.iters, args.warmup)))
        return
    header = ("set-up", "params", "ms/call", "copies/call", "train compiles", "train copies")
    print(f"{header[0]:<20} {header[1]:>9} {header[2]:>8} {header[3]:>12} {header[4]:>15} {header[5]:>13}")
    for setup in SETUPS:
        cmd = [sys.executable, __file__, "--setup", setup, "--iters", str(args.iters), "--warmup", str(args.warmup)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(next(line for line in done.stdout.splitlines() if line.startswith(TAG))[len(TAG) :])
        print(
            f"{row['setup']:<20} {row['params']:>9} {row['ms']:>8.1f} {row['copies_per_call']:>12} "
            f"{row['train_compiles']:>15} {row['train_copies']:>13}"
        )


if __name__ == "__main__":
    main()
