"""Where a lazy training step's host time goes on the machine that runs it (issue 37 §2): the bf16 GPT
of bench/tpu.py trained lazily (``with st.step()``, ``AdamW(capturable=True)``, XLA's attention), per
step: the step's Python (recording: model, autograd, optimizer, shardtensor's dispatch), the
``st.step()`` exit (building and dispatching the program), and, with ``loss.item()`` each step, the
wait for the value; then a profile (cProfile, own time) of steps without reads.

On a TPU it tells whether lazy steps without reads are host-bound (recording + exit ≥ the chip's
step) or wait for the chip somewhere (a long exit); ``--tiny`` runs it on a CPU.

Usage::

    source bench/tpu_setup.sh && python3 bench/tpu_lazy_probe.py     # on the TPU machine
    python bench/tpu_lazy_probe.py --tiny
    python bench/tpu_lazy_probe.py --tiny --layers 8 --width 256     # a larger GPT on a CPU
    python bench/tpu_lazy_probe.py --tiny --layers 8 --width 256 --cpu-parts 30 --no-profile

``--cpu-parts N`` also times N steps (``loss.item()`` each) by the main thread's CPU time
(``time.thread_time``: what other processes on shared cores disturb least), with the collector off,
and prints the best step's recording, exit, and the exit's ``Program.build`` and executable call
(found by wrapping those two internal functions, as bench/lazy_host_time.py does).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import shardtensor as st  # noqa: E402
import tpu  # noqa: E402  (the GPT, its trainer and batches)
from gpt_model import GPT  # noqa: E402


def _steps(trainer, batches, n, read_each, clock=time.perf_counter):
    """[(recording s, st.step() exit s, read s)] for ``n`` lazy steps, by ``clock``."""
    parts = []
    for i in range(n):
        x, y = batches[i % len(batches)]
        t0 = clock()
        with st.step():
            loss = trainer.step(x, y)
            t1 = clock()
        t2 = clock()
        if read_each:
            loss.item()
        parts.append((t1 - t0, t2 - t1, clock() - t2))
    return parts, loss


def _ops_per_step(trainer, batches):
    """How many aten ops one lazy step hands to shardtensor's op handler."""
    from shardtensor.tensor import sharded

    handler, count = sharded._HANDLER, [0]

    def counting(func, args, kwargs):
        count[0] += 1
        return handler(func, args, kwargs)

    sharded.set_op_handler(counting)
    try:
        _steps(trainer, batches, 1, read_each=True)
    finally:
        sharded.set_op_handler(handler)
    return count[0]


def _cpu_parts(trainer, batches, n):
    """Best-step main-thread CPU ms: (recording, exit, Program.build, the executable's call)."""
    import gc

    from shardtensor.graph import execute, program

    spent = {"build": 0.0, "call": 0.0}

    def timed(label, fn):
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.thread_time() - start

        return wrapper

    build, call = program.Program.build, execute.call_executable
    program.Program.build = classmethod(timed("build", build.__func__))  # type: ignore[method-assign]
    execute.call_executable = timed("call", call)
    gc.collect()
    gc.disable()
    rows = []
    try:
        for i in range(n):
            spent.update(build=0.0, call=0.0)
            ((recording, exit_, _),), _ = _steps(trainer, batches[i % len(batches) :], 1, True, time.thread_time)
            rows.append((recording, exit_, spent["build"], spent["call"]))
    finally:
        gc.enable()
        program.Program.build, execute.call_executable = build, call  # type: ignore[method-assign]
    return [1e3 * min(r[k] for r in rows) for k in range(4)]


def _print(label, parts, seconds):
    n = len(parts)
    mean = [1e3 * sum(p[k] for p in parts) / n for k in range(3)]
    best = [1e3 * min(p[k] for p in parts) for k in range(3)]
    print(
        f"{label}: {1e3 * seconds / n:.1f} ms per step; recording {mean[0]:.1f} (best {best[0]:.1f}), "
        f"st.step() exit {mean[1]:.1f} (best {best[1]:.1f}), read {mean[2]:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, help="blocks (default: the size's)")
    parser.add_argument("--width", type=int, help="d (default: the size's)")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--cpu-parts", type=int, default=0, metavar="N", help="time N steps by thread CPU time")
    args = parser.parse_args()
    size = (tpu.TINY if args.tiny else tpu.SIZES)["bf16"]
    vocab, seq, d, heads, layers, batch, dtype = size
    layers, d = args.layers or layers, args.width or d
    size = (vocab, seq, d, heads, layers, batch, dtype)
    torch.manual_seed(0)
    state = {
        k: v.detach().clone() for k, v in GPT(vocab, seq, d, heads, layers, gelu="tanh").to(dtype).state_dict().items()
    }
    with tpu.xla_attention():
        trainer = tpu.TorchTrainer(state, size, capturable=True)
        batches = tpu._device_batches(tpu._batches(vocab, seq, batch, 4))
        _steps(trainer, batches, 3, read_each=True)  # compiles
        ops = _ops_per_step(trainer, batches)
        print(f"GPT of {layers} blocks of width {d}: {ops} aten ops dispatched to ShardedTensor a step")
        for read_each in (False, True):
            t0 = time.perf_counter()
            parts, loss = _steps(trainer, batches, args.steps, read_each)
            loss.item()
            _print("loss.item() each step" if read_each else "no reads", parts, time.perf_counter() - t0)
        if args.cpu_parts:
            rec, out, build, call = _cpu_parts(trainer, batches, args.cpu_parts)
            print(
                f"main thread's CPU, best of {args.cpu_parts} steps: recording {rec:.2f} ms "
                f"({1e3 * rec / ops:.1f} us an op), st.step() exit {out:.2f} ms "
                f"(Program.build {build:.2f}, the executable's call {call:.2f})"
            )
        if args.no_profile:
            return
        profile = cProfile.Profile()
        profile.enable()
        _, loss = _steps(trainer, batches, args.steps, read_each=False)
        loss.item()
        profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:7000])


if __name__ == "__main__":
    main()
