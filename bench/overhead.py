"""Per-op overhead of shardtensor's three execution modes, beside plain torch and plain JAX.

For a small tensor (64x64 float32 by default) on a (4, 2) mesh, sharded ('x', None), it times a chain
of elementwise ops (add, mul, tanh, mul by a Python scalar, repeated; 200 ops by default):

  torch eager         plain torch on CPU tensors                       (reference)
  jax eager           the same jnp ops on the same sharded jax.Arrays  (reference)
  lazy record         shardtensor's default mode: recording the chain, steady state (second step
                      onwards; the sync that follows each step is not in this number)
  lazy record (cpu)   the same, as CPU time (time.process_time), best step: steadier on a busy machine
  dispatch floor      the chain on a trivial tensor subclass whose __torch_dispatch__ returns at once
                      (the floor of any Python subclass), wall median and CPU best
  lazy step           recording + sync + waiting for the result, per op, steady state (informative)
  eager               shardtensor eager mode (st.eager_mode(True))
  compile call        a call of st.compile(chain) against a call of jax.jit(chain) on the same
                      sharded inputs, per call (not per op), calls back to back; the difference is
                      shardtensor's overhead. This chain is short (4 ops by default, --compile-ops)
                      so that running the program does not hide the cost of calling it

Targets (issue 2, section 8): lazy recording <= 20 us/op, eager <= 30 us/op, a compiled call
<= 100 us beyond jax.jit's own call; issue 16: lazy recording <= 8 us/op (CPU time).

JAX's per-op dispatch grows with the number of devices (about 75 us over 8 simulated CPU devices on 2
cores, about 3 us on one device), so `--devices all` runs the benchmark once with 8 devices and once
with 1, each in its own process (the device count must be fixed before jax is imported).

Usage::

    python bench/overhead.py                 # 8 simulated CPU devices
    python bench/overhead.py --devices 1
    python bench/overhead.py --devices all   # both tables
    python bench/overhead.py --ops 400 --shape 128 128

It uses only shardtensor's public API.
"""

from __future__ import annotations

import os

# Before anything imports jax.
os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ALL_DEVICE_COUNTS = (8, 1)

