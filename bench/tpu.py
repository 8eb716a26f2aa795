"""The TPU bench (issues 36 and 37): shardtensor against plain JAX on one chip, in one process.

Sections (each a flag; none given: --gpt --f32 --attention):

* ``--gpt``: the bf16 GPT of issue 36 (169M parameters: d=1024, 8 layers, 16 heads, T=1024, batch 8,
  vocab 32768, bf16 parameters, ``F.scaled_dot_product_attention(is_causal=True)``, tanh GELU, torch
  AdamW) trained in every mode: plain ``jax.jit`` with donated state (the anchor), ``st.compile``
  with ``AdamW(capturable=True)``, lazy ``with st.step()`` + ``loss.item()`` each step, lazy with 10
  steps before one read, ``st.compile`` with the default AdamW; then forward only (the loss under
  ``torch.no_grad``), ``st.compile`` against ``jax.jit``.
* ``--f32``: the float32 GPT (d=768, 6 layers, 12 heads, T=512, batch 8) with ``st.compile`` at each
  ``torch.set_float32_matmul_precision`` against ``jax.jit`` at the matching JAX precision.
* ``--attention``: causal attention forward + backward at T=2048 (bf16, batch 4, 16 heads, head 64):
  ``st.kernels.flash_attention`` (Pallas) and ``F.scaled_dot_product_attention`` through shardtensor,
  against ``jax.nn.dot_product_attention`` and the same Pallas kernel under ``jax.jit``.
* ``--startup`` (issue 37 §4): the first training step of a new process with a warm persistent cache
  (bench/startup.py's GPT, each configuration in two fresh processes sharing a new cache directory,
  the second timed): plain JAX against lazy and ``st.compile``. Runs first, before this process
  opens the chip (one process at a time can hold it).
* ``--llama`` (issue 37): a Hugging Face ``LlamaForCausalLM`` of ~168M parameters, lazy against
  ``st.compile`` (MFU), and ``st.generate`` tokens/s at batch 1 and 8 against a plain-JAX greedy
  decode loop of the same weights with a static KV cache (``jax.jit`` step). Needs transformers
  (``TPU_SETUP_HF=1 source bench/tpu_setup.sh``); ``--llama-training-only`` or
  ``--llama-generate-only`` runs one half.

Times are per step: the mean over ``--steps`` steps after warm-up steps, with one read of the result
at the end (the chip runs ahead of the host as it can), except where a mode reads each step. MFU is
the model's FLOPs (6 N + 12 L T d per token for training, a third of it forward; N the product
parameters) per second over ``--peak`` (197 TFLOP/s: a v5e's bf16 peak). On a CPU, ``--tiny``
shrinks every model (for debugging the bench; the numbers mean nothing).

Example (on the TPU machine)::

    source bench/tpu_setup.sh && python3 bench/tpu.py --gpt
    python3 bench/tpu.py --tiny            # on a CPU, all sections, tiny sizes
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import sys
import time

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "1")  # one device, like the chip (train_vs_jax sets 8)
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import shardtensor as st  # noqa: E402
from gpt_model import GPT  # noqa: E402
from shardtensor.graph import early_rows  # noqa: E402
from shardtensor.ops.checks import checks_enabled  # noqa: E402
from train_vs_jax import BETAS, EPS, LR, WD  # noqa: E402  (AdamW's settings, as the CPU bench)

SIZES = {
    # name: (vocab, seq, d, heads, layers, batch, dtype)
    "bf16": (32768, 1024, 1024, 16, 8, 8, torch.bfloat16),
    "f32": (32768, 512, 768, 12, 6, 8, torch.float32),
}
TINY = {
    "bf16": (512, 64, 64, 4, 2, 2, torch.bfloat16),
    "f32": (512, 64, 64, 4, 2, 2, torch.float32),
}
ATTENTION = (4, 16, 2048, 64)  # batch, heads, seq, head_dim
TINY_ATTENTION = (1, 2, 128, 32)
JAX_PRECISION = {"highest": "highest", "high": "high", "medium": "default"}
ROWS: list[tuple] = []  # (section, name, ms, ratio, mfu, note) printed at the end


def row(section, name, seconds, anchor=None, flops=None, note=""):
    ratio = f"{seconds / anchor:.2f}" if anchor else ""
    mfu = f"{100 * flops / seconds / ARGS.peak:.1f}%" if flops and ARGS.peak else ""
    ROWS.append((section, name, f"{seconds * 1e3:.1f}", ratio, mfu, note))
    print(f"  {name:58s} {seconds * 1e3:9.1f} ms {ratio:>6s} {mfu:>7s}  {note}", flush=True)


# ---- the GPT in plain JAX, with torch's bf16 numerics (norms, softmax, GELU and loss in float32) ---


def _linear(p, name, x):
    return x @ p[name + ".weight"].T + p[name + ".bias"]


def _layer_norm(p, name, x):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + 1e-5)
    return (y * p[name + ".weight"].astype(jnp.float32) + p[name + ".bias"].astype(jnp.float32)).astype(x.dtype)


def _block(p, pre, x, heads):
    b, t, d = x.shape
    q, k, v = jnp.split(_linear(p, pre + "qkv", _layer_norm(p, pre + "ln1", x)), 3, axis=-1)
    q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
    x = x + _linear(p, pre + "proj", y)
    h = _linear(p, pre + "up", _layer_norm(p, pre + "ln2", x))
    return x + _linear(p, pre + "down", jax.nn.gelu(h.astype(jnp.float32), approximate=True).astype(h.dtype))


def jax_gpt(p, idx, heads, layers):
    x = p["tok.weight"][idx] + p["pos"][: idx.shape[1]]
    for i in range(layers):
        x = _block(p, f"blocks.{i}.", x, heads)
    return _layer_norm(p, "ln_f", x) @ p["tok.weight"].T


def jax_loss(p, idx, targets, heads, layers):
    logits = jax_gpt(p, idx, heads, layers).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits.reshape(-1, logits.shape[-1]), axis=-1)
    return -jnp.take_along_axis(logp, targets.reshape(-1, 1), axis=-1).mean()


def jax_adamw(params, grads, m, v, step):
    """torch's AdamW (train_vs_jax.jax_adamw's math) keeping each parameter's dtype: the bias
    corrections, float32 like torch's step, are cast to it (bf16 state stays bf16, as in torch)."""
    step = step + 1
    bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    new_p, new_m, new_v = {}, {}, {}
    for k, p in params.items():
        g, dt = grads[k], p.dtype
        new_m[k] = BETAS[0] * m[k] + (1 - BETAS[0]) * g
        new_v[k] = BETAS[1] * v[k] + (1 - BETAS[1]) * g * g
        denom = jnp.sqrt(new_v[k]) / jnp.sqrt(bc2).astype(dt) + EPS
        new_p[k] = p * (1 - LR * WD) - (LR / bc1).astype(dt) * new_m[k] / denom
    return new_p, new_m, new_v, step


