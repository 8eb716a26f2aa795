"""Where a loop's wall time goes on the device: the programs it ran, their device time and the chip's
idle time between them (issue 36: the float32 step's gap that the per-instruction profile did not
show). ``traced(fn)`` runs ``fn()`` under ``jax.profiler`` (Python tracing off, so the host keeps its
speed) and ``summary(path)`` reads the trace back: per program (XLA module), how many runs, their
mean span and the device time of their ops, and the idle time between runs.

On a TPU the device plane has an "XLA Modules" line (one event per program run) and an "XLA Ops"
line; on a CPU the op events carry ``hlo_module`` and ``run_id`` and a run's span is that of its ops.

Example::

    path = timeline.traced(lambda: [step() for _ in range(6)] and read())
    print(timeline.summary(path))
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile

import jax
from jax.profiler import ProfileData


def traced(fn):
    """Run ``fn()`` under the profiler (no Python tracer); return the trace's ``.xplane.pb`` path."""
    folder = tempfile.mkdtemp()
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 1
    with jax.profiler.trace(folder, profiler_options=options):
        fn()
    (path,) = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    return path


def _runs(path):
    """[(start ns, end ns, module name, busy ns)] of every program run on device 0, by start."""
    data = ProfileData.from_file(path)
    modules, ops = [], []
    cpu_runs: dict = collections.defaultdict(lambda: [None, None, "", 0.0])
    for plane in data.planes:
        if plane.name.startswith("/device:") and not plane.name.endswith((":1", ":2", ":3")):
            for line in plane.lines:
                if line.name == "XLA Modules":
                    modules += [(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events]
                elif line.name == "XLA Ops":
                    ops += [(e.start_ns, e.duration_ns) for e in line.events]
        elif plane.name == "/host:CPU":
            for line in plane.lines:
                for e in line.events:
                    stats = dict(e.stats)
                    if "hlo_op" not in stats or stats.get("device_ordinal", 0) != 0:
                        continue
                    run = cpu_runs[(stats.get("hlo_module"), stats.get("run_id"))]
                    run[0] = e.start_ns if run[0] is None else min(run[0], e.start_ns)
                    run[1] = max(run[1] or 0, e.start_ns + e.duration_ns)
                    run[2] = stats.get("hlo_module", "?")
                    run[3] += e.duration_ns
    if modules:
        ops.sort()
        out, i = [], 0
        for start, end, name in sorted(modules):
            busy = 0.0
            while i < len(ops) and ops[i][0] < end:
                if ops[i][0] >= start:
                    busy += ops[i][1]
                i += 1
            out.append((start, end, name, busy))
        return out
    return sorted(tuple(r) for r in cpu_runs.values())


def summary(path, steps=None):
    """Text: per program its runs, mean span and device busy time; the idle time between runs; per step
    (``steps`` given) the wall on the device (first start to last end over steps)."""
    runs = _runs(path)
    if not runs:
        return "  (no device events in the trace)"
    lines = []
    by_name: dict = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for start, end, name, busy in runs:
        entry = by_name[name.split("(")[0]]
        entry[0] += 1
        entry[1] += end - start
        entry[2] += busy
    window = runs[-1][1] - runs[0][0]
    idle = sum(max(0.0, b[0] - a[1]) for a, b in zip(runs, runs[1:]))
    ms = 1e6 * (steps or 1)  # ns -> ms per step
    spans, op_time = sum(e - s for s, e, _, _ in runs), sum(r[3] for r in runs)
    lines.append(
        f"  device window {window / 1e6:.2f} ms, {len(runs)} program runs; per step: window {window / ms:.3f} ms, "
        f"spans {spans / ms:.3f}, op time {op_time / ms:.3f}, idle between runs {idle / ms:.3f} ms"
    )
    for name, (n, span, busy) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"    {n:4d} x {name[:60]:60s} span {span / n / 1e3:9.1f} us  ops {busy / n / 1e3:9.1f} us")
    gaps = sorted(((b[0] - a[1], a[2], b[2]) for a, b in zip(runs, runs[1:])), reverse=True)[:5]
    for gap, before, after in gaps:
        first, then = before.split("(")[0][:40], after.split("(")[0][:40]
        lines.append(f"    gap {gap / 1e3:9.1f} us  after {first} before {then}")
    return "\n".join(lines)
