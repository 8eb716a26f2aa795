"""What reading a sharded result back costs in a multi-process job (issue 15 §4).

In a job of several processes, ``.cpu()`` of a tensor sharded over every process's devices gathers
the whole tensor into each process (a collective: every process must call it), and ``.item()`` of a
sharded reduction reads its (replicated) scalar the same way. This times both, best of ``--repeats``
after a warm-up (which compiles the gather), on a mesh of 8 simulated CPU devices:

  1 process  x 8 devices    everything addressable: a host copy of the device buffers
  2 processes x 4 devices   ``jax.experimental.multihost_utils.process_allgather`` over gloo

and, in the same processes on the same sharded ``jax.Array``, plain JAX doing the same read:
``np.asarray`` of an array over the same buffers (1 process) or ``process_allgather`` (2 processes);
for ``.item()``, ``jax.jit(jnp.sum)`` then reading the scalar the same way (with 2 processes: a
gather, as shardtensor does), and, on a line of its own, ``float()`` of that replicated scalar, which
plain JAX reads from a device of this process without a gather. The tensors are float32 of shape
(rows, 1024), sharded on rows. With 2 processes a time is the slower process's (each starts from a
``sync_global_devices`` barrier).

Example::

    .venv/bin/python bench/multiprocess_readback.py            # 1, 16 and 64 MB
    .venv/bin/python bench/multiprocess_readback.py --quick    # 1 and 8 MB
    .venv/bin/python bench/multiprocess_readback.py --sizes 4 32 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = 1024  # float32: 4 KiB a row
MB = 1e6


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 and 8 MB, 3 repeats")
    p.add_argument("--sizes", type=float, nargs="+", default=None, help="tensor sizes in MB (default 1 16 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs of each read; the best counts (default 5)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # one measuring process: "single" or "multi:PORT:PID"
    args = p.parse_args(argv)
    if args.sizes is None:
        args.sizes = [1.0, 8.0] if args.quick else [1.0, 16.0, 64.0]
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    if args.repeats < 1 or min(args.sizes) <= 0:
        p.error("--repeats must be at least 1 and every size positive")
    return args


# ---- one measuring process ----------------------------------------------------------------------


def run_worker(args) -> dict:
    """Join the job (2 processes) or not, and time each read; this process's best times in seconds."""
    role = args.worker.split(":")
    multi = role[0] == "multi"
    if multi:
        import shardtensor.runtime as rt

        rt.initialize_distributed(f"127.0.0.1:{role[1]}", num_processes=2, process_id=int(role[2]))
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from jax.experimental import multihost_utils

    import shardtensor as st

    mesh = st.Mesh(range(8), (8,), ("x",))
    jax_sum = jax.jit(jnp.sum)

    def barrier():
        if multi:
            multihost_utils.sync_global_devices("readback bench")

    def best(read) -> float:
        read()  # warm-up: compiles the gather (and the reduction)
        times = []
        for _ in range(args.repeats):
            barrier()
            start = time.perf_counter()
            read()
            times.append(time.perf_counter() - start)
        return min(times)

    def jax_read(a):
        if multi:
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        # a new array over the same buffers: np.asarray caches its host copy on the array it reads
        return np.asarray(
            jax.make_array_from_single_device_arrays(a.shape, a.sharding, [s.data for s in a.addressable_shards])
        )

    def measure(x, a, nbytes) -> dict:
        return {
            "bytes": nbytes,
            "st cpu": best(lambda: x.cpu()),
            "jax cpu": best(lambda: jax_read(a)),
            "st item": best(lambda: x.sum().item()),
            "jax item": best(lambda: float(jax_read(jax_sum(a)))),
            # plain JAX can read a replicated scalar from a device of its own: no gather
            "jax local item": best(lambda: float(jax_sum(a))),
        }

    # each size compiles its own reduction: on purpose here
    warnings.filterwarnings("ignore", message="compiled a graph of the same structure")
    out = {}
    for size in args.sizes:
        rows = max(8, round(size * MB / (4 * COLUMNS)) // 8 * 8)
        full = torch.randn(rows, COLUMNS, generator=torch.Generator().manual_seed(0))  # the same in each process
        x = st.shard(full, mesh, ("x", None))
        a = st.tensor.readback.materialize(x)  # the sharded jax.Array under x
        assert torch.equal(x.cpu(), full) and np.array_equal(jax_read(a), full.numpy())
        want = float(full.double().sum())
        got = x.sum().item()
        assert abs(got - want) <= 1e-3 * full.abs().sum().item(), (got, want)
        out[str(size)] = measure(x, a, full.numel() * 4)
    return out


# ---- the launcher -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, processes: int) -> dict:
    """Run the measuring processes (this script with --worker); per size and read, the slowest's time."""
    command = [sys.executable, os.path.abspath(__file__), "--repeats", str(args.repeats), "--sizes"]
    command += [str(s) for s in args.sizes]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_"))}
    env.update(SHARDTENSOR_CPU_DEVICES=str(8 // processes), SHARDTENSOR_PLATFORM="cpu")
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])  # this checkout's shardtensor
    port = _free_port()
    roles = ["single"] if processes == 1 else [f"multi:{port}:{pid}" for pid in range(processes)]
    procs = [
        subprocess.Popen(command + ["--worker", role], env=env, stdout=subprocess.PIPE, text=True) for role in roles
    ]
    try:
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    reports = []
    for role, p, stdout in zip(roles, procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"the measuring process {role} failed (exit {p.returncode}); its errors are above")
        reports.append(json.loads(next(line for line in stdout.splitlines() if line.startswith("REPORT "))[7:]))
    return {size: {k: max(r[size][k] for r in reports) for k in reports[0][size]} for size in reports[0]}


def table(one: dict, two: dict) -> list[str]:
    """Times in ms: shardtensor, plain JAX and their ratio, in 1 and 2 processes; then 2 over 1."""
    head = (
        f"{'size':>7} {'read':>7} | {'1p st':>8} {'1p jax':>8} {'st/jax':>6} | {'2p st':>8} {'2p jax':>8} {'st/jax':>6}"
    )
    lines = [head + f" | {'2p/1p st':>8}", "-" * (len(head) + 11)]
    for size in one:
        mb = one[size]["bytes"] / MB
        for read in ("cpu", "item"):
            a, b, c, d = (r[size][f"{w} {read}"] * 1e3 for r in (one, two) for w in ("st", "jax"))
            label = f".{read}()"
            one_p = f"{a:>8.2f} {b:>8.2f} {a / b:>6.2f}"
            two_p = f"{c:>8.2f} {d:>8.2f} {c / d:>6.2f}"
            lines.append(f"{mb:>5.1f}MB {label:>7} | {one_p} | {two_p} | {c / a:>8.2f}")
    lines.append("plain JAX reading x.sum()'s replicated scalar from its own device (float(r), no gather), ms:")
    lines.append(
        "  "
        + ", ".join(
            f"{one[k]['bytes'] / MB:.1f} MB: 1p {one[k]['jax local item'] * 1e3:.2f} / "
            f"2p {two[k]['jax local item'] * 1e3:.2f}"
            for k in one
        )
    )
    return lines


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        print("REPORT " + json.dumps(run_worker(args)), flush=True)
        return 0
    start = time.perf_counter()
    one, two = launch(args, 1), launch(args, 2)
    print(
        f"readback of a float32 (rows, {COLUMNS}) tensor sharded on rows over 8 CPU devices; ms, best of {args.repeats}"
    )
    print("(.item() is of x.sum(): the reduction runs each time, in shardtensor and in JAX)")
    for line in table(one, two):
        print(line)
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