def gpt_flops(vocab, seq, d, layers, batch, training=True):
    """6 N + 12 L T d per token (N: the product parameters, the tied head included); a third forward."""
    n = layers * 12 * d * d + d * vocab
    per_token = 6 * n + 12 * layers * seq * d
    return batch * seq * per_token / (1 if training else 3)


# ---- runs ---------------------------------------------------------------------------------------


def _batches(vocab, seq, batch, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _timed(run_step, batches, warmup, steps, read):
    """Seconds per step over ``steps`` steps after ``warmup``; ``read`` waits for a step's result."""
    for x, y in batches[:warmup]:
        last = run_step(x, y)
    first_loss = float(read(last))
    if ARGS.gc_freeze:  # what is alive after the warm-up is never scanned by the collector again
        gc.freeze()
    t0 = time.perf_counter()
    for i in range(steps):
        x, y = batches[warmup + i % (len(batches) - warmup)]
        last = run_step(x, y)
    read(last)
    seconds = (time.perf_counter() - t0) / steps
    if ARGS.timeline:  # the same steps once more, under the profiler: the device's programs and idle time
        import timeline  # noqa: PLC0415

        def profiled():
            for i in range(steps):
                x, y = batches[warmup + i % (len(batches) - warmup)]
                out = run_step(x, y)
            read(out)

        print(f"  timeline ({steps} steps, {seconds * 1e3:.1f} ms a step unprofiled):", flush=True)
        print(timeline.summary(timeline.traced(profiled), steps), flush=True)
    if ARGS.gc_freeze:
        gc.unfreeze()
    return seconds, first_loss


class TorchTrainer:
    """The GPT on st.device() with torch AdamW; ``step`` records one training step."""

    def __init__(self, state, size, capturable):
        vocab, seq, d, heads, layers, _, dtype = size
        self.model = GPT(vocab, seq, d, heads, layers, gelu="tanh").to(dtype)
        self.model.load_state_dict(state)
        self.model.to(st.device())
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, capturable=capturable
        )
        st.sync()

    def step(self, x, y):
        out = self.model(x)
        loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def forward_loss(self, x, y):
        with torch.no_grad():
            out = self.model(x)
            return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def _device_batches(batches):
    out = [(x.to(st.device()), y.to(st.device())) for x, y in batches]
    st.sync()
    return out


