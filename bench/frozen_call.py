"""The cost of calling a frozen ``st.compile`` training step: an MLP (``--layers`` Linear+GELU
blocks) or bench/gpt_model.py's GPT (``--model gpt``: ``--layers`` blocks of ``--width``, 16
parameters each) trained with SGD with momentum, Adam(capturable=True), AdamW(capturable=True) or
torch's default AdamW, the step frozen after its first calls, then timed back to back (median of
``--reps`` runs of ``--calls`` calls, the device drained after each run). The frozen call checks
the Python state it depends on (gradients, hooks, parameters, optimizer groups) before it runs:
this is what that check costs in a training loop.

``--host-only`` also times the replay with its program swapped for a no-op returning one real
run's outputs (shardtensor's host work per call alone: what a host whose devices run elsewhere, a
TPU's, pays before the chip gets the next step), and a ``jax.jit`` call of a trivial program taking
the same arrays (donated as the replay donates them) and returning as many (the overwritten inputs
passed through, zeros otherwise): jax's own dispatch of that many arrays. The host overhead of a
replay is the no-op replay plus that dispatch, and the ratio divides it by the dispatch (issue 37:
at most 1.2x). ``--profile`` prints the no-op replay's cProfile (top functions by own time). These
two read shardtensor internals (the frozen program); the rest uses only the public API.

Usage::

    python bench/frozen_call.py
    python bench/frozen_call.py --layers 12 --optimizer adam
    python bench/frozen_call.py --model gpt --layers 6 --width 32 --optimizer adamw --host-only
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
from gpt_model import GPT


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--optimizer", choices=["sgd", "adam", "adamw", "adamw-default"], default="sgd")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--host-only", action="store_true", help="also the replay's host work alone, and jax.jit's")
    p.add_argument("--profile", action="store_true", help="cProfile of the no-op replay")
    p.add_argument("--no-checks", action="store_true", help="on-device checks off (st.set_checks(False))")
    args = p.parse_args()
    if args.no_checks:
        st.set_checks(False)

    torch.manual_seed(0)
    if args.model == "gpt":
        model = GPT(vocab=64, seq=8, d=args.width, heads=2, layers=args.layers).to(st.device())
        x = torch.randint(0, 64, (2, 8)).to(st.device())

        def loss_of(x):
            return model(x).float().pow(2).mean()
    else:
        blocks = [m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.GELU())]
        model = nn.Sequential(*blocks).to(st.device())
        x = torch.randn(16, args.width).to(st.device())

        def loss_of(x):
            return model(x).pow(2).mean()

    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    elif args.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    elif args.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    else:  # torch's default AdamW, as a new user writes it (its step counters on the host)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @st.compile
    def train_step(x):
        loss = loss_of(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

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
        f"frozen st.compile step: {args.model}, {args.layers} layers ({params} parameters), {args.optimizer}, "
        f"{len(st.devices())} devices; frozen: {bool(frozen)}"
    )
    print(f"us per call: median {statistics.median(times):.1f}, min {min(times):.1f}")
    if args.host_only or args.profile:
        host_only(train_step, x, args)


def host_only(train_step, x, args):
    """The replay with a no-op program (shardtensor's host work alone) against a trivial jax.jit
    call of as many arrays; prints both and the ratio."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from shardtensor.graph import execute

    (frozen,) = train_step._frozen.values()
    real = frozen.executable
    program = real.program
    returned = train_step(x)
    st.sync(wait=True)
    outs = []  # what the run stored: fed back each call, as a training loop does
    for kind, ident, ref in frozen.targets:
        cell = ref() if kind not in ("arg", "ret") else [returned][ident]._cell
        outs.append(cell.value)
    rows = None
    if program.checks:
        rows = jax.device_put(np.zeros((max(len(program.check_table), 1), 3), np.int32))

    class NoOp:
        memory = getattr(real, "memory", None)

        def __init__(self):
            self.program = program

        def __call__(self, donated, kept, scalars):
            return (list(outs), rows) if rows is not None else list(outs)

    def best_of(fn, calls):
        best = float("inf")
        for _ in range(args.reps):
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - begin) / calls * 1e6)
        return best

    frozen.executable = NoOp()
    replays = st.counter_value("CompileReplay") or 0
    try:
        t_host = best_of(lambda: train_step(x), 4 * args.calls)
        if args.profile:
            import cProfile
            import pstats

            profile = cProfile.Profile()
            profile.enable()
            for _ in range(4 * args.calls):
                train_step(x)
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    finally:
        frozen.executable = real
    replays = (st.counter_value("CompileReplay") or 0) - replays
    # jax.jit of a trivial program taking the same arrays, donated as the replay donates them
    values = []
    for kind, _ident, ref in frozen.sources:
        values.append(x._cell.value if kind == "arg" else ref().value if kind == "old" else ref)
    values = [jnp.array(a, copy=True) for a in values]
    shapes = [(o.shape, o.dtype) for o in outs]
    overwrites = dict(frozen.overwrites)
    donated_at = {leaf: k for k, leaf in enumerate(program.donated)}

    def trivial(donated, kept, vectors):
        return [
            donated[donated_at[overwrites[j]]] if donated_at.get(overwrites.get(j, -1)) is not None else jnp.zeros(*s)
            for j, s in enumerate(shapes)
        ]

    jitted = jax.jit(trivial, donate_argnums=(0,), out_shardings=[o.sharding for o in outs])
    state = [values]
    vectors = execute.device_scalars(program, frozen.scalars)

    def call_jit():
        arrays = list(state[0])
        result = jitted([arrays[i] for i in program.donated], [arrays[i] for i in program.kept], vectors)
        for j, i in frozen.overwrites:
            arrays[i] = result[j]
        state[0] = arrays

    t_jit = best_of(call_jit, 4 * args.calls)
    print(
        f"  {len(frozen.sources)} array inputs ({len(program.donated)} donated), {len(outs)} outputs; "
        f"{replays} no-op replays"
    )
    print(
        f"  us per call: replay with a no-op program {t_host:.0f}, trivial jax.jit {t_jit:.0f}; "
        f"host overhead {t_host + t_jit:.0f} us, {(t_host + t_jit) / t_jit:.2f}x the jax.jit call"
    )


if __name__ == "__main__":
    main()
