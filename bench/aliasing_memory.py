"""What parameter aliasing (donation) saves: XLA's memory analysis of a training step, on and off.

The MLP and the GPT of ``bench/train_vs_jax.py`` (FSDP-style on 8 simulated devices, AdamW) train a
few lazy steps with ``st.set_param_aliasing(True)`` (the default, as PyTorch/XLA's
``XLA_ENABLE_PARAM_ALIASING``) and then ``False``. For the step's program it prints, per device,
XLA's memory analysis (the figures ``graph/memory.py`` checks before a program runs): the peak
(arguments + outputs + temporaries - outputs written into donated inputs), and the bytes written
into donated inputs, with the parameters and optimizer state per device for scale. The losses of
the two settings must agree exactly (aliasing changes where results are written, not what they are).
The program measured is the last step's (the first one also creates the optimizer state).

Usage::

    python bench/aliasing_memory.py
    python bench/aliasing_memory.py --model gpt --steps 2
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_vs_jax as models  # noqa: E402  (sets the 8 simulated devices before jax is imported)

# isort: split
import shardtensor as st  # noqa: E402
from shardtensor.graph import execute  # noqa: E402  (white box: the step's compiled program)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def measure(kind, aliasing, steps):
    """(losses, the step program's ProgramMemory, parameter + optimizer state bytes per device)."""
    st.set_param_aliasing(aliasing)
    mesh = st.Mesh(range(8), (8,), ("fsdp",))
    models.torch.manual_seed(0)
    state_dict = (models.MLP() if kind == "mlp" else models.GPT()).state_dict()
    run = models.ShardtensorRun(kind, state_dict, mesh, compiled=False)
    called = []
    real = execute.call_executable

    def spy(fn, arrays, scalars):
        called.append(fn)
        return real(fn, arrays, scalars)

    execute.call_executable = spy
    losses = []
    try:
        for x, y in models.make_batches(kind, steps):
            called.clear()
            losses.append(run(x, y))
    finally:
        execute.call_executable = real
    # the last step's program: the steady state (the first step also creates the optimizer state)
    step_program = max(called, key=lambda fn: len(fn.program.steps))
    state = list(run.model.parameters())
    for p in run.model.parameters():
        state += [v for v in run.opt.state[p].values() if isinstance(v, st.ShardedTensor) and v.dim()]
    per_device = sum(t.numel() * t.element_size() for t in state) // 8
    return losses, step_program.memory, per_device


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["mlp", "gpt", "both"], default="both")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    for kind in ["mlp", "gpt"] if args.model == "both" else [args.model]:
        results = {aliasing: measure(kind, aliasing, args.steps) for aliasing in (True, False)}
        (losses_on, on, state), (losses_off, off, _) = results[True], results[False]
        print(
            f"{kind.upper()} training step (AdamW, FSDP over 8 devices): parameters + optimizer state "
            f"{_mib(state)} per device; losses equal with and without aliasing: {losses_on == losses_off}"
        )
        for label, m in (("aliasing on ", on), ("aliasing off", off)):
            print(
                f"  {label}: peak {_mib(m.peak)} per device = arguments {_mib(m.arguments)} + outputs "
                f"{_mib(m.outputs)} + temporaries {_mib(m.temporaries)} - {_mib(m.reused)} written into "
                "donated inputs"
            )
        print(
            f"  cost of keeping every input: +{_mib(off.peak - on.peak)} per device "
            f"(+{100 * (off.peak - on.peak) / on.peak:.0f}% of the step's peak)"
        )
    st.set_param_aliasing(None)


if __name__ == "__main__":
    main()