def _jax_state(state, dtype):
    # committed to the chip like the step's outputs, so that step 2 reuses step 1's program
    jd = jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32
    dev = jax.devices()[0]
    params = {k: jax.device_put(np.asarray(v.float().numpy(), jd), dev) for k, v in state.items()}
    m = {k: jax.device_put(jnp.zeros(v.shape, jd), dev) for k, v in params.items()}
    v = {k: jax.device_put(jnp.zeros(v.shape, jd), dev) for k, v in params.items()}
    return params, m, v, jax.device_put(np.zeros((), np.float32), dev)


def jax_train_step(size):
    _, _, _, heads, layers, _, _ = size

    def step(params, m, v, count, x, y):
        loss, grads = jax.value_and_grad(jax_loss)(params, x, y, heads, layers)
        params, m, v, count = jax_adamw(params, grads, m, v, count)
        return params, m, v, count, loss

    return jax.jit(step, donate_argnums=(0, 1, 2, 3))


def _jax_batches(batches):
    return [
        (jax.device_put(x.numpy().astype(np.int32)), jax.device_put(y.numpy().astype(np.int32))) for x, y in batches
    ]


def time_jax_training(state, size, batches, precision=None):
    jitted = jax_train_step(size)
    box = list(_jax_state(state, size[6]))
    jb = _jax_batches(batches)
    index = {id(b[0]): i for i, b in enumerate(batches)}

    def run(x, y):
        xb, yb = jb[index[id(x)]]
        *box[:4], loss = jitted(*box[:4], xb, yb)
        return loss

    with jax.default_matmul_precision(precision) if precision else _nullcontext():
        # (the loss read to the host, as shardtensor's rows read it with loss.item())
        seconds, loss = _timed(run, batches, ARGS.warmup, ARGS.steps, lambda v: float(v))
    return seconds, loss


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def xla_attention():
    """torch's SDPA backends without flash: shardtensor's SDPA stays XLA's attention on a TPU (the
    program JAX's jax.jit builds), instead of JAX's Pallas splash kernel (MATH: for CPU tensors)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.OVERRIDEABLE, SDPBackend.MATH])


def time_st_training(state, size, batches, mode):
    """mode: 'compile' (capturable AdamW), 'compile-default', 'lazy-item', 'lazy-10', each with XLA's
    attention; 'compile-splash': 'compile' with SDPA through the splash kernel (a TPU's default);
    'compile-async': 'compile' with ``raise_on_call=False``; 'compile-nochecks': 'compile' with
    ``st.set_checks(False)`` (no on-device checks, so nothing to wait for: JAX's program has none)."""
    if mode == "compile-nochecks":
        before = checks_enabled()
        st.set_checks(False)
        try:
            return time_st_training(state, size, batches, "compile")
        finally:
            st.set_checks(before)
    if mode != "compile-splash":
        with xla_attention():
            return _time_st_training(state, size, batches, mode)
    return _time_st_training(state, size, batches, "compile")


def _time_st_training(state, size, batches, mode):
    trainer = TorchTrainer(state, size, capturable=mode != "compile-default")
    dev = _device_batches(batches)
    index = {id(b[0]): i for i, b in enumerate(batches)}
    if mode.startswith("compile"):
        # compile-async: a call returns at dispatch (a failed check raises on the next call), so the
        # host records call n+1 while the chip runs call n, as jax.jit's; the default waits for each
        compiled = st.compile(trainer.step, raise_on_call=mode != "compile-async")

        def run(x, y):
            return compiled(*dev[index[id(x)]])

        def read(loss):
            frozen = next(iter(compiled._frozen.values()), None)
            if frozen is not None and frozen.executable is not None:  # (graph/early_rows.py)
                print(f"  ({mode}: check rows' own program used: {early_rows.used(frozen.executable)})", flush=True)
            return loss.item()

    elif mode == "lazy-item":

        def run(x, y):
            with st.step():
                loss = trainer.step(*dev[index[id(x)]])
            loss.item()
            return loss

        read = lambda loss: loss.item()  # noqa: E731
    else:  # lazy, reads only at the end

        def run(x, y):
            with st.step():
                return trainer.step(*dev[index[id(x)]])

        read = lambda loss: loss.item()  # noqa: E731
    return _timed(run, batches, ARGS.warmup, ARGS.steps, read)


def time_forward(state, size, batches):
    _, _, _, heads, layers, _, dtype = size
    jd = jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32
    params = {k: jnp.asarray(v.float().numpy(), jd) for k, v in state.items()}
    jb = _jax_batches(batches)
    index = {id(b[0]): i for i, b in enumerate(batches)}
    fwd = jax.jit(functools.partial(jax_loss, heads=heads, layers=layers))
    jax_s, jax_loss_v = _timed(
        lambda x, y: fwd(params, *jb[index[id(x)]]), batches, ARGS.warmup, ARGS.steps, lambda v: float(v)
    )
    trainer = TorchTrainer(state, size, capturable=True)
    dev = _device_batches(batches)
    compiled = st.compile(trainer.forward_loss)
    with xla_attention():
        st_s, st_loss = _timed(
            lambda x, y: compiled(*dev[index[id(x)]]), batches, ARGS.warmup, ARGS.steps, lambda v: v.item()
        )
    return jax_s, st_s, float(jax_loss_v), st_loss


def gpt_section():
    size = (TINY if ARGS.tiny else SIZES)["bf16"]
    vocab, seq, d, heads, layers, batch, dtype = size
    torch.manual_seed(0)
    model = GPT(vocab, seq, d, heads, layers, gelu="tanh").to(dtype)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n_params = sum(v.numel() for v in state.values())
    batches = _batches(vocab, seq, batch, ARGS.warmup + min(ARGS.steps, 10))
    flops = gpt_flops(vocab, seq, d, layers, batch)
    print(
        f"\n== bf16 GPT, {n_params / 1e6:.0f}M parameters (d={d}, {layers} layers, {heads} heads, T={seq}, "
        f"batch {batch}, vocab {vocab}), AdamW; ms per step, x jax.jit, MFU"
    )
    jax_s, jax_l = time_jax_training(state, size, batches)
    row("bf16 GPT", "plain jax.jit, donated state", jax_s, jax_s, flops, f"loss {jax_l:.4f}")
    for mode, name in (
        ("compile", "st.compile, AdamW(capturable=True)"),
        ("lazy-item", "lazy with st.step() + loss.item() each step"),
        ("lazy-10", "lazy, one read after all steps"),
        ("compile-default", "st.compile, default AdamW"),
        ("compile-splash", "st.compile, capturable, SDPA via Pallas splash (TPU default)"),
        ("compile-async", "st.compile(raise_on_call=False), capturable"),
        ("compile-nochecks", "st.compile, capturable, st.set_checks(False)"),
    ):
        if ARGS.modes and mode not in ARGS.modes:
            continue
        s, loss = time_st_training(state, size, batches, mode)
        gc.collect()  # the last mode's model and optimizer state leave the chip
        row("bf16 GPT", name, s, jax_s, flops, f"loss {loss:.4f} (JAX {jax_l:.4f})")
    if ARGS.no_forward:
        return
    jf, sf, jl, sl = time_forward(state, size, batches)
    fflops = gpt_flops(vocab, seq, d, layers, batch, training=False)
    row("bf16 GPT forward", "forward + loss, jax.jit", jf, jf, fflops, f"loss {jl:.4f}")
    row("bf16 GPT forward", "forward + loss, st.compile", sf, jf, fflops, f"loss {sl:.4f}")


def f32_section():
    size = (TINY if ARGS.tiny else SIZES)["f32"]
    vocab, seq, d, heads, layers, batch, dtype = size
    torch.manual_seed(1)
    state = {k: v.detach().clone() for k, v in GPT(vocab, seq, d, heads, layers, gelu="tanh").state_dict().items()}
    n_params = sum(v.numel() for v in state.values())
    batches = _batches(vocab, seq, batch, ARGS.warmup + min(ARGS.steps, 10), seed=1)
    flops = gpt_flops(vocab, seq, d, layers, batch)
    print(
        f"\n== float32 GPT, {n_params / 1e6:.0f}M parameters (d={d}, {layers} layers, T={seq}, batch {batch}); "
        "st.compile (capturable AdamW) at each torch.set_float32_matmul_precision vs jax.jit at JAX's"
    )
    before = torch.get_float32_matmul_precision()
    jax_default = None
    try:
        for setting in ARGS.precisions:
            jax_s, jax_l = time_jax_training(state, size, batches, JAX_PRECISION[setting])
            if setting == "medium":
                jax_default = jax_s
            row(
                "f32 GPT",
                f"jax.jit, default_matmul_precision('{JAX_PRECISION[setting]}')",
                jax_s,
                jax_s,
                flops,
                f"loss {jax_l:.4f}",
            )
            torch.set_float32_matmul_precision(setting)
            for mode in ARGS.f32_modes:
                s, loss = time_st_training(state, size, batches, mode)
                gc.collect()
                row(
                    "f32 GPT",
                    f"st.{mode} at set_float32_matmul_precision('{setting}')",
                    s,
                    jax_s,
                    flops,
                    f"loss {loss:.4f}",
                )
        if jax_default is not None:
            print(f"  (JAX's default precision, the TPU's bf16 speed: {jax_default * 1e3:.1f} ms)")
    finally:
        torch.set_float32_matmul_precision(before)


def attention_section():
    b, h, t, dh = TINY_ATTENTION if ARGS.tiny else ATTENTION
    print(f"\n== causal attention forward + backward, bf16, batch {b}, {h} heads, T={t}, head_dim {dh}")
    g = torch.Generator().manual_seed(2)
    q, k, v, w = (torch.randn(b, h, t, dh, generator=g).to(torch.bfloat16) for _ in range(4))
    flops = 4 * b * h * t * t * dh * 3.5 / 2  # fwd 2 products, bwd 5; causal: half
    jq, jk, jv, jw = (jnp.asarray(x.float().numpy(), jnp.bfloat16) for x in (q, k, v, w))

    def jax_loss_of(attend):
        def loss(q, k, v):
            return (attend(q, k, v).astype(jnp.float32) * jw.astype(jnp.float32)).sum()

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    def xla_attend(q, k, v):  # jax.nn's layout is (batch, seq, heads, head_dim)
        out = jax.nn.dot_product_attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), is_causal=True)
        return out.transpose(0, 2, 1, 3)

    def pallas_attend(q, k, v):
        return st.kernels.flash_attention_jax(q, k, v, causal=True)

    def splash_attend(q, k, v):  # what shardtensor's SDPA runs on a TPU (ops/tpu_attention.py)
        from shardtensor.ops import tpu_attention

        with st.runtime.x64_off_scope():
            return tpu_attention._attend(q, k, v, True, dh**-0.5)

    def time_jax(fn):
        return _time_calls(lambda: fn(jq, jk, jv), lambda r: r[0].block_until_ready())

    base = time_jax(jax_loss_of(xla_attend))
    row(f"attention T={t}", "jax.nn.dot_product_attention, jax.jit", base, base, flops)
    row(
        f"attention T={t}",
        "st.kernels.flash_attention_jax (Pallas), jax.jit",
        time_jax(jax_loss_of(pallas_attend)),
        base,
        flops,
    )
    if not ARGS.tiny:  # (interpret mode on a CPU: minutes)
        splash = time_jax(jax_loss_of(splash_attend))
        row(f"attention T={t}", "JAX's Pallas splash attention, jax.jit", splash, base, flops)
    dq, dk, dv, dw = (x.to(st.device()) for x in (q, k, v, w))
    st.sync()
    for name, attend in (
        (
            "F.scaled_dot_product_attention, st.compile (XLA's attention)",
            lambda a, b_, c: _in_xla_attention(F.scaled_dot_product_attention, a, b_, c, is_causal=True),
        ),
        (
            "F.scaled_dot_product_attention, st.compile (TPU default: splash)",
            lambda a, b_, c: F.scaled_dot_product_attention(a, b_, c, is_causal=True),
        ),
        (
            "st.kernels.flash_attention (Pallas), st.compile",
            lambda a, b_, c: st.kernels.flash_attention(a, b_, c, causal=True),
        ),
    ):

        def grads(a, b_, c, attend=attend):
            a, b_, c = (x.detach().requires_grad_() for x in (a, b_, c))
            loss = (attend(a, b_, c).float() * dw.float()).sum()
            return torch.autograd.grad(loss, (a, b_, c))

        compiled = st.compile(grads)
        seconds = _time_calls(functools.partial(compiled, dq, dk, dv), lambda r: r[0].cpu())
        row(f"attention T={t}", name, seconds, base, flops)


