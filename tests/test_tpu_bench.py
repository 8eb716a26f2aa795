"""The TPU bench (``bench/tpu.py``) at tiny sizes on the CPU, with the chip's check-rows path on.

Device time is scarce: a bench that fails on the chip costs the session its call. This runs the
training modes of the next chip calls (``st.compile``, the lazy loops, float32 at 'medium', the
timeline) in one subprocess with ``SHARDTENSOR_EARLY_ROWS=1`` (the check rows' own program, a TPU's
default, off on a CPU otherwise): a crash there (an empty rows program's copy to the host, seventh
session) shows here. Each shardtensor row's loss equals plain JAX's for the same program. The HF
Llama training rows (``--llama --llama-training-only``, the lazy loop against ``st.compile``) run the
same way, their last losses equal.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench(args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), SHARDTENSOR_CPU_DEVICES="1", SHARDTENSOR_EARLY_ROWS="1")
    env["XLA_FLAGS"] = os.environ.get("SHARDTENSOR_TEST_COMPILE_FLAGS", "")  # (one chip: no device count)
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tpu.py"), *args],
        cwd=ROOT / "bench",
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_tiny_tpu_bench_runs_every_training_mode_with_the_rows_program():
    args = ["--tiny", "--gpt", "--modes", "compile", "lazy-10", "lazy-item", "--no-forward"]
    args += ["--f32", "--precisions", "medium", "--f32-modes", "compile", "compile-nochecks"]
    args += ["--steps", "3", "--warmup", "3", "--timeline"]
    result = _bench(args)
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and " GPT |" in line]
    names = [row.split("|")[2].strip() for row in rows]
    assert len(rows) == 7, names  # two JAX rows, five of shardtensor's
    assert "check rows' own program used: True" in result.stdout  # the chip's path ran
    # the bf16 rows print shardtensor's loss beside JAX's; the float32 rows print their own, the
    # JAX row first
    for row in rows:
        pair = re.search(r"loss ([\d.]+) \(JAX ([\d.]+)\)", row)
        if pair:
            assert abs(float(pair[1]) - float(pair[2])) < 1e-2, row
    f32 = [float(re.search(r"loss ([\d.]+)", row)[1]) for row in rows if row.startswith("| f32")]
    assert len(f32) == 3 and max(f32) - min(f32) < 1e-2, f32
    assert result.stdout.count("device window") == 7  # the timeline of each row


def test_tiny_tpu_bench_trains_hf_llama_lazily_and_compiled_alike():
    result = _bench(["--tiny", "--llama", "--llama-training-only", "--steps", "2", "--warmup", "2"])
    rows = [line for line in result.stdout.splitlines() if line.startswith("| HF Llama |")]
    assert len(rows) == 2, result.stdout[-2000:]
    pair = re.search(r"loss ([\d.]+) \(st.compile ([\d.]+)\)", rows[1])
    assert pair, rows[1]
    assert abs(float(pair[1]) - float(pair[2])) < 1e-2, rows[1]  # bf16 steps: the same to ~3 digits
