"""What ``st.alias_device("xla")`` (the torch_xla face's ``'xla'`` devices) costs per call: an op on
ShardedTensors (nothing of the alias is on its path), ``Tensor.to(dtype)`` (the wrapped conversion's
check) and ``cpu_tensor.to("xla")`` against ``.to(st.device())``. Medians of interleaved rounds, in µs.

Example::

    python bench/xla_device_alias.py
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")

import torch  # noqa: E402

import shardtensor as st  # noqa: E402


def per_call(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    x = torch.ones(64, 64).to(st.device())
    small = torch.ones(4)
    host = torch.ones(64, 64)
    cases = {
        "x + x (recorded lazily)": (lambda: x + x, 2000),
        "cpu.to(torch.float32)": (lambda: small.to(torch.float32), 20000),
        "cpu.to(device)": (lambda: host.to(st.device()), 500),
    }
    rounds: dict[str, dict[str, list[float]]] = {name: {"without": [], "with": []} for name in cases}
    for _ in range(5):
        for state in ("without", "with"):
            alias = st.alias_device("xla") if state == "with" else None
            for name, (fn, n) in cases.items():
                rounds[name][state].append(per_call(fn, n))
                st.sync()
            if alias is not None:
                alias.remove()
    alias = st.alias_device("xla")
    rounds["cpu.to('xla')"] = {"with": [per_call(lambda: host.to("xla"), 500) for _ in range(5)], "without": []}
    st.sync()
    alias.remove()
    print(f"{'call':<28} {'without alias':>14} {'with alias':>11}   (µs per call, median of 5 rounds)")
    for name, r in rounds.items():
        without = f"{statistics.median(r['without']):14.2f}" if r["without"] else f"{'-':>14}"
        print(f"{name:<28} {without} {statistics.median(r['with']):11.2f}")


if __name__ == "__main__":
    main()
