"""Issue 49: every Python block of the two design documents shardtensor was built from
(tests/xla_seeds/, verbatim) runs under ``python -m shardtensor.xla`` on 8 simulated CPU devices, with
``MyModel``, ``loader`` and the few other names the blocks leave undefined filled in, and its results
equal eager torch's (tests/_xla_seed_runner.py runs a document in a fresh process and checks)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _run(document: str, workdir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_", "PJRT_"))}
    flags = os.environ.get("SHARDTENSOR_TEST_COMPILE_FLAGS", "")
    env.update(
        PYTHONPATH=str(REPO),
        SHARDTENSOR_CPU_DEVICES="8",
        SHARDTENSOR_PLATFORM="cpu",
        SHARDTENSOR_TEST_COMPILE_FLAGS=flags,
        XLA_FLAGS=flags,
    )
    command = [sys.executable, "-m", "shardtensor.xla", str(TESTS / "_xla_seed_runner.py"), document, str(workdir)]
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=500)


@pytest.mark.parametrize("document", ["seed_spmd_guide.md", "seed_torchtpu.md"])
def test_the_seed_documents_blocks_run_verbatim(document, tmp_path):
    result = _run(document, tmp_path)
    assert result.returncode == 0 and result.stdout.rstrip().endswith("DONE"), (
        result.stdout[-3000:] + result.stderr[-6000:]
    )
    checks = [line for line in result.stdout.splitlines() if line.startswith("CHECK ")]
    assert checks and all(line.endswith(" ok") for line in checks)
