"""Peak device memory of one FSDPv2 training step, with and without ``checkpoint_module``.

A stack of pre-norm MLP blocks (LayerNorm, Linear d->4d, GELU, Linear 4d->d, residual), each block
auto-wrapped in its own FSDPv2 on an 8-device mesh (8, 1) ('fsdp', 'model'). One SGD step (forward,
backward, optimizer, zero_grad) is recorded lazily as one graph; the graph is compiled and XLA's
``memory_analysis()`` of the executable gives, per device, the bytes of the arguments, the outputs
and the temporaries (activations, gathered weights, gradients). The step is then run and the losses
of both variants compared.

shardtensor has no public accessor for the compiled program of the pending graph, so
``compiled_step`` below reaches into ``shardtensor.lazy`` (white box, benchmark only).

On CPU, XLA's default "concurrency optimized" scheduler runs independent work early for
parallelism, which hoists the recomputation back into the forward pass; ``--cpu-scheduler memory``
(the default here) turns it off so the schedule is memory-driven, as on TPU/GPU.
``--output-order`` compares the order in which shardtensor lists the graph's outputs (oldest tensor
first, "as-is") with the reverse: XLA:CPU's scheduler follows it, and with oldest-first it computes
every weight gradient after the whole input-gradient chain, which keeps each block's recomputed
activations alive to the end.

    python bench/fsdp_memory.py                       # 8 blocks, d=256, batch 64 x 128 tokens
    python bench/fsdp_memory.py --blocks 4 --output-order as-is
"""
from __future__ import annotations

import argparse
import functools
import os
import sys


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--cpu-scheduler", choices=["memory", "default"], default="memory")
    p.add_argument("--norm", choices=["layernorm", "none", "both"], default="both",
                   help="pre-norm blocks (LayerNorm first) or plain MLP blocks")
    p.add_argument("--output-order", choices=["as-is", "reversed", "both"], default="both")
    return p.parse_args()


ARGS = parse()
os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", str(ARGS.devices))
if ARGS.cpu_scheduler == "memory":  # must be in XLA_FLAGS before jax starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import shardtensor as st  # noqa: E402
from shardtensor import lazy  # noqa: E402  (white box: the compiled program of the pending graph)
from shardtensor.fsdp import FSDPv2, checkpoint_module, transformer_auto_wrap_policy  # noqa: E402

MiB = 2 ** 20


NORM = "layernorm"  # the block kind being measured (set by main)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d) if NORM == "layernorm" else nn.Identity()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, d, blocks):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(blocks)])

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


def compiled_step():
    """The pending lazy graph, compiled as jax would compile it at sync()."""
    execution = lazy.Execution.prepare(lazy.pending_cells())
    fn, program = execution.executable, execution.executable.program
    donated = [execution.arrays[i] for i in program.donated]
    kept = [execution.arrays[i] for i in program.kept]
    vecs = {k: lazy._device_scalars(v, program.mesh) for k, v in execution.scalars.items()}
    return fn.lower(donated, kept, vecs).compile()


@functools.lru_cache(maxsize=None)
def reference_model(norm):
    torch.manual_seed(0)
    return Net(ARGS.d, ARGS.blocks)


def measure(checkpointed: bool, reverse_outputs: bool):
    import copy

    mesh = st.Mesh(range(ARGS.devices), (ARGS.devices, 1), ("fsdp", "model"))
    model = copy.deepcopy(reference_model(NORM))
    wrapper = (lambda m, *a, **kw: FSDPv2(checkpoint_module(m), *a, **kw)) if checkpointed else None
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDPv2(model, mesh=mesh, auto_wrap_policy=policy, auto_wrapper_callable=wrapper)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = st.shard(torch.randn(ARGS.batch, ARGS.seq, ARGS.d, generator=g), mesh, ("fsdp", None, None))
    st.sync()

    original = lazy.pending_cells
    if reverse_outputs:  # experiment: list the graph's outputs newest first
        lazy.pending_cells = lambda: list(reversed(original()))
    try:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        compiled = compiled_step()
        st.sync()  # run the step (compiles again through shardtensor's own cache)
    finally:
        lazy.pending_cells = original
    m = compiled.memory_analysis()
    calls = sum(b.calls for b in model.module.blocks)
    return {
        "args": m.argument_size_in_bytes / MiB, "out": m.output_size_in_bytes / MiB,
        "alias": m.alias_size_in_bytes / MiB, "temp": m.temp_size_in_bytes / MiB,
        "peak": (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                 + m.temp_size_in_bytes) / MiB,
        "loss": loss.item(), "calls": calls,
    }


def main():
    global NORM
    orders = {"as-is": [False], "reversed": [True], "both": [False, True]}[ARGS.output_order]
    norms = ["layernorm", "none"] if ARGS.norm == "both" else [ARGS.norm]
    per_block = ARGS.batch // ARGS.devices * ARGS.seq * 4 * ARGS.d * 4 / MiB
    print(f"{ARGS.blocks} blocks, d={ARGS.d}, batch {ARGS.batch} x {ARGS.seq} tokens, mesh ({ARGS.devices}, 1); "
          f"one 4d-wide activation is {per_block:.1f} MiB per device")
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"{'block':<10} {'output order':<13} {'variant':<13} {'temp MiB':>9} {'args':>6} {'out':>6} "
          f"{'peak MiB':>9} {'fwd calls':>9} {'loss':>10}")
    for NORM in norms:
        block = "pre-norm" if NORM == "layernorm" else "mlp"
        for reverse in orders:
            results = {}
            for checkpointed in (False, True):
                r = results[checkpointed] = measure(checkpointed, reverse)
                print(f"{block:<10} {'reversed' if reverse else 'as-is':<13} "
                      f"{'checkpointed' if checkpointed else 'plain':<13} {r['temp']:>9.1f} {r['args']:>6.1f} "
                      f"{r['out']:>6.1f} {r['peak']:>9.1f} {r['calls']:>9} {r['loss']:>10.6f}")
            change = results[True]["peak"] / results[False]["peak"] - 1
            same = abs(results[True]["loss"] - results[False]["loss"]) <= 1e-5 * abs(results[False]["loss"])
            print(f"{'':<24} checkpointing: peak {100 * change:+.0f}%, losses equal: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
