"""The cost of calling a frozen ``st.compile`` training step: an MLP (``--layers`` Linear+GELU
blocks) trained with SGD with momentum, Adam(capturable=True) or torch's default AdamW, the step frozen after its first
calls, then timed back to back (median of ``--reps`` runs of ``--calls`` calls, the device drained
after each run). The frozen call checks the Python state it depends on (gradients, hooks,
parameters, optimizer groups) before it runs: this is what that check costs in a training loop.

Usage::

    python bench/frozen_call.py
    python bench/frozen_call.py --layers 12 --optimizer adam

It uses only shardtensor's public API.
"""

from __future__ import annotations

import os

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")

import argparse
import statistics
import time

import torch
from torch import nn

import shardtensor as st


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--optimizer", choices=["sgd", "adam", "adamw-default"], default="sgd")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()

    torch.manual_seed(0)
    blocks = [m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.GELU())]
    model = nn.Sequential(*blocks).to(st.device())
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    elif args.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    else:  # torch's default AdamW, as a new user writes it (its step counters on the host)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @st.compile
    def train_step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    x = torch.randn(16, args.width).to(st.device())
    for _ in range(4):
        train_step(x)
    st.sync(wait=True)
    frozen = st.counter_value("CompileFrozen") or 0
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        for _ in range(args.calls):
            loss = train_step(x)
        loss.cpu()
        times.append((time.perf_counter() - start) / args.calls * 1e6)
    params = sum(1 for _ in model.parameters())
    print(
        f"frozen st.compile step: {args.layers} layers ({params} parameters), {args.optimizer}, "
        f"{len(st.devices())} devices; frozen: {bool(frozen)}"
    )
    print(f"us per call: median {statistics.median(times):.1f}, min {min(times):.1f}")


if __name__ == "__main__":
    main()
