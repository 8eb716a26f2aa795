"""FSDPv2 GPT training step: shardtensor (lazy and ``st.compile``) against the same model in plain JAX,
and the peak memory per device with and without ``checkpoint_module``.

The model is ``bench/train_vs_jax.py``'s GPT (vocab 1024, 128 tokens, d=256, 4 heads, 4 blocks) and
its plain-JAX twin, trained with AdamW on batches of 16 sequences on 8 simulated devices, mesh (8, 1)
``('fsdp', 'model')``:

* shardtensor: ``FSDPv2(model, auto_wrap_policy=transformer_auto_wrap_policy({Block}))`` — every
  parameter sharded over ``'fsdp'`` on its largest dimension, each block's output on its batch
  dimension — stepped lazily (one program per step at ``st.step()``) and through ``st.compile``,
  and lazily with ``checkpoint_module`` on each block (what recomputing costs);
* JAX: the same parameters with the same shardings (``'fsdp'`` on the largest dimension), the batch
  over ``'fsdp'``, one ``jax.jit`` with donated state.

The four run interleaved in one process (same weights, same batches), so the machine's load affects
them alike. Printed: median step time and its ratio to JAX, the first step, the losses (they must
agree), and the collectives of each compiled program. Then the peak bytes per device of one steady
training step (XLA's ``memory_analysis()`` of the compiled program, read as ``bench/fsdp_memory.py``
does), for FSDPv2 without and with ``checkpoint_module`` on each block, and for the JAX program
without and with ``jax.checkpoint`` on each block.

Example::

    .venv/bin/python bench/fsdp.py                 # 20 steps
    .venv/bin/python bench/fsdp.py --steps 8 --skip-memory
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (the first two are warm-up)")
    p.add_argument("--skip-memory", action="store_true", help="only the step times")
    args = p.parse_args()
    if args.steps < 3:
        p.error("--steps must be at least 3 (two warm-up steps, then timed ones)")
    return args


ARGS = parse()
os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")

import fsdp_memory  # noqa: E402  (compiled_step, memory_mib)
import train_vs_jax as tvj  # noqa: E402  (the GPT, its JAX twin, JaxRun, ProgramSpy, collectives)

# isort: split

import jax  # noqa: E402
import torch  # noqa: E402

import shardtensor as st  # noqa: E402
from shardtensor.fsdp import FSDPv2, checkpoint_module, transformer_auto_wrap_policy  # noqa: E402


def fsdp_gpt(state_dict, mesh, checkpointed=False):
    """train_vs_jax's GPT with ``state_dict``, each Block auto-wrapped in FSDPv2 (and checkpointed)."""
    model = tvj.GPT()
    model.load_state_dict(state_dict)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={tvj.Block})
    wrapper = (lambda m, *a, **kw: FSDPv2(checkpoint_module(m), *a, **kw)) if checkpointed else None
    return FSDPv2(model, mesh=mesh, auto_wrap_policy=policy, auto_wrapper_callable=wrapper)


def fsdp_run(state_dict, mesh, compiled, checkpointed=False):
    """train_vs_jax's training step (lazy or ``st.compile``d) on the FSDPv2 GPT."""
    return tvj.ShardtensorRun("gpt", state_dict, mesh, compiled, model=fsdp_gpt(state_dict, mesh, checkpointed))


def memory_of_step(state_dict, mesh, batches, checkpointed):
    """Memory (MiB per device) of the second (steady) lazy training step, and the first loss."""
    run = fsdp_run(state_dict, mesh, compiled=False, checkpointed=checkpointed)
    first = run(*batches[0])  # creates AdamW's state
    pending = run.record_step(*run.shard_batch(*batches[1]))  # recorded, not run yet
    memory = fsdp_memory.memory_mib(fsdp_memory.compiled_step())  # the pending graph, as sync() compiles it
    st.sync()
    del pending
    return memory, first


