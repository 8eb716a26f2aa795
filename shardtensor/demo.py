"""Train a small GPT on 8 simulated CPU devices, its parameters sharded by hand over a (4, 2) mesh.

Run with ``python -m shardtensor.demo`` (``make demo``). The mesh has axes ``('data', 'model')``: the
batch is split over ``data``; the weights are split Megatron-style over ``model`` (q/k/v and the MLP
up-projection by output features, the attention out-projection and MLP down-projection by input
features, the embeddings by feature). XLA inserts every collective. The data is a Markov chain over
the vocabulary, so the loss visibly falls within a few dozen AdamW steps.

Options: ``--steps N`` (default 40) and ``--mode lazy|compile|eager`` (default lazy).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")  # before jax is imported, when run as a script


def _simulate_cpu_devices() -> None:
    """Apply SHARDTENSOR_CPU_DEVICES even though ``python -m shardtensor.demo`` imported the package
    (and jax) before this module: the count still takes effect while no JAX backend has started."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", int(os.environ["SHARDTENSOR_CPU_DEVICES"]))
    except RuntimeError:
        pass  # a backend already started; shardtensor's runtime reports a device-count mismatch


_simulate_cpu_devices()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import shardtensor as st  # noqa: E402

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, BATCH = 256, 32, 64, 4, 2, 16


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """Multi-head causal self-attention of ``x`` (batch, seq, d)."""
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for w in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, transformer blocks, a final norm and a tied LM head."""

    def __init__(self, vocab=VOCAB, seq=SEQ, d=D_MODEL, heads=HEADS, layers=LAYERS):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        nn.init.normal_(self.tok.weight, std=0.02)  # small, since the LM head shares it
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.t()  # logits (batch, seq, vocab)


def partition_spec(name: str, ndim: int) -> tuple:
    """The Megatron-style partition spec of parameter ``name`` on the ('data', 'model') mesh."""
    if name.endswith((".q.weight", ".k.weight", ".v.weight", ".up.weight")):
        return ("model", None)  # split output features (column parallel)
    if name.endswith((".q.bias", ".k.bias", ".v.bias", ".up.bias")):
        return ("model",)
    if name.endswith((".proj.weight", ".down.weight")):
        return (None, "model")  # split input features (row parallel)
    if name in ("tok.weight", "pos"):
        return (None, "model")
    return (None,) * ndim  # norms and row-parallel biases stay replicated


def shard_model(model: nn.Module, mesh: st.Mesh) -> None:
    """Shard every parameter of ``model`` (already on ``st.device()``) in place."""
    for name, p in model.named_parameters():
        st.mark_sharding(p, mesh, partition_spec(name, p.dim()))


def markov_batches(seed: int = 0):
    """Endless (inputs, targets) CPU batches from a fixed sparse Markov chain over the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 2), generator=g)  # each token has 2 possible successors
    while True:
        tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
        for t in range(SEQ):
            choice = torch.randint(0, 2, (BATCH,), generator=g)
            tokens[:, t + 1] = successors[tokens[:, t], choice]
        yield tokens[:, :-1], tokens[:, 1:]


def make_train_step(model: nn.Module, opt: torch.optim.Optimizer):
    """A function (inputs, targets) -> detached loss that does one forward, backward and AdamW update."""

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return train_step


def train(steps: int, mode: str):
    """Train for ``steps`` steps in ``mode``; returns (model, losses, step times in seconds)."""
    from tqdm import tqdm

    torch.manual_seed(0)
    mesh = st.Mesh(range(8), (4, 2), ("data", "model"))
    model = GPT().to(st.device())
    shard_model(model, mesh)
    st.sync()  # move the initial weights into their shards now, not inside the first step
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, capturable=True)
    train_step = make_train_step(model, opt)
    if mode == "compile":
        train_step = st.compile(train_step)
    st.eager_mode(mode == "eager")
    batches = markov_batches()
    losses, times = [], []
    bar = tqdm(range(steps), desc=f"training ({mode})", unit="step")
    for _ in bar:
        x, y = (st.shard(t, mesh, ("data", None)) for t in next(batches))
        start = time.perf_counter()
        with st.step():
            loss = train_step(x, y)
        losses.append(loss.item())  # waits for the step to finish
        times.append(time.perf_counter() - start)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", step=f"{times[-1] * 1000:.0f}ms")
    st.eager_mode(False)
    return model, losses, times


def sharding_table(model: nn.Module):
    """A rich Table of each parameter's name, shape, partition spec and sharding string."""
    from rich.table import Table

    table = Table(title="Parameter shardings on mesh (4, 2) ('data', 'model')")
    for column in ("parameter", "shape", "partition spec", "sharding"):
        table.add_column(column)
    for name, p in model.named_parameters():
        spec = p.partition_spec
        table.add_row(name, str(tuple(p.shape)), str(tuple(spec) if spec is not None else None), p.sharding_spec)
    return table


def main(argv=None) -> int:
    """Parse the options, train, print the summary; non-zero when the loss did not fall."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--mode", choices=("lazy", "compile", "eager"), default="lazy")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the final loss is compared with the first)")
    from rich.console import Console

    model, losses, times = train(args.steps, args.mode)
    console = Console()
    console.width = max(console.width, 120)  # room for the sharding strings when not on a terminal
    console.print(sharding_table(model))
    timed = times[2:] or times
    print(f"compiles (UncachedCompile): {st.counter_value('UncachedCompile') or 0}")
    print(f"median step time: {statistics.median(timed) * 1000:.1f} ms "
          f"(over {len(timed)} steps{', after 2 warm-up steps' if len(times) > 2 else ''})")
    print(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} (uniform guess: {math.log(VOCAB):.4f})")
    if not losses[-1] < losses[0]:
        print(f"error: the loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
