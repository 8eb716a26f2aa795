"""Peak device memory of one FSDPv2 training step, with and without ``checkpoint_module``.

A stack of MLP blocks (optionally pre-norm: LayerNorm, Linear d->4d, GELU, Linear 4d->d, residual),
each auto-wrapped in its own FSDPv2 on a mesh (8, 1) ('fsdp', 'model'). One SGD step (forward,
backward, optimizer, zero_grad) is recorded lazily as one graph; the graph is compiled and XLA's
``memory_analysis()`` of the executable gives, per device, the bytes of the arguments, the outputs and
the temporaries (activations, gathered weights, gradients). The step is then run, and the losses of
both variants compared.

shardtensor has no public accessor for the compiled program of the pending graph, so
``compiled_step`` below lowers the pending graph with ``shardtensor.graph.capture`` (white box, benchmark only).

Example::

    .venv/bin/python bench/fsdp_memory.py                 # 8 blocks, d=256, batch 64 x 128 tokens
    .venv/bin/python bench/fsdp_memory.py --blocks 4 --norm none
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import shardtensor as st  # noqa: E402
from shardtensor.fsdp import FSDPv2, checkpoint_module, transformer_auto_wrap_policy  # noqa: E402
from shardtensor.graph import state  # noqa: E402
from shardtensor.graph.capture import lower  # noqa: E402  (white box: the compiled program of the pending graph)

MiB = 2**20


class Block(nn.Module):
    def __init__(self, d, norm=True):
        super().__init__()
        self.ln = nn.LayerNorm(d) if norm else nn.Identity()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, d, blocks, norm=True):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Block(d, norm) for _ in range(blocks)])

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


def compiled_step():
    """The pending lazy graph, compiled as jax would compile it at sync()."""
    return lower(state.pending_cells(), donate=True).compile()


def memory_mib(compiled) -> dict:
    """A compiled program's ``memory_analysis()`` per device, in MiB; ``peak`` counts an argument
    aliased by an output (donated) once."""
    m = compiled.memory_analysis()
    out = {
        "args": m.argument_size_in_bytes,
        "out": m.output_size_in_bytes,
        "alias": m.alias_size_in_bytes,
        "temp": m.temp_size_in_bytes,
    }
    out["peak"] = out["args"] + out["out"] - out["alias"] + out["temp"]
    return {k: v / MiB for k, v in out.items()}


def checkpointed_wrapper(module, *args, **kwargs):
    """An ``auto_wrapper_callable``: FSDPv2 around the checkpointed block."""
    return FSDPv2(checkpoint_module(module), *args, **kwargs)


def measure(reference: Net, batch: int, seq: int, checkpointed: bool) -> dict:
    """Memory of one recorded SGD step of a copy of ``reference``, then the step's loss."""
    mesh = st.Mesh(range(st.global_runtime_device_count()), (st.global_runtime_device_count(), 1), ("fsdp", "model"))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDPv2(
        copy.deepcopy(reference),
        mesh=mesh,
        auto_wrap_policy=policy,
        auto_wrapper_callable=checkpointed_wrapper if checkpointed else None,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    d = reference.inp.in_features
    x = st.shard(torch.randn(batch, seq, d, generator=g), mesh, ("fsdp", None, None))
    st.sync()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    result = memory_mib(compiled_step())
    st.sync()  # run the step (compiles again through shardtensor's own cache)
    result["loss"] = loss.item()
    result["calls"] = sum(b.calls for b in model.module.blocks)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument(
        "--norm",
        choices=["layernorm", "none", "both"],
        default="both",
        help="pre-norm blocks (LayerNorm first) or plain MLP blocks",
    )
    args = p.parse_args(argv)
    n = st.global_runtime_device_count()
    per_block = args.batch // n * args.seq * 4 * args.d * 4 / MiB
    print(
        f"{args.blocks} blocks, d={args.d}, batch {args.batch} x {args.seq} tokens, mesh ({n}, 1); "
        f"one 4d-wide activation is {per_block:.1f} MiB per device"
    )
    print(
        f"{'block':<10} {'variant':<13} {'temp MiB':>9} {'args':>6} {'out':>6} {'peak MiB':>9} "
        f"{'fwd calls':>9} {'loss':>10}"
    )
    for norm in ["layernorm", "none"] if args.norm == "both" else [args.norm]:
        torch.manual_seed(0)
        reference = Net(args.d, args.blocks, norm=norm == "layernorm")
        results = {}
        for checkpointed in (False, True):
            r = results[checkpointed] = measure(reference, args.batch, args.seq, checkpointed)
            print(
                f"{'pre-norm' if norm == 'layernorm' else 'mlp':<10} "
                f"{'checkpointed' if checkpointed else 'plain':<13} {r['temp']:>9.1f} {r['args']:>6.1f} "
                f"{r['out']:>6.1f} {r['peak']:>9.1f} {r['calls']:>9} {r['loss']:>10.6f}"
            )
        change = results[True]["peak"] / results[False]["peak"] - 1
        same = abs(results[True]["loss"] - results[False]["loss"]) <= 1e-5 * abs(results[False]["loss"])
        print(f"{'':<24} checkpointing: peak {100 * change:+.0f}%, losses equal: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