def main():
    mesh = st.Mesh(range(8), (8, 1), ("fsdp", "model"))
    jmesh = mesh.get_jax_mesh()
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in tvj.GPT().state_dict().items()}
    batches = tvj.make_batches("gpt", ARGS.steps)
    print(
        f"jax {jax.__version__}, torch {torch.__version__}, {len(jax.devices())} {jax.devices()[0].platform} "
        f"devices; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )
    print(
        f"\n== FSDPv2 GPT (vocab 1024, 128 tokens, d=256, 4 blocks; {sum(v.numel() for v in state.values()):,} "
        f"parameters), batch 16, mesh (8, 1) ('fsdp', 'model'), AdamW, {ARGS.steps} steps"
    )

    runs = {
        "lazy": fsdp_run(state, mesh, compiled=False),
        "compile": fsdp_run(state, mesh, compiled=True),
        "ckpt": fsdp_run(state, mesh, compiled=False, checkpointed=True),  # the cost of recomputing
        "jax": tvj.JaxRun("gpt", state, jmesh),
    }
    times = {k: [] for k in runs}
    losses = {k: [] for k in runs}
    spies = {}
    for i, (x, y) in enumerate(batches):
        for name, run in runs.items():  # interleaved
            spy = tvj.ProgramSpy() if name != "jax" and i == 1 else None
            t0 = time.perf_counter()
            if spy:
                with spy:
                    loss = run(x, y)
                spies[name] = spy
            else:
                loss = run(x, y)
            times[name].append(time.perf_counter() - t0)
            losses[name].append(loss)
    med = {k: statistics.median(v[2:]) for k, v in times.items()}
    print(f"{'':26s} {'median step':>12s} {'x JAX':>7s} {'first step':>11s}")
    for name in runs:
        label = {
            "lazy": "FSDPv2 lazy",
            "compile": "FSDPv2 compile",
            "ckpt": "FSDPv2 lazy + checkpoint",
            "jax": "jax.jit",
        }[name]
        print(f"{label:26s} {med[name] * 1e3:10.1f}ms {med[name] / med['jax']:7.2f} {times[name][0]:10.2f}s")
    print("losses (first 3):", {k: [round(v, 5) for v in run[:3]] for k, run in losses.items()})
    print(
        "max |loss - JAX loss|:",
        {k: f"{max(abs(a - b) for a, b in zip(run, losses['jax'])):.2e}" for k, run in losses.items() if k != "jax"},
    )
    x, y = batches[-1]
    print("collectives (count, per-device result bytes):")
    print(f"  jax      {tvj.describe(tvj.collectives(runs['jax'].hlo(x, y)))}")
    for name, spy in spies.items():
        print(f"  {name:8s} {tvj.describe(tvj.collectives(spy.hlo()))}")

    if ARGS.skip_memory:
        return 0
    print("\n== peak memory per device of one steady training step (MiB)")
    print(f"{'':34s} {'temp':>7s} {'args':>7s} {'out':>7s} {'alias':>7s} {'peak':>7s} {'1st loss':>9s}")
    rows = {}
    for checkpointed in (False, True):
        r, first = memory_of_step(state, mesh, batches, checkpointed)
        rows["FSDPv2 + checkpoint_module" if checkpointed else "FSDPv2"] = r
        first_loss = f"{first:9.5f}"
    for remat in (False, True):
        jrun = tvj.JaxRun("gpt", state, jmesh, remat=remat)
        xb, yb = jrun._batch(x, y)
        compiled = jrun.jitted.lower(jrun.params, jrun.m, jrun.v, jrun.count, xb, yb).compile()
        rows["jax.jit + jax.checkpoint" if remat else "jax.jit"] = fsdp_memory.memory_mib(compiled)
    for label, r in rows.items():
        print(
            f"{label:34s} {r['temp']:7.2f} {r['args']:7.2f} {r['out']:7.2f} {r['alias']:7.2f} "
            f"{r['peak']:7.2f} {first_loss if label.startswith('FSDPv2') else '':>9s}"
        )
    for ours, theirs in (("FSDPv2", "jax.jit"), ("FSDPv2 + checkpoint_module", "jax.jit + jax.checkpoint")):
        print(f"{ours}: peak {rows[ours]['peak'] / rows[theirs]['peak']:.2f}x {theirs}'s")
    for a, b in (("FSDPv2", "FSDPv2 + checkpoint_module"), ("jax.jit", "jax.jit + jax.checkpoint")):
        print(
            f"checkpointing, {a}: peak {100 * (rows[b]['peak'] / rows[a]['peak'] - 1):+.0f}%, "
            f"temporaries {100 * (rows[b]['temp'] / rows[a]['temp'] - 1):+.0f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
