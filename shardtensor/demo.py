"""Train a small GPT with FSDPv2 on 8 simulated CPU devices, fed by MpDeviceLoader.

Run with ``python -m shardtensor.demo`` (``make demo``). The recipe is PyTorch/XLA's FSDPv2 one:

* a mesh with an ``'fsdp'`` axis (default shape ``(8, 1)``, axes ``('fsdp', 'model')``), made the
  global mesh;
* the model wrapped in ``FSDPv2`` with ``transformer_auto_wrap_policy``, so each transformer block
  gets its own wrapper: every parameter is sharded over ``'fsdp'`` on its largest dimension and each
  block's output on its batch dimension; XLA inserts the all-gathers and reduce-scatters;
* a torch ``DataLoader`` over a dataset of token sequences drawn from a fixed Markov chain over the
  vocabulary (so the loss visibly falls within a few dozen steps), wrapped in ``st.MpDeviceLoader``
  with ``input_sharding=st.ShardingSpec(mesh, ('fsdp', None))``: batches arrive split over
  ``'fsdp'``, uploaded by a background thread;
* AdamW with ``capturable=True`` (its step count lives on the devices, so the program does not
  change from step to step: the first step compiles, as it also creates the optimizer state, the
  second compiles the steady step, and the rest reuse it).

A progress bar shows the loss and tokens/s; at the end the demo prints the loss curve, the number of
compilations (``UncachedCompile``), the median step time and the parameter bytes held by one device
against the unsharded model's. It exits non-zero if the loss did not fall.

Options:

* ``--steps N``: training steps (default 200, about a minute on 2 CPU cores, most of it compiling);
* ``--mesh F,M``: the sizes of the ``('fsdp', 'model')`` axes, e.g. ``8,1`` or ``4,2`` (FSDPv2 shards
  over ``'fsdp'`` only; ``'model'`` replicates); one number gives a 1-D ``('fsdp',)`` mesh; default:
  every device on ``'fsdp'``;
* ``--platform cpu|cuda|tpu``: sets ``SHARDTENSOR_PLATFORM`` before JAX starts its backend (default:
  that variable, else JAX's choice); on cpu, ``SHARDTENSOR_CPU_DEVICES`` (default: the mesh's size,
  8 without ``--mesh``) devices are simulated;
* ``--mode lazy|compile|eager``: lazy (default) records each step, which runs as one program when
  its loss is read; compile runs ``st.compile(train_step)``; eager runs each op
  at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardtensor as st  # starts no JAX backend: --platform can still choose it
from shardtensor.fsdp import FSDPv2, transformer_auto_wrap_policy

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, BATCH = 256, 32, 64, 4, 2, 16
LR, WEIGHT_DECAY = 3e-3, 0.01
DEFAULT_STEPS = 200


# --------------------------------------------------------------------------- the model (plain torch)


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


def build_model(seed: int = 0) -> GPT:
    """The GPT on the CPU, initialised from ``seed`` (the same weights every time)."""
    torch.manual_seed(seed)
    return GPT()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------- the data (plain torch)


class MarkovDataset(torch.utils.data.Dataset):
    """``size`` token sequences (inputs, next-token targets) of a fixed sparse Markov chain: each of
    the ``vocab`` tokens has 2 possible successors, so a model can learn to ~log(2) nats per token.
    Sequence ``i`` depends on ``seed`` and ``i`` only (not on ``size``)."""

    CHUNK = 256  # sequences drawn from one generator

    def __init__(self, size: int, seq: int = SEQ, vocab: int = VOCAB, seed: int = 0):
        successors = torch.randint(0, vocab, (vocab, 2), generator=torch.Generator().manual_seed(seed))
        chunks = []
        for c in range(-(-size // self.CHUNK)):
            g = torch.Generator().manual_seed(seed * 1_000_003 + c + 1)
            tokens = torch.empty(self.CHUNK, seq + 1, dtype=torch.long)
            tokens[:, 0] = torch.randint(0, vocab, (self.CHUNK,), generator=g)
            choices = torch.randint(0, 2, (self.CHUNK, seq), generator=g)
            for t in range(seq):
                tokens[:, t + 1] = successors[tokens[:, t], choices[:, t]]
            chunks.append(tokens)
        self.tokens = torch.cat(chunks)[:size] if chunks else torch.empty(0, seq + 1, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i, :-1], self.tokens[i, 1:]


def make_loader(steps: int, batch: int = BATCH, seed: int = 0) -> torch.utils.data.DataLoader:
    """A DataLoader of exactly ``steps`` batches (in order, so a reference run sees the same ones)."""
    return torch.utils.data.DataLoader(
        MarkovDataset(steps * batch, seed=seed), batch_size=batch, shuffle=False, drop_last=True
    )


def make_optimizer(params, capturable: bool = True) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, capturable=capturable)


# --------------------------------------------------------------------------- platform start-up


def _start_platform(platform: str | None, devices: int | None) -> None:
    """Apply ``--platform`` and the simulated CPU device count before JAX starts its backend.

    ``python -m shardtensor.demo`` imports the package (and so jax) before this module runs, but
    JAX's platform and CPU device count still take effect while no backend has started. When one
    has (e.g. the demo is imported into a test), shardtensor's runtime checks the request instead and
    raises if it cannot be met.
    """
    if platform:
        os.environ["SHARDTENSOR_PLATFORM"] = platform
    if (
        platform in (None, "cpu")
        and devices
        and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
    ):
        os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", str(devices))
    from shardtensor import runtime

    runtime._configure_jax()  # idempotent: applies the environment or checks the running backend


# --------------------------------------------------------------------------- training


@dataclasses.dataclass
class Result:
    """What a training run measured."""

    model: nn.Module
    losses: list  # per step
    times: list  # seconds per step (batch handed out -> loss on the host)
    compiles: list  # UncachedCompile counter after each step (since the run started)
    bytes_per_device: int  # parameter bytes on the first device (padded shards)
    bytes_total: int  # the unsharded model's parameter bytes


def parameter_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the parameters held by the first device, bytes of the unsharded parameters)."""

    per_device = total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        if isinstance(p, st.ShardedTensor):
            shard = p.local_shards[0]  # the shards are sorted by device id
            per_device += shard.data.numel() * shard.data.element_size()
        else:
            per_device += p.numel() * p.element_size()
    return per_device, total


