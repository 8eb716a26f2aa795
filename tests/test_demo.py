"""The demo (`make demo`) runs end to end: a few training steps in a fresh process."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_a_few_steps():
    env = dict(os.environ, COLUMNS="200")  # wide enough that rich does not wrap the table
    proc = subprocess.run(
        [sys.executable, "-m", "shardtensor.demo", "--steps", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=480,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "Parameter shardings" in output, output
    assert "blocks.0.q.weight" in output and "{devices=[2,1,4]" in output, output
    assert "compiles (UncachedCompile):" in output, output
    assert "median step time:" in output, output