TARGETS_US = {"lazy record": 20.0, "lazy record (cpu)": 8.0, "eager": 30.0, "compile overhead": 100.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--devices",
        default=None,
        help="number of simulated CPU devices, or 'all' for one run per count in "
        f"{ALL_DEVICE_COUNTS} (default: $SHARDTENSOR_CPU_DEVICES, else 8)",
    )
    p.add_argument("--ops", type=int, default=200, help="elementwise ops per chain (default 200)")
    p.add_argument("--shape", type=int, nargs=2, default=(64, 64), metavar=("ROWS", "COLS"))
    p.add_argument("--steps", type=int, default=12, help="lazy steps; the first is not timed (default 12)")
    p.add_argument(
        "--reps", type=int, default=7, help="repetitions of each eager chain; the median is reported (default 7)"
    )
    p.add_argument("--calls", type=int, default=100, help="compiled calls per repetition (default 100)")
    p.add_argument("--compile-ops", type=int, default=4, help="elementwise ops in the compiled program (default 4)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- re-exec per count


def _run_all(argv):
    """One subprocess per device count, each with the environment set before jax starts."""
    rest = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--devices":
            skip = True
            continue
        if a.startswith("--devices="):
            continue
        rest.append(a)
    rc = 0
    for n in ALL_DEVICE_COUNTS:
        sys.stdout.flush()
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--devices", str(n), *rest])
        if r.returncode != 0:
            print(f"[overhead] the run with {n} device(s) exited with {r.returncode}", file=sys.stderr)
            rc = rc or r.returncode
        print()
    return rc


def _set_device_count(n: int) -> None:
    """Ask for n simulated CPU devices. Must run before jax is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("the device count must be set before jax is imported")
    os.environ["SHARDTENSOR_CPU_DEVICES"] = str(n)
    # A count forced through XLA_FLAGS (as tests/conftest.py does) would contradict ours.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()
    if flags:
        os.environ["XLA_FLAGS"] = flags
    else:
        os.environ.pop("XLA_FLAGS", None)


# ----------------------------------------------------------------------------- the program


def torch_chain(y, b, n_ops):
    """n_ops elementwise ops on torch tensors (plain or ShardedTensor)."""
    import torch

    for i in range(n_ops):
        k = i % 4
        if k == 0:
            y = y + b
        elif k == 1:
            y = y * b
        elif k == 2:
            y = torch.tanh(y)
        else:
            y = y * 0.5
    return y


def jax_chain(y, b, n_ops):
    """The same program in jax.numpy."""
    import jax.numpy as jnp

    for i in range(n_ops):
        k = i % 4
        if k == 0:
            y = y + b
        elif k == 1:
            y = y * b
        elif k == 2:
            y = jnp.tanh(y)
        else:
            y = y * 0.5
    return y


# ----------------------------------------------------------------------------- timing helpers


def _median(xs):
    return statistics.median(xs)


@contextlib.contextmanager
def _eager(st):
    """Eager mode for the block, whether st.eager_mode(True) returns a context manager or not."""
    cm = st.eager_mode(True)
    if hasattr(cm, "__enter__"):
        with cm:
            yield
    else:
        try:
            yield
        finally:
            st.eager_mode(False)


def _check(name, got, want, notes):
    """Sanity: the benchmarked program must compute what torch computes."""
    import torch

    got = torch.as_tensor(got).float()
    diff = (got - want).abs().max().item()
    if not (diff <= 1e-3 * (1 + want.abs().max().item())):
        notes.append(f"WARNING: {name} differs from torch eager (max abs diff {diff:.3g})")


def bench_torch(ta, tb, args):
    torch_chain(ta, tb, args.ops)  # warm-up
    ts = []
    for _ in range(max(args.reps, 20)):
        t0 = time.perf_counter()
        torch_chain(ta, tb, args.ops)
        ts.append(time.perf_counter() - t0)
    return _median(ts) / args.ops


def bench_jax_eager(ja, jb, args):
    import jax
    import numpy as np

    np.asarray(jax_chain(ja, jb, args.ops))  # warm-up: compiles each primitive once
    ts = []
    for _ in range(args.reps):
        gc.collect()
        t0 = time.perf_counter()
        y = jax_chain(ja, jb, args.ops)
        jax.block_until_ready(y)
        np.asarray(y)  # same host transfer as the shardtensor eager run
        ts.append(time.perf_counter() - t0)
    return _median(ts) / args.ops


def _floor_class():
    import torch

    class Floor(torch.Tensor):
        """The cheapest subclass with a Python __torch_dispatch__: every op returns its first argument."""

        @staticmethod
        def __new__(cls, t):
            return torch.Tensor._make_wrapper_subclass(cls, t.shape, dtype=t.dtype, device=t.device)

        __torch_function__ = torch._C._disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return args[0]

    return Floor


def bench_floor(ta, tb, args):
    """(wall median, CPU best) per op of the chain on a subclass that does nothing: the floor."""
    floor = _floor_class()
    fa, fb = floor(ta), floor(tb)
    torch_chain(fa, fb, args.ops)
    wall, cpu = [], []
    gc.collect()
    for _ in range(max(args.steps, 20)):  # (no gc.collect() per step: see bench_lazy)
        c0, t0 = time.process_time(), time.perf_counter()
        torch_chain(fa, fb, args.ops)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return _median(wall) / args.ops, min(cpu) / args.ops


def bench_lazy(st, a, b, args, want, notes):
    record, step, cpu = [], [], []
    y = None
    gc.collect()
    # No gc.collect() per step, as in a user's loop: a full collection also empties Python's free
    # lists, and the chain recorded next pays to refill them (1-2 us per op here, the floor's too).
    for i in range(args.steps):
        c0, t0 = time.process_time(), time.perf_counter()
        y = torch_chain(a, b, args.ops)
        t1, c1 = time.perf_counter(), time.process_time()
        st.sync(wait=True)
        y.cpu()  # the value is there: no new graph, no compile
        t2 = time.perf_counter()
        if i >= 1:  # steady state: the graph is cached and its metadata memoised
            record.append(t1 - t0)
            step.append(t2 - t0)
            cpu.append(c1 - c0)
        else:
            first_step = t2 - t0
    _check("lazy", y.cpu(), want, notes)
    return _median(record) / args.ops, _median(step) / args.ops, first_step, min(cpu) / args.ops


def bench_eager(st, a, b, args, want, notes):
    with _eager(st):
        y = torch_chain(a, b, args.ops)  # warm-up: compiles each op once
        _check("eager", y.cpu(), want, notes)
        ts = []
        for _ in range(args.reps):
            gc.collect()
            t0 = time.perf_counter()
            y = torch_chain(a, b, args.ops)
            y.cpu()  # waits for the last op; one 64x64 transfer, amortised over the chain
            ts.append(time.perf_counter() - t0)
    return _median(ts) / args.ops


def bench_compile(st, a, b, ja, jb, args, torch_inputs, notes):
    import jax
    import numpy as np

    n_ops = args.compile_ops
    want = torch_chain(*torch_inputs, n_ops)

    def chain(x, w):
        return torch_chain(x, w, n_ops)

    f = st.compile(chain)
    jf = jax.jit(lambda x, w: jax_chain(x, w, n_ops))

    t0 = time.perf_counter()
    y = f(a, b)
    _check("compile", y.cpu(), want, notes)
    first_call = time.perf_counter() - t0
    for _ in range(3):
        f(a, b).cpu()
    np.asarray(jf(ja, jb))
    for _ in range(3):
        np.asarray(jf(ja, jb))

    st_t, jax_t = [], []
    for _ in range(args.reps):  # interleaved, so both see the same machine
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            y = f(a, b)
        y.cpu()
        st_t.append((time.perf_counter() - t0) / args.calls)

        gc.collect()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            jy = jf(ja, jb)
        np.asarray(jy)
        jax_t.append((time.perf_counter() - t0) / args.calls)
    return _median(st_t), _median(jax_t), first_call


# ----------------------------------------------------------------------------- one run


def run(args):
    import shardtensor as st  # first: it sets jax up (platform, device count) before jax starts
    # isort: split

    import jax
    import numpy as np
    import torch

    n = st.global_runtime_device_count()  # starts the runtime (and jax) with shardtensor's settings
    attrs = st.global_runtime_device_attributes()
    platform = attrs[0]["platform"] if attrs else "?"
    mesh_shape = (n // 2, 2) if n >= 4 and n % 2 == 0 else (n, 1)  # (4, 2) for 8 devices
    mesh = st.Mesh(range(n), mesh_shape, ("x", "y"))
    spec = ("x", None)
    if args.shape[0] % mesh_shape[0]:
        # shardtensor pads uneven shards, but plain JAX (the reference here) refuses them.
        sys.exit(
            f"--shape: {args.shape[0]} rows do not divide over the {mesh_shape[0]} devices of "
            f"mesh axis 'x' (mesh {mesh_shape}); plain JAX needs an even split"
        )

    torch.manual_seed(0)
    ta = torch.randn(*args.shape)
    tb = torch.randn(*args.shape)
    want = torch_chain(ta, tb, args.ops)

    # The same placement in plain JAX: devices in shardtensor's global order, auto axis types.
    from jax.sharding import NamedSharding, PartitionSpec

    jdevs = np.array(jax.devices(platform) if platform != "?" else jax.devices())[:n]
    mesh_kwargs = {}
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is not None:
        mesh_kwargs["axis_types"] = (axis_type.Auto,) * 2
    jmesh = jax.sharding.Mesh(jdevs.reshape(mesh_shape), ("x", "y"), **mesh_kwargs)
    jsharding = NamedSharding(jmesh, PartitionSpec(*spec))
    ja = jax.device_put(ta.numpy(), jsharding)
    jb = jax.device_put(tb.numpy(), jsharding)

    a = st.shard(ta, mesh, spec)
    b = st.shard(tb, mesh, spec)

    notes = []
    torch_us = bench_torch(ta, tb, args) * 1e6
    jax_us = bench_jax_eager(ja, jb, args) * 1e6
    floor_wall, floor_cpu = bench_floor(ta, tb, args)
    lazy_rec, lazy_step, lazy_first, lazy_cpu = bench_lazy(st, a, b, args, want, notes)
    eager_s = bench_eager(st, a, b, args, want, notes)
    comp_s, jit_s, comp_first = bench_compile(st, a, b, ja, jb, args, (ta, tb), notes)
    lazy_rec_us, lazy_step_us, eager_us = lazy_rec * 1e6, lazy_step * 1e6, eager_s * 1e6
    comp_us, jit_us = comp_s * 1e6, jit_s * 1e6
    overhead_us = comp_us - jit_us

    def verdict(value, target):
        return "ok" if value <= target else "MISS"

    print(
        f"shardtensor overhead — torch {torch.__version__}, jax {jax.__version__}, platform "
        f"{platform}, {n} device(s), mesh {mesh_shape} ('x', 'y'), "
        f"tensor {tuple(args.shape)} float32 sharded {spec}, {args.ops} elementwise ops per chain"
    )
    print()
    w = 14
    print(f"{'mode':<18}{'us/op':>{w}}{'x torch':>{w}}{'x jax eager':>{w}}{'target':>{w}}")
    print("-" * (18 + 4 * w))

    def row(name, us, target=None):
        t = "" if target is None else f"<= {target:g} {verdict(us, target)}"
        print(f"{name:<18}{us:>{w}.2f}{us / torch_us:>{w}.2f}{us / jax_us:>{w}.2f}{t:>{w}}")

    row("torch eager", torch_us)
    row("jax eager", jax_us)
    row("dispatch floor", floor_wall * 1e6)
    row("floor (cpu)", floor_cpu * 1e6)
    row("lazy record", lazy_rec_us, TARGETS_US["lazy record"])
    row("lazy record (cpu)", lazy_cpu * 1e6, TARGETS_US["lazy record (cpu)"])
    row("lazy step", lazy_step_us)
    row("eager", eager_us, TARGETS_US["eager"])
    print()
    print(f"compiled call of a {args.compile_ops}-op program, back to back:")
    print(f"{'compiled call':<16}{'us/call':>{w}}{'x jax.jit':>{w}}{'overhead us':>{w}}{'target':>{w}}")
    print("-" * (16 + 4 * w))
    print(f"{'jax.jit':<16}{jit_us:>{w}.1f}{1.0:>{w}.2f}{'':>{w}}")
    t = f"<= {TARGETS_US['compile overhead']:g} {verdict(overhead_us, TARGETS_US['compile overhead'])}"
    print(f"{'st.compile':<16}{comp_us:>{w}.1f}{comp_us / jit_us:>{w}.2f}{overhead_us:>{w}.1f}{t:>{w}}")
    print()
    print(
        f"lazy record above the dispatch floor: {lazy_rec_us - floor_wall * 1e6:.2f} us/op (wall median), "
        f"{(lazy_cpu - floor_cpu) * 1e6:.2f} us/op (cpu best)"
    )
    print(
        f"first lazy step (record + compile + run): {lazy_first * 1e3:.1f} ms; "
        f"first compiled call (trace + compile + run): {comp_first * 1e3:.1f} ms"
    )
    for note in notes:
        print(note)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.steps < 2 or min(args.reps, args.calls, args.ops, args.compile_ops) < 1:
        sys.exit("--steps must be >= 2 (the first step is not timed); --reps, --calls, --ops, --compile-ops >= 1")
    if args.devices == "all":
        return _run_all(argv)
    if args.devices is not None:
        try:
            count = int(args.devices)
        except ValueError:
            sys.exit(f"--devices takes a positive number or 'all', not {args.devices!r}")
        if count < 1:
            sys.exit(f"--devices takes a positive number or 'all', not {args.devices!r}")
        _set_device_count(count)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
