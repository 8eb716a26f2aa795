"""Time to the steady step (issue 50 §3): from the first call of a training step to the end of the
first steady step, cold (nothing compiled before, no persistent cache), shardtensor against
``jax.jit``'s first call of the same program, each configuration in a fresh process.

The model is bench/tpu.py's bf16 GPT (169M parameters on the chip; ``--tiny`` on a CPU) with AdamW as
torch's default builds it (``capturable=False``: the optimizer's state is created inside step 1).
Configurations:

- ``jax``: ``jax.jit`` of the step with donated state (its first call compiles the only program);
- ``compile``: ``st.compile`` of the step; its first call creates the optimizer's state in a small
  program of its own and compiles the steady step, which call 2 replays;
- ``compile-two-programs``: the same with that state made inside step 1's program (the behaviour
  before: step 2 compiles the steady program again);
- ``lazy``: ``with st.step():`` around each step, the model computed first (the state is made
  inside step 1 in lazy mode: two big compiles).

Printed: steps 1, 2 and 3 (wall seconds; the loss read after each), the start-up (steps 1 + 2) and
its ratio to JAX's first call (issue 50's target: at most 1.3x), the programs shardtensor compiled.

Example::

    python bench/first_steps.py               # on the chip: the 169M GPT
    SHARDTENSOR_CPU_DEVICES=1 python bench/first_steps.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = ["jax", "compile", "compile-two-programs", "lazy"]


def _worker(config: str, tiny: bool, steps: int) -> dict:
    sys.path.insert(0, HERE)
    import tpu  # noqa: PLC0415  (sets the device count before JAX starts)

    # isort: split
    import jax  # noqa: PLC0415
    import torch  # noqa: PLC0415

    import shardtensor as st  # noqa: PLC0415
    from gpt_model import GPT  # noqa: PLC0415
    from shardtensor import optim_prime  # noqa: PLC0415

    if config.endswith("two-programs"):
        optim_prime.prime_for_step = lambda optimizer: []  # the state made inside step 1's program
    size = (tpu.TINY if tiny else tpu.SIZES)["bf16"]
    vocab, seq, d, heads, layers, batch, dtype = size
    torch.manual_seed(0)
    state = {
        k: v.detach().clone() for k, v in GPT(vocab, seq, d, heads, layers, gelu="tanh").to(dtype).state_dict().items()
    }
    batches = tpu._batches(vocab, seq, batch, steps)
    if config == "jax":
        jitted = tpu.jax_train_step(size)
        box = list(tpu._jax_state(state, dtype))
        data = tpu._jax_batches(batches)
        jax.effects_barrier()

        def run(i):
            *box[:4], loss = jitted(*box[:4], *data[i])
            return float(loss)

    else:
        trainer = tpu.TorchTrainer(state, size, capturable=False)  # (its model computed: st.sync())
        data = tpu._device_batches(batches)
        if config.startswith("compile"):
            compiled = st.compile(trainer.step)

            def run(i):
                return compiled(*data[i]).item()

        else:

            def run(i):
                with st.step():
                    loss = trainer.step(*data[i])
                return loss.item()

    import logging  # noqa: PLC0415

    compiles: list = []  # shardtensor's INFO line for each compile of 2 s or more (its op count and time)

    class _Collect(logging.Handler):
        def emit(self, record):
            compiles.append(record.getMessage().split(";")[0])

    logging.getLogger("shardtensor").addHandler(_Collect())
    logging.getLogger("shardtensor").setLevel(logging.INFO)
    out = {"config": config, "steps": [], "programs": [], "compiles": compiles}
    for i in range(steps):
        before = st.counter_value("UncachedCompile") or 0
        t0 = time.perf_counter()
        loss = run(i)
        out["steps"].append(time.perf_counter() - t0)
        out["programs"].append((st.counter_value("UncachedCompile") or 0) - before)
        out["loss"] = loss
    return out


def _spawn(config: str, tiny: bool, steps: int) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", config, "--steps", str(steps)]
    done = subprocess.run(command + (["--tiny"] if tiny else []), capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{config} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny sizes, for a CPU")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=CONFIGS)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(_worker(args.worker, args.tiny, args.steps)), flush=True)
        return
    results = {config: _spawn(config, args.tiny, args.steps) for config in args.configs}
    anchor = results["jax"]["steps"][0] if "jax" in results else None
    print(f"\n== time to the steady step, cold, bench/tpu.py's bf16 GPT{' (tiny)' if args.tiny else ''}, AdamW")
    print(f"{'config':<22} {'step 1 s':>9} {'step 2 s':>9} {'step 3 s':>9} {'1+2 s':>8} {'x JAX 1st':>9}  programs")
    for config, r in results.items():
        s = r["steps"] + [float("nan")] * 3
        startup = s[0] + s[1] if config != "jax" else s[0]
        ratio = f"{startup / anchor:.2f}" if anchor else "-"
        programs = r["programs"] if config != "jax" else "-"
        print(
            f"{config:<22} {s[0]:>9.2f} {s[1]:>9.2f} {s[2]:>9.2f} {startup:>8.2f} {ratio:>9}  {programs}"
            f"  loss {r['loss']:.4f}"
        )
    print("(start-up: steps 1 + 2 for shardtensor, JAX's first call for jax; target: at most 1.3x)")
    for config, r in results.items():
        for line in r.get("compiles", []):
            print(f"  {config}: {line}")


if __name__ == "__main__":
    main()
