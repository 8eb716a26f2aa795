"""Where the chip's time goes: shardtensor's program and JAX's for the same bf16 GPT, each run under
``jax.profiler`` and its device time summed per HLO instruction (issue 36, item 2). Run on the TPU
machine; writes, per part (``forward``, ``step``) and side (``st``, ``jax``), the optimized HLO text
and a JSON of {instruction: [total ns, count]} into ``--out``, and prints the top instructions of each
side and the device time per run. The programs are the ones bench/hlo_compare.py builds (a run's
program: ``graph.capture`` + ``graph.lower``, buffers donated), fed their real inputs (donated ones
copied before each run). On a CPU it runs too (the numbers are the CPU's thunks).

Example::

    source bench/tpu_setup.sh && python3 bench/tpu_profile.py --out $OUT/prof     # bench sizes
    python3 bench/tpu_profile.py --f32 --parts step --out $OUT/prof32              # bench/tpu.py --f32's
    .venv/bin/python bench/tpu_profile.py --tiny --out /tmp/prof                     # on a CPU
    python3 bench/tpu_profile.py --compare --parts step --out $OUT/prof32        # a run's times by kind
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "1")  # one device, like the chip (on a CPU)
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from jax.profiler import ProfileData  # noqa: E402

import hlo_compare  # noqa: E402  (bench/hlo_compare.py: the same model, batch and program)
import shardtensor as st  # noqa: E402
from shardtensor.runtime import x64_scope  # noqa: E402


def device_times(xplane_path):
    """{HLO instruction: [total ns, count]} over the device planes' "XLA Ops" lines (a CPU: every
    event carrying an ``hlo_op`` stat)."""
    totals: dict = collections.defaultdict(lambda: [0.0, 0])
    data = ProfileData.from_file(xplane_path)
    for plane in data.planes:
        on_device = plane.name.startswith("/device:")
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if (on_device and line.name == "XLA Ops") or (not on_device and "hlo_op" in stats):
                    entry = totals[stats.get("hlo_op", event.name)]
                    entry[0] += event.duration_ns
                    entry[1] += 1
    return dict(totals)


def profiled(run, runs, warmup=2):
    """(seconds per run by wall clock, {instruction: [ns, count]} per run) of ``run()`` (which
    blocks until its result is ready)."""
    for _ in range(warmup):
        run()
    t0 = time.perf_counter()
    for _ in range(runs):
        run()
    wall = (time.perf_counter() - t0) / runs
    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder):
        for _ in range(runs):
            run()
    (path,) = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    per_run = {k: [ns / runs, n / runs] for k, (ns, n) in device_times(path).items()}
    return wall, per_run


def st_program(args, part, state, batch):
    """(compiled, run) for shardtensor's program of ``part`` (bench/hlo_compare.py's, the forward with
    its loss)."""
    lowered = hlo_compare.st_lowered(args, part, state, batch, forward_loss=True)
    program = lowered.jitted().program
    with x64_scope():
        compiled = lowered.jitted().lower(*lowered.abstract_arguments()).compile()
    donated = [lowered.arrays[i] for i in program.donated]
    kept = [lowered.arrays[i] for i in program.kept]
    scalars = lowered.scalars

    def run():
        with x64_scope():
            out = compiled([jnp.copy(a) for a in donated], kept, scalars)
        jax.block_until_ready(out)

    return compiled, run


def jax_program(args, part, state, batch):
    import tpu  # the bench's JAX GPT (torch's bf16 numerics) and AdamW

    dtype = jnp.float32 if args.dtype == "f32" else jnp.bfloat16
    params = {k: jnp.asarray(v.float().numpy(), dtype) for k, v in state.items()}
    x, y = (jnp.asarray(t.numpy()) for t in batch)

    def loss_fn(p):
        return tpu.jax_loss(p, x, y, args.heads, args.layers)

    if part == "forward":
        compiled = jax.jit(loss_fn).lower(params).compile()

        def run():
            compiled(params).block_until_ready()

        return compiled, run

    m = {k: jnp.zeros_like(v) for k, v in params.items()}
    v = {k: jnp.zeros_like(a) for k, a in params.items()}
    count = jnp.zeros((), jnp.float32)

    def fn(params, m, v, count):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return (*tpu.jax_adamw(params, grads, m, v, count), loss)

    compiled = jax.jit(fn, donate_argnums=(0, 1, 2, 3)).lower(params, m, v, count).compile()

    def run():
        fresh = jax.tree.map(jnp.copy, (params, m, v, count))
        jax.block_until_ready(compiled(*fresh))

    return compiled, run


def _category(instruction: str) -> str:
    """An instruction's kind for ``compare``: a fusion by its name's stem and kind (XLA names a fusion
    by its first ops: ``multiply_reduce_fusion kOutput``), another op by its opcode; the copies of the
    donated inputs each run makes (``run`` above: ``copy(%args_0_...)``) are the harness's own."""
    if re.match(r"%copy(\.\d+)? = .* copy\(.*%args_0_", instruction):
        return "(harness: donated inputs copied)"
    m = re.match(r"%(\S+?)(\.\d+)? = .*? ([a-z][a-z0-9\-]*)\(", instruction)
    if not m:
        return instruction[:40]
    kind = re.search(r"kind=(k\w+)", instruction)
    return (m.group(1) if m.group(3) == "fusion" else m.group(3)) + (f" {kind.group(1)}" if kind else "")


