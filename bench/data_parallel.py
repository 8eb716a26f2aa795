"""Data parallelism across processes: ``st.optimizer_step`` against torch DDP on gloo (issue 15 §3).

N processes each hold a replica of the same model (same seed) and train on their N-th of the same
global batches. shardtensor: ``st.launch``, one CPU device per process, ``loss.backward();
st.optimizer_step(opt)`` (the gradients' mean is an all-reduce inside the step's program), in lazy
mode (``st.sync(wait=True)`` each step) and as an ``st.compile``'d step (frozen: replayed without
its Python). torch: ``DistributedDataParallel`` on gloo, plain CPU tensors, the same loop with
``opt.step()``. A step's time is the slowest process's median over ``--steps`` steps after
``--warmup`` (which compiles). Each side uploads/reads its batch from CPU tensors every step. The
last line checks that both trained the same parameters.

Example::

    .venv/bin/python bench/data_parallel.py                     # 2 processes, an MLP
    .venv/bin/python bench/data_parallel.py --model gpt --nprocs 2 --steps 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_model import GPT  # noqa: E402  (bench/ is not a package)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: mlp 256, gpt 16)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles)")
    args = p.parse_args(argv)
    args.batch = args.batch or (256 if args.model == "mlp" else 16)
    if args.batch % args.nprocs or args.steps < 1 or args.warmup < 0:
        p.error("--batch must split over --nprocs, --steps >= 1, --warmup >= 0")
    return args


# ---- the same model, data and loss on both sides --------------------------------------------------


def make_model(args) -> nn.Module:
    torch.manual_seed(0)
    if args.model == "gpt":
        return GPT(vocab=256, seq=32, d=64, heads=2, layers=2)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))


def batches(args, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This process's part of each global batch (the same global batches in every process)."""
    g = torch.Generator().manual_seed(1)
    rows = slice(index * args.batch // args.nprocs, (index + 1) * args.batch // args.nprocs)
    out = []
    for _ in range(args.warmup + args.steps):
        if args.model == "gpt":
            tokens = torch.randint(0, 256, (args.batch, 33), generator=g)
            x, y = tokens[:, :-1], tokens[:, 1:]
        else:
            x, y = torch.randn(args.batch, 256, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
        out.append((x[rows], y[rows]))
    return out


def loss_fn(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _median_after_warmup(times, warmup):
    return statistics.median(times[warmup:])


# ---- shardtensor ----------------------------------------------------------------------------------


def st_worker(index: int, args) -> dict:
    import shardtensor as st

    def run(compiled: bool):
        model = make_model(args).to(st.device())
        opt = make_optimizer(model)

        def step(x, y):
            loss_fn(model, x, y).backward()
            st.optimizer_step(opt)
            opt.zero_grad(set_to_none=True)

        step_fn = st.compile(step) if compiled else step
        times = []
        for x, y in batches(args, index):
            start = time.perf_counter()
            step_fn(x.to(st.device()), y.to(st.device()))
            st.sync(wait=True)
            times.append(time.perf_counter() - start)
        return _median_after_warmup(times, args.warmup), [p.detach().cpu() for p in model.parameters()]

    lazy, params = run(compiled=False)
    compiled, _ = run(compiled=True)
    return {"lazy": lazy, "compiled": compiled, "frozen": st.counter_value("CompileFrozen") or 0, "params": params}


# ---- torch DDP on gloo ----------------------------------------------------------------------------


def ddp_worker(index: int, args, port: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nprocs))  # no oversubscription
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=args.nprocs)
    try:
        model = nn.parallel.DistributedDataParallel(make_model(args))
        opt = make_optimizer(model)
        times = []
        for x, y in batches(args, index):
            start = time.perf_counter()
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        # numpy, not torch tensors: a queue passes those as shared memory, gone once this process exits
        params = [p.detach().numpy().copy() for p in model.module.parameters()]
        queue.put((index, _median_after_warmup(times, args.warmup), params))
    finally:
        dist.destroy_process_group()


def run_ddp(args) -> tuple[float, list]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=ddp_worker, args=(i, args, port, queue)) for i in range(args.nprocs)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a DDP process failed (exit {p.exitcode}); its errors are above")
    return max(r[1] for r in results), [torch.from_numpy(a) for a in results[0][2]]


def main(argv=None) -> int:
    args = parse(argv)
    import shardtensor as st

    start = time.perf_counter()
    st_results = st.launch(st_worker, args=(args,), nprocs=args.nprocs, devices_per_process=1)
    ddp_time, ddp_params = run_ddp(args)
    lazy, compiled = (max(r[k] for r in st_results) for k in ("lazy", "compiled"))
    print(
        f"data parallel, {args.nprocs} processes x 1 CPU device, {args.model}, global batch {args.batch}: "
        f"median step, ms ({args.steps} steps after {args.warmup} warm-up, slowest process)"
    )
    print(f"{'':>26} {'ms':>9} {'/ DDP':>7}")
    print(f"{'torch DDP (gloo)':>26} {ddp_time * 1e3:>9.2f} {1.0:>7.2f}")
    print(f"{'st.optimizer_step, lazy':>26} {lazy * 1e3:>9.2f} {lazy / ddp_time:>7.2f}")
    print(f"{'st.optimizer_step, compile':>26} {compiled * 1e3:>9.2f} {compiled / ddp_time:>7.2f}")
    diff = max((a - b).abs().max().item() for a, b in zip(st_results[0]["params"], ddp_params))
    frozen = min(r["frozen"] for r in st_results)
    print(f"max |parameter difference| shardtensor (lazy) vs DDP: {diff:.2e}; compiled step frozen: {frozen >= 1}")
    print(f"(bench time {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