def _in_xla_attention(fn, *args, **kwargs):
    with xla_attention():
        return fn(*args, **kwargs)


def _time_calls(call, read):
    for _ in range(ARGS.warmup):
        r = call()
    read(r)
    t0 = time.perf_counter()
    for _ in range(ARGS.steps):
        r = call()
    read(r)
    return (time.perf_counter() - t0) / ARGS.steps


def startup_section():
    """Warm-cache start-up rows from bench/startup.py's worker processes (before this process uses
    JAX's backend: the workers must be able to open the chip)."""
    import tempfile  # noqa: PLC0415

    import startup  # noqa: PLC0415

    print("\n== start-up: first training step of a new process with a warm cache (bench/startup.py's GPT)")
    warm = {}
    for config in ("jax", "lazy", "compile+cap"):
        with tempfile.TemporaryDirectory(prefix="st_tpu_startup_") as cache:
            startup._spawn("gpt", config, 2, cache)  # fills the cache
            warm[config] = startup._spawn("gpt", config, 2, cache)
    anchor, anchor_cpu = warm["jax"]["steps"][0]["wall"], warm["jax"]["steps"][0]["cpu"]
    for config, r in warm.items():
        first, second = r["steps"]
        note = (
            f"CPU {first['cpu'] / anchor_cpu:.2f}x JAX's; step 2 {second['wall'] * 1e3:.0f} ms; "
            f"{first['compiled'] + second['compiled']} programs compiled or loaded in steps 1-2"
        )
        row("start-up", f"warm first step, {config}", first["wall"], anchor, None, note)


