"""Start-up: the first training steps (trace + compile + run) of bench/train_vs_jax.py's MLP and GPT,
shardtensor against plain JAX, each configuration in a fresh process.

Configurations: plain JAX (``jax.jit``, one program), shardtensor lazy (``st.step()``) and
``st.compile(step)``, each with ``AdamW(capturable=True)`` (step counts on the devices) and without
(on the host), and each with and without ``st.prime_optimizer(opt)`` (the optimizer state created
before step 1, so that step 1 runs the steady program). Every process builds the model on the
devices first (not timed), then times steps 1, 2 and 3 in wall and CPU seconds.

Printed per configuration: the first step's wall and CPU seconds and their ratios to JAX's first step,
step 2 (a second compile shows here), the start-up until the steady program runs (``st.prime_optimizer``
+ steps 1 and 2, wall and CPU, and the CPU ratio to JAX's steps 1 and 2), the programs compiled (or
loaded from a persistent cache: JAX's, or shardtensor's own program cache) during steps 1-2, and where
step 1's time went: recording (the Python of the step: the model, autograd, the optimizer,
shardtensor's dispatch; for ``st.compile`` the traced call), torch's meta kernels (output shapes,
part of recording), tracing the lowerings into a jaxpr (``jax.jit`` of the replay), lowering to
StableHLO, XLA's compile, loading programs from shardtensor's program cache (``graph.program_store``:
no jaxpr, no StableHLO, no XLA), and the rest (running the program and reading the loss back). JAX's
numbers come from JAX's own monitoring events, the same for both.

With ``--cache`` each configuration runs twice more, in two fresh processes sharing a new cache
directory (shardtensor: ``st.initialize_cache``; JAX: its persistent compilation cache, every program
kept): the second process's first step is the warm-cache start-up.

The machine is shared: wall time includes the other processes' load; CPU time (this process, all its
threads) is steadier. The verdict uses wall time when the machine is quiet and says so.

Measured (2 shared cores with a load of 3-5 from other work, 8 simulated devices, 2026-12-05, three
runs each, lowest-highest; the warm-cache first step, ratio to JAX's warm first step in the same run;
"c+cap+prime": compile+cap+prime)::

    warm step 1     MLP cpu     MLP wall    GPT cpu     GPT wall
    JAX's cache only (efb0afc: each program traced, lowered, then looked up in JAX's cache)
    lazy            0.96-1.48   1.15-1.47   0.96-1.03   0.70-1.49
    lazy+prime      1.04-1.09   1.07-1.23   1.08-1.12   1.22-2.06
    compile+cap     1.02-1.17   1.07-1.98   1.05-1.12   0.73-2.50
    c+cap+prime     1.13-1.37   0.84-1.41   1.06-1.28   0.73-1.53
    shardtensor's program cache (each program loaded: nothing traced, lowered or compiled)
    lazy            0.82-0.96   0.99-1.25   0.86-1.07   0.86-1.08
    lazy+prime      0.76-0.94   0.66-1.39   0.87-0.88   0.56-0.87
    compile+cap     0.84-0.98   0.84-1.19   0.87-0.95   0.86-0.99
    c+cap+prime     0.83-1.09   0.68-1.06   0.85-0.96   0.82-1.06

JAX's warm first step: MLP 0.32-0.36 s, GPT 2.1-2.3 s of CPU (most of it running the step; the wall
times moved with the load, 1.4-3.4 s for GPT). Loading a program (the load column) takes 0.03-0.13 s
for the MLP, 0.3-0.7 s for the GPT's, mostly XLA deserializing it, as JAX's own cache does. Cold starts
are unchanged (storing a program costs 0.01-0.08 s; GPT step 1 0.83-1.04x JAX's in CPU time).

Usage::

    python bench/startup.py                        # both models, every configuration
    python bench/startup.py --model gpt --cache    # GPT only, plus warm-cache start-up
    python bench/startup.py --model mlp --configs jax lazy compile+cap
    SHARDTENSOR_PLATFORM=tpu python bench/startup.py --model gpt --configs lazy compile+cap --cache --warm-only
                                                   # on a chip: its own devices, warm-cache table only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = [
    "jax",
    "lazy",
    "lazy+prime",
    "lazy+cap",
    "lazy+cap+prime",
    "compile",
    "compile+prime",
    "compile+cap",
    "compile+cap+prime",
]
# one step's time, split by what it spent it on (seconds)
PARTS = ["record", "meta", "jaxpr", "stablehlo", "xla", "load", "rest", "gc"]


# ---- one configuration, in its own process ----------------------------------------------------


class _JaxEvents:
    """Seconds JAX spent tracing jaxprs, lowering to StableHLO and compiling (or hashing the program
    and loading it from the persistent cache), how many programs it compiled or loaded, and how many
    of those it loaded, from JAX's monitoring events."""

    def __init__(self):
        from jax import monitoring

        self.seconds = {"jaxpr": 0.0, "stablehlo": 0.0, "xla": 0.0}
        self.compiled = self.loaded = 0
        monitoring.register_event_listener(self._event)
        monitoring.register_event_duration_secs_listener(self._duration)

    def _event(self, event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            self.loaded += 1

    def _duration(self, event, seconds, **_):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            self.seconds["jaxpr"] += seconds
        elif event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            self.seconds["stablehlo"] += seconds
        elif event == "/jax/core/compile/backend_compile_duration":  # (a cache hit included)
            self.seconds["xla"] += seconds
            self.compiled += 1

    def snapshot(self):
        return dict(self.seconds), self.compiled, self.loaded


def _time_garbage_collection():
    """Time Python's garbage collections (a full one, in a process holding torch and jax, can take
    half a second wherever it falls: recording, lowering, JAX's trace); returns the running total."""
    import gc

    total, start = [0.0], [0.0]

    def callback(phase, info):
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            total[0] += time.perf_counter() - start[0]

    gc.callbacks.append(callback)
    return total


def _time_meta_kernels():
    """Wrap torch's meta kernels as the dispatch layer calls them; returns the running total (a list
    of one float, seconds)."""
    from shardtensor.dispatch import entry, meta, mutation, record

    total = [0.0]
    original = meta.meta_outputs

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t0

    for module in (entry, mutation, record):
        module.meta_outputs = timed  # type: ignore[attr-defined]
    return total


def _time_program_loads():
    """Time the loads from shardtensor's program cache (``graph.program_store``); returns the running
    total (seconds) and the count of programs loaded."""
    from shardtensor.graph import program_store

    total = [0.0, 0]
    original = program_store.Entry.load

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            loaded = original(self, *args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t0
        total[1] += loaded is not None
        return loaded

    program_store.Entry.load = timed  # type: ignore[method-assign]
    return total


def _lazy_tracing() -> float:
    """Seconds in shardtensor's ``LazyTracing`` metric so far (the Python time of building graphs)."""
    import shardtensor as st

    data = st.metric_data("LazyTracing")
    return data[1] / 1e9 if data else 0.0


def worker(kind: str, config: str, steps: int, cache_dir: str | None) -> dict:
    sys.path.insert(0, HERE)
    on_cpu = os.environ.get("SHARDTENSOR_PLATFORM", "cpu") == "cpu"
    if on_cpu:  # 8 simulated devices; on an accelerator, its own devices
        os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    import jax
    import torch

    import shardtensor as st
    import train_vs_jax as tvj

    if cache_dir:
        if config == "jax":  # every program kept, as st.initialize_cache does
            jax.config.update("jax_compilation_cache_dir", cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        else:
            st.initialize_cache(cache_dir)
    events = _JaxEvents()
    meta_seconds = _time_meta_kernels()
    gc_seconds = _time_garbage_collection()
    loads = _time_program_loads()
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in (tvj.MLP() if kind == "mlp" else tvj.GPT()).state_dict().items()}
    n = jax.device_count()  # (8 simulated CPU devices unless the caller set another count)
    mesh = st.Mesh(range(n), (n,), ("fsdp",))
    batches = tvj.make_batches(kind, steps)
    flags_ = set(config.split("+")[1:])
    if config == "jax":
        run = tvj.JaxRun(kind, state, mesh.get_jax_mesh())
    else:
        run = tvj.ShardtensorRun(kind, state, mesh, compiled=config.startswith("compile"), capturable="cap" in flags_)
    jax.effects_barrier()
    prime_seconds = prime_cpu = 0.0
    if "prime" in flags_:
        c0, t0 = time.process_time(), time.perf_counter()
        st.prime_optimizer(run.opt)
        prime_seconds, prime_cpu = time.perf_counter() - t0, time.process_time() - c0
    out: dict = {"kind": kind, "config": config, "steps": [], "prime": prime_seconds, "prime_cpu": prime_cpu}
    uncached = 0
    for x, y in batches:
        before, compiled0, loaded0 = events.snapshot()
        meta0, gc0, load0, loaded0_st = meta_seconds[0], gc_seconds[0], loads[0], loads[1]
        if config != "jax":
            uncached = st.counter_value("UncachedCompile") or 0
        tracing0 = _lazy_tracing() if config != "jax" else 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        loss = run(x, y)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        after, compiled1, loaded1 = events.snapshot()
        parts = {k: after[k] - before[k] for k in after}
        parts["meta"] = meta_seconds[0] - meta0
        parts["gc"] = gc_seconds[0] - gc0
        parts["load"] = loads[0] - load0
        # recording: the wall time from the step's first op to the start of its program's build
        parts["record"] = _lazy_tracing() - tracing0 if config != "jax" else 0.0
        parts["rest"] = max(0.0, wall - sum(parts[k] for k in ("record", "jaxpr", "stablehlo", "xla", "load")))
        out["steps"].append(
            {
                "wall": wall,
                "cpu": cpu,
                "loss": loss,
                "parts": parts,
                "compiled": compiled1 - compiled0 + loads[1] - loaded0_st,  # (by XLA, or loaded by shardtensor)
                "loaded": loaded1 - loaded0,
                "programs": (st.counter_value("UncachedCompile") or 0) - uncached if config != "jax" else None,
            }
        )
    return out


# ---- the driver: fresh processes, one table --------------------------------------------------


def _spawn(kind, config, steps, cache_dir=None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, config, "--steps", str(steps)]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    env = dict(os.environ)  # the shardtensor beside this bench, not another installed one
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(HERE), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    print(
        f"  ({kind} {config}{' (cache)' if cache_dir else ''}: process took {time.perf_counter() - t0:.0f} s)",
        file=sys.stderr,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} {config} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def _startup(r, key):
    """Seconds until the steady program runs: priming (if any) + steps 1 and 2."""
    return r["prime" if key == "wall" else "prime_cpu"] + r["steps"][0][key] + r["steps"][1][key]


def _row(name, r, jax_run):
    s1, s2 = r["steps"][0], r["steps"][1]
    j1 = jax_run["steps"][0]
    p = s1["parts"]
    programs = s1["compiled"] + s2["compiled"]  # (compiled or loaded)
    return (
        f"{name:18s} {s1['wall']:6.2f} {s1['wall'] / j1['wall']:5.2f}x {s1['cpu']:6.2f} {s1['cpu'] / j1['cpu']:5.2f}x "
        f"{s2['wall']:6.2f} {_startup(r, 'wall'):6.2f} {_startup(r, 'cpu'):6.2f} "
        f"{_startup(r, 'cpu') / _startup(jax_run, 'cpu'):5.2f}x {programs:4d}  "
        + " ".join(f"{p[k]:5.2f}" for k in PARTS)
    )


def _header(title):
    print(f"\n== {title}")
    print(
        f"{'':18s} {'step 1':>6s} {'xJAX':>6s} {'cpu 1':>6s} {'xJAX':>6s} {'step 2':>6s} {'1+2':>6s} {'cpu1+2':>6s} "
        f"{'xJAX':>6s} {'prog':>4s}  " + " ".join(f"{k:>5s}" for k in PARTS)
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["mlp", "gpt", "both"], default="both")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=CONFIGS)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cache", action="store_true", help="also the warm-cache start-up (two more processes each)")
    ap.add_argument("--warm-only", action="store_true", help="with --cache: only the warm-cache table")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], a.worker[1], a.steps, a.cache_dir)))
        return
    configs = ["jax"] + [c for c in a.configs if c != "jax"]
    print(
        "seconds; step 1 = trace + compile + run of the first step; prog = programs compiled (or loaded) "
        "in steps 1-2; parts of step 1: " + ", ".join(PARTS)
    )
    for kind in ["mlp", "gpt"] if a.model == "both" else [a.model]:
        if not (a.cache and a.warm_only):
            results = {c: _spawn(kind, c, a.steps) for c in configs}
            _header(f"{kind}: first steps, fresh processes, AdamW")
            for c in configs:
                print(_row(c, results[c], results["jax"]))
            losses = {c: round(r["steps"][1]["loss"], 5) for c, r in results.items()}
            print("step-2 losses:", losses)
        if a.cache:
            warm = {}
            for c in configs:
                with tempfile.TemporaryDirectory(prefix="st_startup_cache_") as d:
                    _spawn(kind, c, 2, d)  # fills the cache
                    warm[c] = _spawn(kind, c, 2, d)
            _header(f"{kind}: warm persistent cache (second process)")
            for c in configs:
                print(_row(c, warm[c], warm["jax"]))


if __name__ == "__main__":
    main()