def train(
    steps: int = DEFAULT_STEPS, mode: str = "lazy", mesh_shape=(8, 1), seed: int = 0, progress: bool = True
) -> Result:
    """Train the FSDPv2-wrapped GPT for ``steps`` steps in ``mode`` on a mesh of ``mesh_shape``."""
    from tqdm.auto import tqdm  # a widget in Jupyter, a text bar in a terminal

    mesh_shape = tuple(mesh_shape)
    axes = ("fsdp", "model")[: len(mesh_shape)]
    mesh = st.Mesh(range(math.prod(mesh_shape)), mesh_shape, axes)
    previous_mesh = st.get_global_mesh()
    st.set_global_mesh(mesh)
    try:
        # Each Block gets its own FSDPv2; the root wraps the rest (embeddings, final norm).
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        model = FSDPv2(build_model(seed), auto_wrap_policy=policy)
        st.sync()  # the initial weights go to their shards now, not inside the first step
        opt = make_optimizer(model.parameters())

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        if mode == "compile":
            train_step = st.compile(train_step)
        loader = st.MpDeviceLoader(
            make_loader(steps, seed=seed), st.device(), input_sharding=st.ShardingSpec(mesh, ("fsdp", None))
        )
        compiles_before = st.counter_value("UncachedCompile") or 0
        losses, times, compiles = [], [], []
        bar = tqdm(loader, desc=f"FSDPv2 {mode} on {mesh_shape}", unit="step", disable=not progress, dynamic_ncols=True)
        with st.eager_mode(mode == "eager"):
            start = time.perf_counter()
            for x, y in bar:  # the loader syncs before each batch: in lazy mode, one program per step
                loss = train_step(x, y)
                losses.append(loss.item())  # waits for the step to finish
                now = time.perf_counter()
                times.append(now - start)
                start = now
                compiles.append((st.counter_value("UncachedCompile") or 0) - compiles_before)
                recent = statistics.median(times[-10:])  # steadier than the last step alone
                bar.set_postfix(loss=f"{losses[-1]:.3f}", tokens_per_s=f"{x.numel() / recent:,.0f}")
        per_device, total = parameter_bytes(model)
        return Result(model, losses, times, compiles, per_device, total)
    finally:
        st.set_global_mesh(previous_mesh)


