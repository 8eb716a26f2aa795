"""Where a repeated lazy training step spends the host's time (issue 37, section 2).

An MLP (``--layers`` Linear+GELU blocks of ``--width``) trained lazily with torch's default AdamW on
8 simulated CPU devices; after a warm-up, ``--steps`` steps are timed (wall, perf_counter) in parts:
recording (the step's Python: model, autograd, optimizer, shardtensor's dispatch), building the
program and its structural key at ``sync()`` (``Program.build``), the call into the jitted
executable, and the rest of the host's time (mostly waiting for the devices once runs queue up).
The parts are found by wrapping two internal functions, so this bench reads shardtensor's internals
(it is a profile, not a comparison with JAX).

``--model gpt`` times bench/gpt_model.py's GPT instead (``--layers`` blocks of width ``--width``,
4 heads, sequence 32, batch 2). Besides the means, the best step of each part is printed: the 2 cores
are shared, and the best step is the one least disturbed by the devices and other processes.

Python's cyclic garbage collector runs inside these parts whenever enough objects have been made (a
lazy step makes tens of thousands); its pauses are printed as a part of their own (mean per step and
the longest). ``--gc-freeze`` calls ``gc.freeze()`` after the warm-up (the model, the optimizer state
and the compiled programs are then never scanned again): what a user can do about those pauses.

Usage::

    python bench/lazy_host_time.py
    python bench/lazy_host_time.py --layers 12 --width 128 --steps 20
    python bench/lazy_host_time.py --model gpt --layers 4 --width 32
    python bench/lazy_host_time.py --model gpt --layers 12 --width 64 --gc-freeze
"""

from __future__ import annotations

import os

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")

import argparse  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import shardtensor as st  # noqa: E402
from shardtensor.graph import execute, program  # noqa: E402

SPENT: dict[str, float] = {}
STEP: dict[str, float] = {}  # this step's time per part


def _timed(label, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            SPENT[label] = SPENT.get(label, 0.0) + elapsed
            STEP[label] = STEP.get(label, 0.0) + elapsed

    return wrapper


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the warm-up")
    args = p.parse_args()

    build = program.Program.build.__func__
    program.Program.build = classmethod(_timed("building the program and its key", build))
    execute.call_executable = _timed("calling the jitted executable", execute.call_executable)

    torch.manual_seed(0)
    if args.model == "gpt":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpt_model import GPT

        model = GPT(vocab=256, seq=32, d=args.width, heads=4, layers=args.layers).to(st.device())
        x = torch.randint(0, 256, (2, 32)).to(st.device())
        y = torch.randint(0, 256, (2, 32)).to(st.device())
        described = f"GPT of {args.layers} blocks of width {args.width} (sequence 32, batch 2)"
    else:
        blocks = [m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.GELU())]
        model = nn.Sequential(*blocks).to(st.device())
        x = torch.randn(32, args.width).to(st.device())
        y = torch.randint(0, args.width, (32,)).to(st.device())
        described = f"{args.layers} Linear+GELU blocks of width {args.width}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # torch's default: step counters on the host

    def record():
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(5):
        record()
        st.sync()
    st.sync(wait=True)
    if args.gc_freeze:
        gc.freeze()
    pauses: list[float] = []
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])

    gc.callbacks.append(on_gc)
    SPENT.clear()
    recording = 0.0
    best: dict[str, float] = {}
    start = time.perf_counter()
    for _ in range(args.steps):
        STEP.clear()
        t0 = time.perf_counter()
        loss = record()
        STEP["recording"] = time.perf_counter() - t0
        recording += STEP["recording"]
        st.sync()
        for label, seconds in STEP.items():
            best[label] = min(best.get(label, seconds), seconds)
    host = time.perf_counter() - start
    gc.callbacks.remove(on_gc)
    loss.item()
    n = args.steps
    print(f"lazy step: {described}, default AdamW, 8 devices")
    print(f"  host time per step {host / n * 1e3:.2f} ms, of which (mean; best step):")
    print(f"    recording {recording / n * 1e3:.2f} ms; {best['recording'] * 1e3:.2f} ms")
    for label, seconds in SPENT.items():
        print(f"    {label} {seconds / n * 1e3:.2f} ms; {best[label] * 1e3:.2f} ms")
    rest = host - recording - sum(SPENT.values())
    print(f"    the rest (waiting for queued runs, bookkeeping) {rest / n * 1e3:.2f} ms")
    longest = max(pauses, default=0.0)
    frozen = " (after gc.freeze())" if args.gc_freeze else ""
    print(
        f"  garbage collector's pauses{frozen}, inside the parts above: {sum(pauses) / n * 1e3:.2f} ms per step, "
        f"{len(pauses)} collections, the longest {longest * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
