"""A training step under ``torch.compile(step, backend="shardtensor")`` against ``st.compile`` of the
same step: a small MLP (Linear, LayerNorm, GELU; parameters sharded over 8 devices) trained with SGD
(momentum) or AdamW. Prints, per variant, the programs one step runs (``ExecuteReplicated``), the
compiles after warm-up (``UncachedCompile``, Dynamo graphs), the largest loss difference against
eager CPU torch, and the median step time after warm-up (the step's loss read back each step).

``st.compile`` is timed twice: with the step returning ``loss`` (which requires grad: its Python
re-runs each call) and ``loss.detach()`` (it can be frozen and replayed without Python).

Usage::

    python bench/dynamo_step.py
    python bench/dynamo_step.py --optimizer adamw --steps 30

It uses only shardtensor's public API.
"""

from __future__ import annotations

import os

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import shardtensor as st


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 5))


def make_step(model, opt, detach):
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach() if detach else loss

    return step


def run(variant, args, mesh, batches):
    make_opt = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    }[args.optimizer]
    ref = make_model()
    dev = copy.deepcopy(ref).to(st.device())
    for layer in (dev[0], dev[3]):
        st.mark_sharding(layer.weight, mesh, ("d", None))
    ref_step = make_step(ref, make_opt(ref.parameters()), detach=False)
    step = make_step(dev, make_opt(dev.parameters()), detach=variant == "st.compile, loss.detach()")
    compiled = torch.compile(step, backend="shardtensor") if variant == "torch.compile" else st.compile(step)
    times, programs, diff = [], [], 0.0
    compiles_after_warmup = 0
    for i, (x, y) in enumerate(batches):
        xs, ys = st.shard(x, mesh, ("d", None)), st.shard(y, mesh, ("d",))
        st.sync()
        executed, compiled_before = st.counter_value("ExecuteReplicated") or 0, st.counter_value("UncachedCompile") or 0
        start = time.perf_counter()
        loss = compiled(xs, ys).item()
        times.append(time.perf_counter() - start)
        programs.append((st.counter_value("ExecuteReplicated") or 0) - executed)
        if i >= args.warmup:
            compiles_after_warmup += (st.counter_value("UncachedCompile") or 0) - compiled_before
        diff = max(diff, abs(loss - ref_step(x, y).item()))
    median_ms = 1e3 * statistics.median(times[args.warmup :])
    print(
        f"{variant:30s} programs/step {statistics.median(programs[args.warmup :]):.0f}  "
        f"compiles after warm-up {compiles_after_warmup}  max |loss - eager| {diff:.1e}  "
        f"median step {median_ms:.1f} ms"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    mesh = st.Mesh(range(8), (8,), ("d",))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 16, generator=g), torch.randint(0, 5, (32,), generator=g)) for _ in range(args.steps)]
    for variant in ("torch.compile", "st.compile", "st.compile, loss.detach()"):
        run(variant, args, mesh, batches)


if __name__ == "__main__":
    main()