# --------------------------------------------------------------------------- the summary

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values, width: int = 60) -> str:
    """``values`` as a one-line bar chart, averaged into at most ``width`` buckets."""
    n, width = len(values), min(len(values), width)
    means = [statistics.fmean(values[i * n // width : (i + 1) * n // width]) for i in range(width)]
    lo, hi = min(means), max(means)
    scale = (len(_BARS) - 1) / (hi - lo) if hi > lo else 0.0
    return "".join(_BARS[round((m - lo) * scale)] for m in means)


def _fmt_bytes(n: int) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 2**20 else f"{n / 2**20:,.2f} MiB"


def summary(result: Result, mesh_shape) -> str:
    """The text printed at the end of the demo."""

    losses, times = result.losses, result.times
    warm = min(2, len(times) - 1)
    timed = times[warm:]
    after_warmup = result.compiles[-1] - result.compiles[warm - 1] if warm else result.compiles[-1]
    devices = math.prod(mesh_shape)
    median = statistics.median(timed)
    lines = [
        f"loss per step: {losses[0]:.3f} {sparkline(losses)} {losses[-1]:.3f}  "
        f"(min {min(losses):.3f}; uniform guess {math.log(VOCAB):.3f}, chain entropy {math.log(2):.3f})",
        f"compiles (UncachedCompile): {result.compiles[-1]} in the training loop, {after_warmup} after the first "
        f"{warm} steps ({st.counter_value('UncachedCompile') or 0} in the whole process)",
        f"median step time: {median * 1000:.1f} ms = {BATCH * SEQ / median:,.0f} tokens/s "
        f"(over {len(timed)} step{'s' * (len(timed) != 1)}, after {warm} warm-up steps)",
        f"parameter bytes per device: {_fmt_bytes(result.bytes_per_device)} of {_fmt_bytes(result.bytes_total)} "
        f"unsharded (1/{result.bytes_total / result.bytes_per_device:.2f}; {devices} devices, "
        f"'fsdp' axis of {mesh_shape[0]})",
    ]
    return "\n".join(lines)


def _parse_mesh(text: str) -> tuple:
    try:
        shape = tuple(int(s) for s in text.replace("x", ",").split(",") if s.strip())
    except ValueError:
        shape = ()
    if not 1 <= len(shape) <= 2 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--mesh wants 1 or 2 positive sizes like 8,1 or 4,2; got {text!r}")
    return shape


def main(argv=None) -> int:
    """Parse the options, train, print the summary; non-zero when the loss did not fall."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})")
    parser.add_argument(
        "--mesh",
        type=_parse_mesh,
        default=None,
        help="sizes of the ('fsdp', 'model') axes, e.g. 8,1 or 4,2 (default: all devices, 1)",
    )
    parser.add_argument(
        "--platform",
        choices=("cpu", "cuda", "tpu"),
        default=None,
        help="the PJRT platform (default: SHARDTENSOR_PLATFORM, else JAX's choice)",
    )
    parser.add_argument("--mode", choices=("lazy", "compile", "eager"), default="lazy")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (two warm-up steps, then timed ones)")

    _start_platform(args.platform, math.prod(args.mesh) if args.mesh else 8)
    import jax

    mesh_shape = args.mesh or (jax.device_count(), 1)
    if math.prod(mesh_shape) > jax.device_count():
        parser.error(
            f"--mesh {mesh_shape} needs {math.prod(mesh_shape)} devices; "
            f"{jax.default_backend()} has {jax.device_count()}"
        )

    result = train(args.steps, args.mode, mesh_shape)
    print(
        f"\nFSDPv2 GPT ({sum(p.numel() for p in result.model.parameters()):,} parameters, {LAYERS} blocks) "
        f"on {jax.device_count()} {jax.default_backend()} device(s), mesh {mesh_shape} "
        f"{('fsdp', 'model')[: len(mesh_shape)]}, mode {args.mode}, {args.steps} steps of {BATCH}x{SEQ} tokens"
    )
    print(summary(result, mesh_shape))
    if not result.losses[-1] < result.losses[0]:
        print(f"error: the loss did not fall ({result.losses[0]:.4f} -> {result.losses[-1]:.4f})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
