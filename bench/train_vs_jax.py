"""Training steps three ways, interleaved in one process: shardtensor lazy mode, ``st.compile(step)``,
and the same model written directly in JAX (``jax.jit``, donated state). Same initial weights, same
batches, same shardings: FSDP-style on 8 simulated devices (every parameter sharded over 'fsdp' on its
largest dimension, the batch over 'fsdp' too), AdamW.

Prints, per model: median step time and its ratio to JAX, the first step (trace + compile + run; in
this process, after the other runs' first steps: bench/startup.py measures start-up in fresh processes),
Python tracing seconds per step, the losses of the first steps (they must agree), and the collectives
in each compiled program (count and bytes of each kind).

Example::

    .venv/bin/python bench/train_vs_jax.py                 # both models, 20 steps each
    .venv/bin/python bench/train_vs_jax.py --model mlp --steps 10
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as JP  # noqa: E402

import shardtensor as st  # noqa: E402
from gpt_model import GPT, Block  # noqa: E402, F401  (the GPT is shared with bench/checkpoint.py; tvj.Block for fsdp.py)
from shardtensor.explain import collectives_in_hlo  # noqa: E402
from shardtensor.graph import execute  # noqa: E402  (white box: spies on the programs that run)
from shardtensor.runtime import x64_scope  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


# ---- the models, in torch ----------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d=1024, layers=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


# ---- the same models, in JAX (parameters keyed by the torch names) -----------------------------


def _linear(p, name, x):
    return x @ p[name + ".weight"].T + p[name + ".bias"]


def _layer_norm(p, name, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * p[name + ".weight"] + p[name + ".bias"]


def jax_mlp(p, x, layers=4):
    for i in range(layers):
        x = _linear(p, f"layers.{i}", x)
        if i < layers - 1:
            x = jax.nn.relu(x)
    return x


def jax_block(p, pre, x, heads, gelu="none"):
    b, t, d = x.shape
    mask = jnp.tril(jnp.ones((t, t), bool))
    q, k, v = jnp.split(_linear(p, pre + "qkv", _layer_norm(p, pre + "ln1", x)), 3, axis=-1)
    q, k, v = (z.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3) for z in (q, k, v))
    s = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // heads), -jnp.inf)
    y = (jax.nn.softmax(s, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + _linear(p, pre + "proj", y)
    h = jax.nn.gelu(_linear(p, pre + "up", _layer_norm(p, pre + "ln2", x)), approximate=gelu == "tanh")
    return x + _linear(p, pre + "down", h)


def jax_gpt(p, idx, heads=4, layers=4, remat=False, gelu="none"):
    """The GPT; ``remat`` wraps each block in ``jax.checkpoint`` (JAX's gradient checkpointing);
    ``gelu``: F.gelu's ``approximate``."""
    block = jax.checkpoint(jax_block, static_argnums=(1, 3, 4)) if remat else jax_block
    x = p["tok.weight"][idx] + p["pos"][: idx.shape[1]]
    for i in range(layers):
        x = block(p, f"blocks.{i}.", x, heads, gelu)
    return _layer_norm(p, "ln_f", x) @ p["tok.weight"].T


def jax_cross_entropy(logits, targets, ignore_index=-100):
    """F.cross_entropy's math: the mean over the targets that are not ``ignore_index``."""
    logp = jax.nn.log_softmax(logits.reshape(-1, logits.shape[-1]), axis=-1)
    t = targets.reshape(-1)
    valid = t != ignore_index
    picked = jnp.take_along_axis(logp, jnp.where(valid, t, 0)[:, None], axis=-1)[:, 0]
    return -jnp.sum(jnp.where(valid, picked, 0)) / jnp.sum(valid)


def jax_adamw(params, grads, m, v, step):
    step = step + 1
    bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    new_p, new_m, new_v = {}, {}, {}
    for k in params:
        g = grads[k]
        new_m[k] = BETAS[0] * m[k] + (1 - BETAS[0]) * g
        new_v[k] = BETAS[1] * v[k] + (1 - BETAS[1]) * g * g
        p = params[k] * (1 - LR * WD)
        new_p[k] = p - (LR / bc1) * new_m[k] / (jnp.sqrt(new_v[k]) / jnp.sqrt(bc2) + EPS)
    return new_p, new_m, new_v, step


# ---- shardings ---------------------------------------------------------------------------------


def fsdp_spec(shape):
    """'fsdp' on the largest dimension (ties: the lowest index); scalars replicated."""
    if not shape:
        return ()
    d = max(range(len(shape)), key=lambda i: (shape[i], -i))
    return tuple("fsdp" if i == d else None for i in range(len(shape)))


# ---- collectives in a compiled program ---------------------------------------------------------

# kind -> (count, bytes of the per-device result buffers) of every collective instruction; the
# same parser st.explain uses
collectives = collectives_in_hlo


def describe(c: dict) -> str:
    parts = [f"{k} {n} ({b / 1e6:.2f} MB)" for k, (n, b) in c.items() if n]
    total = f"; in all {sum(n for n, _ in c.values())} ({sum(b for _, b in c.values()) / 1e6:.2f} MB)"
    return ", ".join(parts) + total if parts else "none"


class ProgramSpy:
    """Remembers the largest program shardtensor ran (to read its compiled HLO)."""

    def __init__(self):
        self.largest = None
        self._orig = execute.call_executable

    def __enter__(self):
        def spy(fn, arrays, scalars, *rest):
            size = len(fn.program.steps)
            if self.largest is None or size > self.largest[0]:
                avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in arrays]
                vecs = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in scalars.items()}
                self.largest = (size, fn, avals, vecs)
            return self._orig(fn, arrays, scalars, *rest)

        execute.call_executable = spy
        return self

    def __exit__(self, *exc):
        execute.call_executable = self._orig

    def hlo(self) -> str:
        _, fn, avals, vecs = self.largest
        program = fn.program
        donated = [avals[i] for i in program.donated]
        kept = [avals[i] for i in program.kept]
        with x64_scope():  # lowered as shardtensor lowers it: with 64-bit types (int64 stays int64)
            return fn.lower(donated, kept, vecs).compile().as_text()


