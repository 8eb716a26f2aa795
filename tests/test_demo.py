"""The demo (`make demo`): FSDPv2 + MpDeviceLoader training of the GPT.

In process (8 simulated devices from conftest): a few lazy steps train like the same model,
unwrapped, in eager PyTorch on the CPU; the compile count settles; each device holds 1/8 of the
parameter bytes. In a fresh process: `python -m shardtensor.demo` sets up its own devices from the
options and prints its summary.
"""

import os
import subprocess
import sys
from pathlib import Path

import torch

import shardtensor as st
from shardtensor import demo
from shardtensor.fsdp import FSDPv2

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6


def eager_torch_losses(steps: int) -> list:
    """The same GPT (same init), unwrapped, trained on the same batches in eager PyTorch on the CPU."""
    model = demo.build_model(seed=0)
    opt = demo.make_optimizer(model.parameters(), capturable=False)  # capturable needs an accelerator
    losses = []
    for x, y in demo.make_loader(steps, seed=0):
        loss = demo.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_fsdp_demo_trains_like_eager_torch():
    result = demo.train(STEPS, "lazy", (8, 1), progress=False)

    # FSDPv2 auto-wrapped each block and sharded every parameter over 'fsdp'
    root = result.model
    assert isinstance(root, FSDPv2)
    assert all(isinstance(b, FSDPv2) for b in root.module.blocks)
    assert root.module.blocks[0].module.up.weight.partition_spec == st.PartitionSpec("fsdp", None)
    assert all("fsdp" in tuple(p.partition_spec) for p in root.parameters())
    assert st.get_global_mesh() is None  # train() restores the global mesh

    # the loss falls, and matches eager torch step for step
    assert len(result.losses) == STEPS
    assert result.losses[-1] < result.losses[0] - 0.05, result.losses
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(eager_torch_losses(STEPS)), rtol=0, atol=1e-4)

    # at most two programs (the first step also creates AdamW's state), none after the first two steps
    assert result.compiles[-1] <= 2, result.compiles
    assert result.compiles[-1] == result.compiles[1], result.compiles

    # each of the 8 devices holds an eighth of the parameter bytes (every size divides by 8 here)
    assert abs(result.bytes_per_device * 8 - result.bytes_total) <= 0.01 * result.bytes_total, (
        result.bytes_per_device,
        result.bytes_total,
    )
    assert result.bytes_total == 4 * sum(p.numel() for p in demo.build_model().parameters())


def test_sparkline():
    line = demo.sparkline([3.0, 2.5, 1.5, 1.0])
    assert len(line) == 4 and line[0] == "█" and line[-1] == "▁" and line[1] > line[2]
    assert len(demo.sparkline(list(range(500)), width=60)) == 60
    assert demo.sparkline([1.0, 1.0]) == "▁▁"


def test_demo_command_line():
    """`python -m shardtensor.demo` with its options, in a fresh process that did not ask for devices."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("SHARDTENSOR_CPU_DEVICES", "SHARDTENSOR_PLATFORM", "XLA_FLAGS")
    }
    env["XLA_FLAGS"] = os.environ.get("SHARDTENSOR_TEST_COMPILE_FLAGS", "")  # (no device count)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardtensor.demo",
            "--steps",
            "3",
            "--mode",
            "compile",
            "--mesh",
            "4,2",
            "--platform",
            "cpu",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "on 8 cpu device(s), mesh (4, 2) ('fsdp', 'model'), mode compile, 3 steps" in output, output
    assert "loss per step:" in output, output
    assert "compiles (UncachedCompile): 2 in the training loop, 0 after the first 2 steps" in output, output
    assert "median step time:" in output and "tokens/s" in output, output
    assert "parameter bytes per device: 115.8 KiB of 463.0 KiB unsharded (1/4.00" in output, output
