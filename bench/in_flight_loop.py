"""Issue 35's frozen training loop that reads nothing: it must run to the end and train as eager torch.

A Linear 512x512 with capturable Adam, its batch sharded over 8 CPU devices, stepped by a frozen
``st.compile`` function 300 times without reading a result. XLA:CPU queues at most 32 programs per
device; with up to 256 programs in flight the process died after ~60 s ("rendezvous.cc:161
Termination timeout for all reduce ... 40 seconds exceeded"). shardtensor now keeps at most
``max_in_flight()`` runs queued (16 on CPU).

Usage::

    python bench/in_flight_loop.py              # 300 steps
    python bench/in_flight_loop.py --steps 1000

It prints the most runs seen in flight and the time, and exits with status 1 if the parameters
differ from eager torch's (an abort ends the process with XLA's own status).
"""

from __future__ import annotations

import os

# Before anything imports jax.
os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")

import argparse
import copy
import sys
import time

import torch
import torch.nn as nn

import shardtensor as st
from shardtensor.graph import inflight


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    steps = parser.parse_args().steps
    torch.manual_seed(0)
    model = nn.Linear(512, 512)
    ref, dev = copy.deepcopy(model), copy.deepcopy(model).to(st.device())
    opt = torch.optim.Adam(dev.parameters(), lr=1e-3, capturable=True)
    mesh = st.Mesh(range(8), (8,), ("d",))
    x, y = torch.randn(64, 512), torch.randn(64, 512)
    xs, ys = st.shard(x, mesh, ("d", None)), st.shard(y, mesh, ("d", None))

    @st.compile
    def step():
        loss = (dev(xs) - ys).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    start, most = time.perf_counter(), 0
    for _ in range(steps):
        loss = step()
        most = max(most, inflight.in_flight())
    loss = loss.cpu()
    elapsed, bound = time.perf_counter() - start, inflight.max_in_flight()
    print(f"{steps} steps in {elapsed:.1f} s; most runs in flight {most} (bound {bound})")
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    for _ in range(steps):
        ref_loss = (ref(x) - y).pow(2).mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    try:
        torch.testing.assert_close(dev.weight.cpu(), ref.weight, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-3, atol=1e-5)
    except AssertionError as error:
        print(f"differs from eager torch: {error}")
        return 1
    print("same parameters and loss as eager torch")
    return 0 if most <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
