"""FSDPv2 GPT training step time in 1 process x 8 devices, 2 processes x 4 devices and 4 processes x 2
devices (issue 15): the same model, the same global batch, the same 8-device mesh, only the number of
processes that drive it changes.

Each layout of n processes is one ``st.launch(train, nprocs=n, devices_per_process=8 // n)`` job. The 1
x 8 case runs twice: as a plain process (no ``jax.distributed``: what one host runs, and the baseline of
the ratios), and as a job of one process through ``st.launch``, whose collectives then go through gloo
as in the multi-process jobs (that row separates gloo's cost from the process count's). In each process:
a global mesh over all 8 devices of the job, one axis ``'fsdp'`` (``st.set_global_mesh``);
``bench/gpt_model.py``'s GPT (seed 0: the same weights everywhere) wrapped in ``FSDPv2`` with each block
auto-wrapped, as ``bench/fsdp.py`` does; AdamW. The process feeds only its own rows of each global
batch, through ``st.MpDeviceLoader`` with ``ShardingSpec(mesh, ('fsdp', None), minibatch=True)``
(``tests/test_multihost.py``'s way): process ``p`` of ``n`` loads rows ``p*B/n .. (p+1)*B/n - 1``, which
its own devices hold. A step is forward, backward, ``opt.step()``, ``st.step()`` and ``loss.item()``
(which waits for the step; with several processes a gather over every process), lazy by default,
``--compile`` through ``st.compile``.

A step's time is from the end of the previous step to the end of this one (so it includes waiting for
the loader's next batch); per step the slowest process's time counts, and the table shows the median
over the steps after ``--warmup``, its ratio to the plain process, and the first step (trace + compile +
run). The losses of the first steps must agree across layouts (relative 1e-4: the collectives may add in
another order); the check is printed, and a mismatch makes the exit status 1.

A second table (``--data-parallel mlp|gpt|none``, ``bench/data_parallel.py``): the multi-process mode,
one process per device each holding the whole model, ``st.optimizer_step`` averaging the gradients,
against torch's DDP on gloo with plain CPU torch; 2 processes.

Example::

    .venv/bin/python bench/multiprocess.py                      # d=128, 2 blocks, batch 16, 8 steps
    .venv/bin/python bench/multiprocess.py --d 256 --layers 4 --seq 128 --steps 20
    .venv/bin/python bench/multiprocess.py --layouts 1 2 --compile
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import multiprocessing
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import data_parallel
from gpt_model import GPT, Block

DEVICES = 8  # the mesh of every layout
LOSS_RTOL = 1e-4
LOSSES_COMPARED = 3  # the first steps' losses, compared across layouts


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", type=int, nargs="+", default=[1, 2, 4], help="process counts (default 1 2 4)")
    p.add_argument("--steps", type=int, default=8, help="training steps per layout, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median (compiling)")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences; divides over 8 devices)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--d", type=int, default=128, help="model width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--compile", action="store_true", help="step through st.compile instead of lazily")
    p.add_argument(
        "--data-parallel",
        choices=("mlp", "gpt", "none"),
        default="mlp",
        help="model of the second table: st.optimizer_step vs DDP on gloo, 2 processes (bench/data_parallel.py)",
    )
    args = p.parse_args(argv)
    if args.steps - args.warmup < 1 or args.warmup < 1:
        p.error("--warmup must be at least 1 and --steps larger than --warmup (some steps must be timed)")
    if args.steps < LOSSES_COMPARED:
        p.error(f"--steps must be at least {LOSSES_COMPARED} (the losses of the first {LOSSES_COMPARED} are compared)")
    for n in args.layouts:
        if n < 1 or DEVICES % n:
            p.error(f"--layouts: {n} processes do not split {DEVICES} devices evenly; use 1, 2, 4 or 8")
    if args.batch % DEVICES:
        p.error(f"--batch must divide over the {DEVICES} devices (a multiple of {DEVICES})")
    if args.d % args.heads:
        p.error("--d must be a multiple of --heads")
    return args


# ---- one process of a layout (run by st.launch in each process) ---------------------------------


def global_batches(config: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches (inputs, next-token targets), the same in every process and layout."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(config["steps"]):
        tokens = torch.randint(0, config["vocab"], (config["batch"], config["seq"] + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def train(index: int, config: dict) -> dict:
    """Train ``config['steps']`` steps as process ``index`` of the job; this process's step times
    (seconds, from the end of the previous step) and losses."""
    import shardtensor as st
    from shardtensor.fsdp import FSDPv2, transformer_auto_wrap_policy

    processes = st.process_count()
    # gloo prints a line per connection to this process's stdout, between the parent's lines; the
    # results go back through a pipe and errors to stderr, so nothing else is lost
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    mesh = st.Mesh(range(DEVICES), (DEVICES,), ("fsdp",))
    st.set_global_mesh(mesh)  # FSDPv2 and the loader's spec use it

    torch.manual_seed(0)
    gpt = GPT(config["vocab"], config["seq"], config["d"], config["heads"], config["layers"])
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDPv2(gpt, auto_wrap_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

    def step(x, y):
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    run = st.compile(step) if config["compile"] else step
    # this process's rows of each global batch: its devices hold them (mesh order = process order)
    rows = config["batch"] // processes
    mine = slice(index * rows, (index + 1) * rows)
    local = [(x[mine], y[mine]) for x, y in global_batches(config)]
    spec = st.ShardingSpec(mesh, ("fsdp", None), minibatch=True)
    loader = st.MpDeviceLoader(local, st.device(), input_sharding=spec)
    st.sync()  # the model's upload is not part of the first step

    times, losses = [], []
    start = time.perf_counter()
    for x, y in loader:
        loss = run(x, y)
        if not config["compile"]:
            st.step()
        losses.append(loss.item())  # waits for the step (a collective with several processes)
        now = time.perf_counter()
        times.append(now - start)
        start = now
    return {"times": times, "losses": losses}


# ---- the launcher and the tables ----------------------------------------------------------------


@contextlib.contextmanager
def _environment(**values):
    """os.environ with ``values`` set (a spawned process starts with it), put back afterwards."""
    saved = dict(os.environ)
    try:
        os.environ.update(values)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_plain_process(config: dict) -> list[dict]:
    """``train`` in one spawned process with 8 CPU devices and no jax.distributed (in-process
    collectives); its report in a list, as st.launch returns them."""
    context = multiprocessing.get_context("spawn")
    with (
        _environment(SHARDTENSOR_CPU_DEVICES=str(DEVICES), SHARDTENSOR_PLATFORM="cpu"),
        concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool,
    ):
        return [pool.submit(train, 0, config).result()]


def measure_layout(config: dict, processes: int | None) -> dict:
    """One layout (``processes=None``: the plain process): per step the slowest process's time, the
    median after the warm-up, and process 0's losses (the loss is replicated: every process reads the
    same one)."""
    import shardtensor as st

    if processes is None:
        reports, processes = run_plain_process(config), 1
    else:
        reports = st.launch(train, args=(config,), nprocs=processes, devices_per_process=DEVICES // processes)
    per_step = [max(r["times"][i] for r in reports) for i in range(config["steps"])]
    for r in reports[1:]:
        if r["losses"] != reports[0]["losses"]:
            raise RuntimeError(f"{processes} processes read different losses: {[r['losses'] for r in reports]}")
    return {
        "median": statistics.median(per_step[config["warmup"] :]),
        "first": per_step[0],
        "losses": reports[0]["losses"],
    }


def table(title: str, headers: list[str], rows: list[tuple[str, list[str]]]) -> list[str]:
    """A titled, right-aligned text table: ``rows`` are (label, cells), one cell per header."""
    width = max(len(label) for label, _ in rows)
    cell = max(len(c) for _, cells in rows for c in [*cells, *headers]) + 2
    lines = [title, " " * width + "".join(f"{h:>{cell}}" for h in headers)]
    lines += [f"{label:<{width}}" + "".join(f"{c:>{cell}}" for c in cells) for label, cells in rows]
    return lines


def layout_name(processes: int | None) -> str:
    if processes is None:
        return f"1 process x {DEVICES} devices"
    name = f"{processes} process{'es' if processes > 1 else ''} x {DEVICES // processes} devices"
    return name + ", st.launch (gloo)" if processes == 1 else name


def loss_check(results: dict[int | None, dict]) -> tuple[bool, list[str]]:
    """Whether the first steps' losses of every layout agree with the first layout's, and the lines
    that say so."""
    base_n = next(iter(results))
    base = results[base_n]["losses"][:LOSSES_COMPARED]
    width = max(len(layout_name(n)) for n in results)
    ok, lines = True, [f"losses of the first {LOSSES_COMPARED} steps (must agree to {LOSS_RTOL:g} relative):"]
    for n, r in results.items():
        got = r["losses"][:LOSSES_COMPARED]
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, base))
        agrees = worst <= LOSS_RTOL
        ok &= agrees
        verdict = "" if n == base_n else f"  max rel. diff {worst:.1e}  {'ok' if agrees else 'DIFFER'}"
        lines.append(f"  {layout_name(n):<{width}} {[round(v, 6) for v in got]}{verdict}")
    return ok, lines


def main(argv=None) -> int:
    args = parse(argv)
    config = {k: getattr(args, k) for k in ("steps", "warmup", "batch", "seq", "d", "heads", "layers", "vocab")}
    config["compile"] = args.compile
    parameters = sum(p.numel() for p in GPT(args.vocab, args.seq, args.d, args.heads, args.layers).parameters())
    cores = len(os.sched_getaffinity(0))
    print(
        f"FSDPv2 GPT (vocab {args.vocab}, {args.seq} tokens, d={args.d}, {args.heads} heads, {args.layers} blocks; "
        f"{parameters:,} parameters), global batch {args.batch}, AdamW, mesh ({DEVICES},) ('fsdp',), "
        f"{'st.compile' if args.compile else 'lazy'}; {args.steps} steps, median of the last "
        f"{args.steps - args.warmup}"
    )
    if any(n > cores for n in args.layouts):
        print(
            f"note: this machine has {cores} CPU cores: a layout of more processes than cores oversubscribes "
            "them (each process also runs its own XLA threads), which inflates its times"
        )

    wall = time.perf_counter()
    # layout 1: the plain process (the baseline), then the same through st.launch
    layouts: list[int | None] = [m for n in args.layouts for m in ([None, 1] if n == 1 else [n])]
    results = {n: measure_layout(config, n) for n in layouts}
    base = results[layouts[0]]
    rows = [
        (
            layout_name(n),
            [f"{r['median'] * 1e3:.1f}", f"{r['median'] / base['median']:.2f}", f"{r['first']:.2f}"],
        )
        for n, r in results.items()
    ]
    headers = ["step ms", "ratio", "first s"]
    title = f"== training step: the slowest process per step; ratio to {layout_name(layouts[0])}"
    for line in table(title, headers, rows):
        print(line)
    ok, lines = loss_check(results)
    for line in lines:
        print(line)

    # ---- data parallelism: st.optimizer_step against DDP on gloo with plain CPU torch --------------
    if args.data_parallel != "none":
        print()
        data_parallel.main(["--nprocs", "2", "--model", args.data_parallel])

    print(f"({time.perf_counter() - wall:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