def compare(folder, part, top=30):
    """Print, from a run's ``--out`` folder, the device time per run of each kind of instruction, side by
    side (shardtensor, JAX, difference), largest differences first, and the totals without the
    harness's copies (what a training step's program costs)."""
    sides = {}
    for side in ("st", "jax"):
        with open(os.path.join(folder, f"{part}_{side}_times.json")) as f:
            times = json.load(f)
        sums: dict = collections.defaultdict(lambda: [0.0, 0.0])
        for instruction, (ns, n) in times.items():
            row = sums[_category(instruction)]
            row[0], row[1] = row[0] + ns / 1e3, row[1] + n
        sides[side] = sums
    st_sums, jax_sums = sides["st"], sides["jax"]
    print(f"== {part}: device us per run by kind      shardtensor (n)       jax (n)     st - jax")
    kinds = sorted(set(st_sums) | set(jax_sums), key=lambda k: -abs(st_sums[k][0] - jax_sums[k][0]))
    for kind in kinds[:top]:
        (a, na), (b, nb) = st_sums[kind], jax_sums[kind]
        print(f"   {kind:38s} {a:9.1f} ({na:4.0f}) {b:9.1f} ({nb:4.0f}) {a - b:+9.1f}")
    harness = "(harness: donated inputs copied)"
    totals = [sum(v[0] for k, v in s.items() if k != harness) for s in (st_sums, jax_sums)]
    gap = totals[0] - totals[1]
    print(f"   {'total without the harness copies':38s} {totals[0]:9.1f}        {totals[1]:9.1f}        {gap:+9.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--compare",
        action="store_true",
        help="run nothing: print the device time by kind of instruction of a finished run's --out folder",
    )
    ap.add_argument("--parts", default="forward,step")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument(
        "--f32",
        action="store_true",
        help="bench/tpu.py --f32's model (float32, d=768, 6 layers, T=512) at torch's 'medium' precision "
        "against JAX's default",
    )
    args = ap.parse_args()
    if args.compare:
        for part in args.parts.split(","):
            if os.path.exists(os.path.join(args.out, f"{part}_st_times.json")):
                compare(args.out, part, args.top)
        return
    args.dtype, args.precision = ("f32", "medium") if args.f32 else ("bf16", "highest")
    sizes = dict(vocab=512, seq=64, d=64, heads=4, layers=2, batch=2) if args.tiny else {}
    full = dict(seq=512, d=768, heads=12, layers=6) if args.f32 else dict(seq=1024, d=1024, heads=16, layers=8)
    sizes = {**dict(vocab=32768, batch=8, **full), **sizes}
    for k, val in sizes.items():
        setattr(args, k, val)
    st.set_checks(False)  # JAX's program has none; the checks' cost is measured elsewhere
    torch.set_float32_matmul_precision(args.precision)
    state, batch = hlo_compare.gpt_inputs(args)
    os.makedirs(args.out, exist_ok=True)
    print(f"{args.dtype} GPT {sizes} on {jax.devices()[0].device_kind}", flush=True)
    for part in args.parts.split(","):
        for side, build in (("jax", jax_program), ("st", st_program)):
            jax_precision = "default" if args.precision == "medium" else args.precision
            with jax.default_matmul_precision(jax_precision):
                compiled, run = build(args, part, state, batch)
            text = compiled.as_text()
            wall, per_run = profiled(run, args.runs)
            with open(os.path.join(args.out, f"{part}_{side}_opt.txt"), "w") as f:
                f.write(text)
            with open(os.path.join(args.out, f"{part}_{side}_times.json"), "w") as f:
                json.dump(per_run, f, indent=0, sort_keys=True)
            device_ms = sum(ns for ns, _ in per_run.values()) / 1e6
            print(f"\n== {part} {side}: wall {wall * 1e3:.2f} ms/run, device ops {device_ms:.2f} ms/run", flush=True)
            for name, (ns, n) in sorted(per_run.items(), key=lambda kv: -kv[1][0])[: args.top]:
                print(f"   {ns / 1e3:10.1f} us  x{n:5.1f}  {name}")
            del compiled, run


if __name__ == "__main__":
    main()
