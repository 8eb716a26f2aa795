"""Moving a large CPU tensor onto the devices: shardtensor against plain JAX, in the same process.

For a float32 tensor of ``--mib`` MiB on 8 simulated CPU devices (a (4, 2) mesh), sharded over the
first axis (each shard on two devices) and wholly replicated, it times:

  st.shard            shardtensor's upload: a private copy per shard (the caller's tensor may change
                      later), taken by the device as it is
  jax copying         ``jax.device_put`` of a NumPy array jax cannot alias (so it copies each shard)
  jax aliasing        ``jax.device_put`` of the tensor's own memory (no copy at all where jax can alias
                      it: a later in-place change of the CPU tensor would show through; the floor)

Each line is the median of ``--reps`` uploads after one warm-up (the first touch of fresh memory is
slow on some virtual machines), and the ratio st.shard / jax copying.

Usage::

    python bench/upload.py
    python bench/upload.py --mib 512 --reps 7

It waits for an upload through the result's stored jax array (``x._cell.value``, an internal).
"""

from __future__ import annotations

import os

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402


def median_ms(fn, reps):
    """Median wall time of ``fn()`` (which returns a jax array, waited for), after one warm-up."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=128, help="tensor size in MiB (default 128)")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)

    import jax
    import numpy as np
    import torch
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardtensor as st

    mesh = st.Mesh(range(8), (4, 2), ("data", "model"))
    jax_mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rows = args.mib * 2**20 // (16 * 4)
    x = torch.randn(rows, 16)
    # a view one element in: jax cannot take memory this misaligned as a device buffer, so it copies
    unaligned = np.empty(x.numel() + 1, np.float32)[1:].reshape(x.shape)
    unaligned[...] = x.numpy()
    print(f"{args.mib} MiB float32 ({rows} x 16), 8 CPU devices, mesh (4, 2); median of {args.reps} (ms)")
    print(f"{'layout':<22}{'st.shard':>10}{'jax copying':>13}{'jax aliasing':>14}{'ratio':>8}")
    for name, spec in (("sharded ('data', None)", ("data", None)), ("replicated", (None, None))):
        sharding = NamedSharding(jax_mesh, P(*spec))
        ours = median_ms(lambda spec=spec: st.shard(x, mesh, spec)._cell.value, args.reps)
        copying = median_ms(lambda sharding=sharding: jax.device_put(unaligned, sharding), args.reps)
        aliasing = median_ms(lambda sharding=sharding: jax.device_put(x.numpy(), sharding), args.reps)
        print(f"{name:<22}{ours:>10.1f}{copying:>13.1f}{aliasing:>14.1f}{ours / copying:>7.2f}x")


if __name__ == "__main__":
    main()