# ---- the three ways ----------------------------------------------------------------------------


def make_batches(kind, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if kind == "mlp":
            out.append((torch.randn(256, 1024, generator=g), torch.randint(0, 1024, (256,), generator=g)))
        else:
            tokens = torch.randint(0, 1024, (16, 129), generator=g)
            out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


class ShardtensorRun:
    """One training step, lazy (``st.step()``) or ``st.compile``d. ``model``: one already on the
    devices and sharded (bench/fsdp.py's FSDPv2 GPT); else the MLP or GPT, FSDP-style. ``capturable``:
    AdamW's step counts on the devices (True) or on the host."""

    def __init__(self, kind, state_dict, mesh, compiled, model=None, capturable=True):
        if model is None:
            model = (MLP() if kind == "mlp" else GPT()).to(st.device())
            model.load_state_dict(state_dict)
            for p in model.parameters():
                st.mark_sharding(p, mesh, fsdp_spec(tuple(p.shape)))
        self.model = model
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, capturable=capturable
        )
        self.mesh, self.kind, self.compiled = mesh, kind, compiled
        self.trace_seconds = []
        self.step_fn = st.compile(self.record_step) if compiled else self.record_step
        st.sync()

    def record_step(self, x, y):
        out = self.model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def shard_batch(self, x, y):
        """The batch split over 'fsdp' on its first dimension."""
        return tuple(st.shard(t, self.mesh, ("fsdp",) + (None,) * (t.dim() - 1)) for t in (x, y))

    def __call__(self, x, y):
        xs, ys = self.shard_batch(x, y)
        t0 = time.perf_counter()
        loss = self.step_fn(xs, ys)
        if not self.compiled:
            self.trace_seconds.append(time.perf_counter() - t0)
            st.sync()  # the step boundary: the recorded step runs now
        return float(loss.cpu())


