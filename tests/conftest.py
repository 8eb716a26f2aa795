"""Test set-up: 8 simulated CPU devices, set before jax is imported.

The suite compiles thousands of small programs, and XLA's CPU code generation for each is most of
its time: tests compile with LLVM's cheap settings (``xla_backend_optimization_level=0``, no
expensive passes), XLA's older, quicker CPU fusion emitter (``xla_cpu_use_fusion_emitters=false``:
half the compile time of a small program) and one LLVM module per program
(``xla_cpu_parallel_codegen_split_count=1``: the split is for idle cores, and xdist's workers already
use them all; a fifth less compile time). XLA's own passes (sharding propagation, SPMD
partitioning, simplification, fusion) run as for a user, so every lowering and partitioning result
is still checked, and no reference depends on how the code generator fuses multiply-adds; the demo
and the benches compile with the defaults. Set ``SHARDTENSOR_TEST_FULL_OPT=1`` to run the suite
with them too.
"""

import gc
import os

import pytest

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")
_flags = os.environ.get("XLA_FLAGS", "").split()
if not any(f.startswith("--xla_force_host_platform_device_count") for f in _flags):
    _flags.append("--xla_force_host_platform_device_count=8")
_CHEAP = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)
if not os.environ.get("SHARDTENSOR_TEST_FULL_OPT"):
    for _flag in _CHEAP:
        if not any(f.startswith(_flag.split("=")[0] + "=") for f in _flags):
            _flags.append(_flag)
os.environ["XLA_FLAGS"] = " ".join(_flags)
# Subprocess tests that start from a clean device set-up (no device count in XLA_FLAGS) put these
# back into the child's XLA_FLAGS: the same compiles as the suite. Read back from XLA_FLAGS, not
# from what this file added: pytest-xdist's workers inherit XLA_FLAGS with them already in.
os.environ["SHARDTENSOR_TEST_COMPILE_FLAGS"] = " ".join(
    f for f in _flags if f.split("=")[0] in {c.split("=")[0] for c in _CHEAP}
)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """Collection imports torch, jax, torch's OpInfo and module databases and every test module:
    ~700k objects that live as long as the worker. Python's cyclic collector walks all of them at
    each full collection (17 of them while collecting, ~4 s of CPU per worker), and again at each
    one while the tests run. So it is held off while collecting (imports make next to no garbage
    cycles), then whatever collection left unreachable is freed and the survivors are frozen: later
    collections walk only what the tests create. Tests see the collector as usual."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()
        gc.freeze()
