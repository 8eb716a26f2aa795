"""The step-time cost of shardtensor's on-device value checks on train_vs_jax's GPT training step
(FSDP-style over 8 simulated devices, AdamW, cross-entropy over an embedding: two checked ops, and
the conditional that would restore every parameter and optimizer state after a failed check).

Four runs from the same weights on the same batches, interleaved step by step so that the machine's
load affects all alike: lazy mode and ``st.compile``, each with checks on (the default) and with
``st.set_checks(False)``. Prints each run's median step time, the ratio checks-on / checks-off per
mode (of the medians, and the median of the per-step ratios; the goal is at most 1.03), the largest
difference between their losses (they must agree), and how many check rows the step program carries.
Each step reads its loss (``float(loss)``), as train_vs_jax does.

Example::

    .venv/bin/python bench/checks_cost.py              # 20 steps per run
    .venv/bin/python bench/checks_cost.py --steps 40 --modes compile
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")

import train_vs_jax as tvj  # noqa: E402  (the GPT, its batches and the shardtensor training step)

# isort: split

import torch  # noqa: E402

import shardtensor as st  # noqa: E402
from shardtensor.graph import execute  # noqa: E402  (white box: the step program's check rows)


def check_rows_of_largest_program() -> int:
    programs = [fn.program for fn in execute._EXECUTABLES.values() if fn.program.checks]
    largest = max(programs, key=lambda p: len(p.steps), default=None)
    return len(largest.check_table) if largest is not None else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="steps per run (the first two are warm-up)")
    ap.add_argument("--modes", default="lazy,compile", help="comma-separated: lazy, compile")
    args = ap.parse_args()
    steps, modes = max(args.steps, 3), args.modes.split(",")
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in tvj.GPT().state_dict().items()}
    mesh = st.Mesh(range(8), (8,), ("fsdp",))
    batches = tvj.make_batches("gpt", steps)
    runs = {}
    for mode in modes:
        for checks in (True, False):
            st.set_checks(checks)
            runs[mode, checks] = tvj.ShardtensorRun("gpt", state, mesh, compiled=mode == "compile")
    times = {k: [] for k in runs}
    losses = {k: [] for k in runs}
    rows = 0
    for x, y in batches:
        for (mode, checks), run in runs.items():
            st.set_checks(checks)
            t0 = time.perf_counter()
            losses[mode, checks].append(run(x, y))
            times[mode, checks].append(time.perf_counter() - t0)
            if checks:
                rows = max(rows, check_rows_of_largest_program())
    st.set_checks(True)
    med = {k: statistics.median(v[2:]) for k, v in times.items()}
    print(f"\n== GPT training step, {steps} steps, 8 devices, FSDP-style, AdamW: on-device checks on / off")
    print(f"{'':8s} {'checks on':>11s} {'checks off':>11s} {'on / off':>9s} {'per step':>9s} {'max |loss diff|':>16s}")
    for mode in modes:
        on, off = med[mode, True], med[mode, False]
        # the median of the ratios of the two runs' same steps (run back to back): robust to load drift
        paired = statistics.median(a / b for a, b in zip(times[mode, True][2:], times[mode, False][2:]))
        diff = max(abs(a - b) for a, b in zip(losses[mode, True], losses[mode, False]))
        print(f"{mode:8s} {on * 1e3:9.1f}ms {off * 1e3:9.1f}ms {on / off:9.3f} {paired:9.3f} {diff:16.2e}")
    print(f"check rows in the step program: {rows} (an embedding and a cross-entropy target check)")


if __name__ == "__main__":
    main()