class JaxRun:
    def __init__(self, kind, state_dict, jmesh, remat=False):
        def shard(a):
            return jax.device_put(a, NamedSharding(jmesh, JP(*fsdp_spec(a.shape))))

        self.params = {k: shard(jnp.asarray(v.numpy())) for k, v in state_dict.items()}
        self.m = {k: jnp.zeros_like(v) for k, v in self.params.items()}
        self.v = {k: jnp.zeros_like(v) for k, v in self.params.items()}
        # committed to the mesh like the step's output, so that step 2 reuses step 1's program (an
        # uncommitted scalar here makes jit compile the step twice)
        self.count = jax.device_put(jnp.zeros((), jnp.float32), NamedSharding(jmesh, JP()))
        self.jmesh = jmesh
        forward = jax_mlp if kind == "mlp" else functools.partial(jax_gpt, remat=remat)

        def step(params, m, v, count, x, y):
            loss, grads = jax.value_and_grad(lambda p: jax_cross_entropy(forward(p, x), y))(params)
            params, m, v, count = jax_adamw(params, grads, m, v, count)
            return params, m, v, count, loss

        self.step = step
        self.jitted = jax.jit(step, donate_argnums=(0, 1, 2, 3))
        self.trace_seconds = []

    def time_trace(self, x, y):
        """Times JAX's trace of one step: a fresh jit (no trace cache hit), not run. Called beside
        shardtensor's recording of the same step (outside the timed step), so that the machine's load
        affects both alike."""
        xb, yb = self._batch(x, y)
        fresh = jax.jit(lambda *args: self.step(*args), donate_argnums=(0, 1, 2, 3))
        t0 = time.perf_counter()
        fresh.trace(self.params, self.m, self.v, self.count, xb, yb)
        self.trace_seconds.append(time.perf_counter() - t0)

    def _batch(self, x, y):
        def put(a):
            return jax.device_put(a.numpy(), NamedSharding(self.jmesh, JP("fsdp", *([None] * (a.dim() - 1)))))

        return put(x), put(y)

    def __call__(self, x, y):
        xb, yb = self._batch(x, y)
        self.params, self.m, self.v, self.count, loss = self.jitted(self.params, self.m, self.v, self.count, xb, yb)
        return float(loss)

    def hlo(self, x, y):
        xb, yb = self._batch(x, y)
        return self.jitted.lower(self.params, self.m, self.v, self.count, xb, yb).compile().as_text()


def bench(kind, steps):
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in (MLP() if kind == "mlp" else GPT()).state_dict().items()}
    mesh = st.Mesh(range(8), (8,), ("fsdp",))
    jmesh = mesh.get_jax_mesh()
    batches = make_batches(kind, steps)
    runs = {
        "lazy": ShardtensorRun(kind, state, mesh, compiled=False),
        "compile": ShardtensorRun(kind, state, mesh, compiled=True),
        # torch's default AdamW (step counts on the host), as a new user writes it
        "compile-def": ShardtensorRun(kind, state, mesh, compiled=True, capturable=False),
        "jax": JaxRun(kind, state, jmesh),
    }
    times = {k: [] for k in runs}
    losses = {k: [] for k in runs}
    spies = {}
    for i, (x, y) in enumerate(batches):
        for name, run in runs.items():  # interleaved: the machine's state affects all three alike
            spy = ProgramSpy() if name != "jax" and i == 1 else None
            t0 = time.perf_counter()
            if spy:
                with spy:
                    loss = run(x, y)
                spies[name] = spy
            else:
                loss = run(x, y)
            times[name].append(time.perf_counter() - t0)
            losses[name].append(loss)
            if name == "jax":
                run.time_trace(x, y)
    med = {k: statistics.median(v[2:]) for k, v in times.items()}
    print(f"\n== {kind}: {steps} steps, 8 devices, FSDP-style ('fsdp' axis of 8), AdamW")
    print(f"{'':10s} {'median step':>12s} {'x JAX':>7s} {'first step':>11s} {'tracing/step':>13s}")
    for name in runs:
        traced = runs[name].trace_seconds[2:]
        tracing = statistics.median(traced) if traced else float("nan")
        print(
            f"{name:10s} {med[name] * 1e3:10.1f}ms {med[name] / med['jax']:7.2f} {times[name][0]:10.2f}s "
            f"{tracing * 1e3:11.1f}ms"
        )
    trace_ratio = statistics.median(runs["lazy"].trace_seconds[2:]) / statistics.median(runs["jax"].trace_seconds[2:])
    print(
        f"tracing: lazy records {trace_ratio:.2f}x"
        " JAX's own trace (jax.jit(...).trace) per step; st.compile replays a frozen program after two "
        f"traces (CompileReplay={st.counter_value('CompileReplay')})"
    )
    print("losses (first 3):", {k: [round(v, 5) for v in run[:3]] for k, run in losses.items()})
    print(
        "max |loss - JAX loss|:",
        {k: f"{max(abs(a - b) for a, b in zip(run, losses['jax'])):.2e}" for k, run in losses.items() if k != "jax"},
    )
    x, y = batches[-1]
    print("collectives (count, per-device result bytes):")
    print(f"  jax      {describe(collectives(runs['jax'].hlo(x, y)))}")
    for name, spy in spies.items():
        print(f"  {name:8s} {describe(collectives(spy.hlo()))}")
    return med


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["mlp", "gpt", "both"], default="both")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    print(f"jax {jax.__version__}, torch {torch.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices")
    for kind in ["mlp", "gpt"] if a.model == "both" else [a.model]:
        bench(kind, a.steps)


if __name__ == "__main__":
    main()