def main():
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpt", action="store_true", help="the bf16 GPT in every mode, and forward only")
    ap.add_argument("--f32", action="store_true", help="the float32 GPT at each matmul precision")
    ap.add_argument("--attention", action="store_true", help="flash attention vs SDPA vs JAX at T=2048")
    ap.add_argument("--startup", action="store_true", help="issue 37: the warm-cache first step, fresh processes")
    ap.add_argument("--llama", action="store_true", help="issue 37: HF Llama training and st.generate")
    ap.add_argument("--llama-generate-only", action="store_true", help="with --llama: st.generate rows only")
    ap.add_argument("--llama-training-only", action="store_true", help="with --llama: the training rows only")
    ap.add_argument(
        "--modes",
        nargs="*",
        help="only these bf16 GPT modes (compile, lazy-item, lazy-10, compile-default, compile-splash, "
        "compile-async, compile-nochecks)",
    )
    ap.add_argument(
        "--precisions", nargs="+", choices=list(JAX_PRECISION), default=list(JAX_PRECISION), help="with --f32"
    )
    ap.add_argument("--no-forward", action="store_true", help="with --gpt: no forward-only rows")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes, to debug the bench on a CPU")
    ap.add_argument(
        "--f32-modes",
        nargs="+",
        default=["compile"],
        choices=["compile", "compile-async", "compile-nochecks", "compile-default"],
        help="with --f32: the st.compile variants timed at each precision (see time_st_training)",
    )
    ap.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() after each row's warm-up (the collector's pauses in lazy steps; see docs/performance.md)",
    )
    ap.add_argument(
        "--timeline", action="store_true", help="each timed loop once more under the profiler: programs, idle time"
    )
    ap.add_argument("--steps", type=int, default=10)
    # (4: st.compile traces twice, the capturable optimizer's first step differs, then freezes; its first
    # replay builds the check rows' own program, graph.early_rows)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--peak", type=float, default=197e12, help="the chip's peak FLOP/s for MFU (v5e bf16)")
    ap.add_argument(
        "--cpu-lowerings",
        nargs="*",
        choices=["pick", "rows"],
        help="the lowerings a CPU gets where a TPU's differ, to compare them on the chip: 'pick' (nll_loss's "
        "target pick from the logits, ops/loss.py _logits_kept), 'rows' (3-D products of Linear layers, "
        "ops/shape.py _unflattened_products); none named: both",
    )
    ARGS = ap.parse_args()
    # shardtensor's INFO lines: long compiles, and why a step's check rows get no program of their own
    logging.basicConfig(format="  (%(name)s: %(message)s)")
    logging.getLogger("shardtensor").setLevel(logging.INFO)
    if ARGS.cpu_lowerings is not None:
        from shardtensor.ops import loss, shape  # noqa: PLC0415

        off = ARGS.cpu_lowerings or ["pick", "rows"]
        if "pick" in off:
            loss._logits_kept = lambda: False
        if "rows" in off:
            shape._unflattened_products = lambda: False
        print(f"(the CPU's lowerings for: {', '.join(off)})")
    if not (ARGS.gpt or ARGS.f32 or ARGS.attention or ARGS.llama or ARGS.startup):
        ARGS.gpt = ARGS.f32 = ARGS.attention = True
    t0 = time.perf_counter()
    if ARGS.startup:  # (first: the worker processes open the chip, which this process has not yet)
        startup_section()
    if jax.default_backend() == "cpu" and not ARGS.tiny:
        print("note: running on a CPU without --tiny: the full sizes take long here")
    print(
        f"jax {jax.__version__}, torch {torch.__version__}, {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    if ARGS.gpt:
        gpt_section()
    if ARGS.f32:
        f32_section()
    if ARGS.attention:
        attention_section()
    if ARGS.llama:
        import tpu_llama  # noqa: PLC0415  (needs transformers)

        tpu_llama.section(ARGS, row, _time_calls)
    print(f"\n(bench ran {time.perf_counter() - t0:.0f} s)")
    print("\n| section | run | ms | x JAX | MFU | note |\n|---|---|---|---|---|---|")
    for r in ROWS:
        print("| " + " | ".join(r) + " |")


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
