"""PyTorch/XLA's own examples (``examples/`` of github.com/pytorch/xla, not in this repository: give the
folder), run unmodified under shardtensor's torch_xla face on this machine's devices, each loss
compared with eager torch's (issue 49; the report is docs/xla.md).

``train_decoder_only_base.py`` takes its sizes as flags and runs as
``python -m shardtensor.xla train_decoder_only_base.py --num-steps N --hidden-size 64 ...``. The other
decoder examples take no flags (their model is d=1024 with a 32768-wide MLP, 200 steps): they run
with ``--tiny``'s sizes, set as the defaults of ``DecoderOnlyConfig``, of ``TrainDecoderOnlyBase``'s
``num_steps`` and its batch size and sequence length before the example reads them (the files stay as
they are; ``bench/tpu_xla_example.py`` does the same), and the model seeded with 42 as the base script
seeds it. The examples feed zeros, so each position of each batch row is the same: eager torch's
losses, from the same model file, seed and optimizer on one row of 8 tokens, are the reference.

Example::

    SHARDTENSOR_CPU_DEVICES=8 python bench/xla_examples.py /path/to/xla/examples
    SHARDTENSOR_CPU_DEVICES=8 python bench/xla_examples.py /path/to/examples --only eager/train_decoder_only_eager.py
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tpu_xla_example as tiny  # noqa: E402

BASE_FLAGS = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
BASE_FLAGS["intermediate_size"] = 128
# the examples, and how each runs: "flags" (its own command line) or "tiny" (defaults set before it reads them)
EXAMPLES = {
    "train_decoder_only_base.py": "flags",
    "eager/train_decoder_only_eager.py": "tiny",
    "eager/train_decoder_only_eager_with_compile.py": "tiny",
    "eager/train_decoder_only_eager_spmd_data_parallel.py": "tiny",
    "fsdp/train_decoder_only_fsdp_v2.py": "tiny",
    "flash_attention/train_decoder_only_flash_attention.py": "tiny",
    "flash_attention/train_decoder_only_flash_attention_fsdp_v2.py": "tiny",
}
LOSS = re.compile(r"step: (\d+), loss: ([-0-9.e+naif]+)")


def command(folder: str, example: str, steps: int) -> list[str]:
    path = os.path.join(folder, example)
    if EXAMPLES.get(example) == "flags":
        flags = [
            f"--{k.replace('_', '-').replace('num-hidden-layers', 'num-layers')}={v}" for k, v in BASE_FLAGS.items()
        ]
        return [sys.executable, "-m", "shardtensor.xla", path, f"--num-steps={steps}", *flags]
    return [sys.executable, os.path.abspath(__file__), "--child", path, f"--steps={steps}"]


def child(example: str, steps: int) -> None:
    """Run ``example`` as ``python -m shardtensor.xla example`` would, with the tiny defaults."""
    import runpy

    import shardtensor.xla

    shardtensor.xla.install()
    tiny.shrink_example_defaults(tiny.examples_folder(example), steps, tiny=True)
    torch.manual_seed(42)  # (as train_decoder_only_base.py's __main__ seeds; the others do not)
    sys.argv = [os.path.abspath(example)]
    runpy.run_path(sys.argv[0], run_name="__main__")


def eager_losses(folder: str, config: dict, steps: int, every: int = 10) -> dict[int, float]:
    """Eager torch on the CPU: the examples' model file, seed, optimizer and loss, one row of zeros."""
    sys.path.insert(0, folder)
    import decoder_only_model as dom

    torch.manual_seed(42)
    cfg = dom.DecoderOnlyConfig(**config)
    model = dom.DecoderOnlyModel(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=0.0001)
    x = torch.zeros(1, 8, dtype=torch.int64)
    out = {}
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).view(-1, cfg.vocab_size), x.view(-1))
        loss.backward()
        opt.step()
        if step % every == 0:
            out[step] = loss.item()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="the examples/ folder of pytorch/xla (or, with --child, an example)")
    p.add_argument("--steps", type=int, default=12, help="training steps (losses print at 0, 10, ...)")
    p.add_argument("--only", nargs="*", default=None, help="examples to run (paths relative to the folder)")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.folder, args.steps)
        return
    folder = os.path.abspath(args.folder)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH")])
    )
    rows = []
    for example in args.only or list(EXAMPLES):
        start = time.time()
        try:
            run = subprocess.run(
                command(folder, example, args.steps),
                cwd=os.path.dirname(os.path.join(folder, example)),
                env=env,
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            output, code = run.stdout + run.stderr, run.returncode
        except subprocess.TimeoutExpired as e:
            output, code = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {args.timeout} s", "timeout"
        seconds = time.time() - start
        got = {int(s): float(v) for s, v in LOSS.findall(output)}
        config = BASE_FLAGS if EXAMPLES.get(example) == "flags" else dict(tiny.TINY_CONFIG)
        reference = eager_losses(folder, config, args.steps)
        close = bool(got) and all(abs(got[s] - reference[s]) <= 1e-3 * abs(reference[s]) for s in got)
        falling = len(got) > 1 and got[max(got)] < got[min(got)]
        last = [line for line in output.strip().splitlines() if line.strip()][-1:] or [""]
        rows.append((example, code, seconds, got, reference, close, falling, last[0]))
        print(f"{example}: exit {code} in {seconds:.0f} s; losses {got}; eager torch {reference}", flush=True)
        if code != 0:
            print("   " + "\n   ".join(output.strip().splitlines()[-6:]), flush=True)
    print("\n| example | ran | losses (step: loss) | eager torch | equal | falling | time |")
    print("|---|---|---|---|---|---|---|")
    for example, code, seconds, got, ref, close, falling, last in rows:
        shown = ", ".join(f"{s}: {v:.4f}" for s, v in sorted(got.items())) or "-"
        refs = ", ".join(f"{s}: {v:.4f}" for s, v in sorted(ref.items()) if s in got) or "-"
        status = "yes" if code == 0 else f"no ({code}): {last[:80]}"
        marks = f"{'yes' if close else 'no'} | {'yes' if falling else 'no'}"
        print(f"| {example} | {status} | {shown} | {refs} | {marks} | {seconds:.0f} s |")


if __name__ == "__main__":
    main()
