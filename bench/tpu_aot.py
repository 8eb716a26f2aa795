"""Issue 50 item 5: an FSDPv2 Llama compiled ahead of time for TPU slices that are not attached,
shardtensor against plain JAX: per-chip memory and collective bytes.

The model is a Hugging Face ``LlamaForCausalLM`` of 1.1B parameters (TinyLlama's shape: hidden 2048,
MLP 5632, 22 layers, 32 heads, 4 key/value heads, vocab 32000, untied head, float32), wrapped in
``FSDPv2`` (every parameter sharded over ``'fsdp'`` on its largest dimension, each decoder layer's
output on its batch dimension), trained by ``AdamW(capturable=True)`` (state made by
``st.prime_optimizer``: the program of every step after the first), one sequence of 512 tokens per
chip (about 8 GiB per chip: a v5e's 16 GiB hold it without XLA rematerializing). Its step is
recorded on simulated CPU devices, as many as the slice has chips (one process per slice), and
``st.compile(step).lower(ids, labels).compile(topology="v5e:2x4")`` compiles it for the slice
(``Lowered.retarget``: the program exported with JAX's TPU rules, compiled by libtpu for the slice's
chips; nothing runs, no TPU needs to be attached). Against it: the same model written in JAX (the
same weights' shapes and shardings, ``jax.nn.dot_product_attention``, the layers' outputs
constrained to the batch sharding, AdamW with donated state), ``jax.jit(step).lower(...).compile()``
on the same compile-only devices, laid out as the same mesh. Matrix products at float32 precision
on both sides (torch's default ``highest``).

Per slice it prints XLA's memory analysis per chip (arguments + outputs + temporaries - aliased
outputs, as ``Compiled.memory()`` sums it) and the collectives (count and bytes of each kind, each
instruction's per-chip result buffer), both sides, and the ratios shardtensor / JAX; the target is
<= 1.05 for memory and collective bytes.

Example::

    TPU_SETUP_HF=1 source bench/tpu_setup.sh      # (transformers too)
    python3 bench/tpu_aot.py                       # v5e:2x4 and v5e:4x4 (needs libtpu, no TPU used)
    .venv/bin/python bench/tpu_aot.py --cpu-smoke  # a tiny Llama, simulated CPU devices as the slices
    .venv/bin/python bench/tpu_aot.py --cpu --layers 2   # full widths, 2 layers, on CPU devices
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time

SMOKE = "--cpu-smoke" in sys.argv or "--cpu" in sys.argv  # simulated CPU devices stand for the slices
CHIPS = {"v5e:2x4": 8, "v5e:4x4": 16}
SMOKE_CHIPS = {"cpu8": 8, "cpu4": 4}
# each slice is measured in a process of its own (``--slice``), with as many devices as it has chips
# (a shardtensor mesh covers every device)
SLICE = sys.argv[sys.argv.index("--slice") + 1] if "--slice" in sys.argv[:-1] else None
_devices = (SMOKE_CHIPS if SMOKE else CHIPS).get(SLICE or "", 1)
# the step is recorded on simulated CPU devices, whatever machine this is (libtpu, when installed,
# is loaded for the compile-only topology alone: no TPU is opened)
os.environ["SHARDTENSOR_PLATFORM"] = "cpu"
os.environ.pop("PJRT_DEVICE", None)  # (PyTorch/XLA's variable: TPU on the machine would contradict cpu)
os.environ["SHARDTENSOR_CPU_DEVICES"] = str(_devices)
os.environ["JAX_PLATFORMS"] = "cpu"
# (each slice's process may be lost: try the TPU compile shardtensor refuses in a user's process)
os.environ.setdefault("SHARDTENSOR_TRY_TPU_EXPORT", "1")
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
os.environ["XLA_FLAGS"] = " ".join([*_flags, f"--xla_force_host_platform_device_count={_devices}"])

sys.stdout.reconfigure(line_buffering=True)  # (each line as it comes: a run cut short still shows how far it got)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as JP  # noqa: E402

import shardtensor as st  # noqa: E402
from shardtensor.fsdp import FSDPv2, largest_dim_spec, transformer_auto_wrap_policy  # noqa: E402
from shardtensor.hlo_collectives import collectives_in_hlo, format_bytes  # noqa: E402

FULL = dict(vocab=32000, hidden=2048, inter=5632, layers=22, heads=32, kv_heads=4, seq=512)
TINY = dict(vocab=512, hidden=64, inter=176, layers=2, heads=4, kv_heads=2, seq=32)
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.01
TARGET = 1.05


# ---- the shardtensor side ------------------------------------------------------------------------


def _config(c):
    from transformers import LlamaConfig  # noqa: PLC0415  (optional dependency)

    return LlamaConfig(
        vocab_size=c["vocab"],
        hidden_size=c["hidden"],
        intermediate_size=c["inter"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"],
        max_position_embeddings=max(2048, c["seq"]),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )


def _torch_model(cfg, random_init: bool):
    """The Llama on the CPU: random weights for a small one; else memory left as it is
    (``to_empty``: only shapes matter to a compile, and 1.1B random numbers take a while)."""
    from transformers import LlamaForCausalLM  # noqa: PLC0415
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: PLC0415

    if random_init:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        model = model.to_empty(device="cpu")
    return model, LlamaDecoderLayer


def shardtensor_compiled(c, cfg, chips: int, batch: int, target, random_init: bool):
    """(Compiled for ``target``, parameter count, {phase: seconds}): the FSDPv2 Llama's AdamW step."""
    times = {}
    t0 = time.perf_counter()
    mesh = st.Mesh(range(chips), (chips,), ("fsdp",))
    model, layer = _torch_model(cfg, random_init)
    n_params = sum(p.numel() for p in model.parameters())
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer})
    model = FSDPv2(model, mesh=mesh, auto_wrap_policy=policy)
    opt = st.prime_optimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, capturable=True)
    )
    times["build"] = time.perf_counter() - t0
    _progress(f"built and sharded over {chips} CPU devices, optimizer state made ({times['build']:.0f}s); recording")

    @st.compile
    def train_step(ids, labels):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, c["vocab"], (batch, c["seq"]), generator=g)
    on = lambda t: st.shard(t, mesh, ("fsdp", None))  # noqa: E731
    t0 = time.perf_counter()
    lowered = train_step.lower(on(ids), on(ids.clone()))
    times["record+lower"] = time.perf_counter() - t0
    _progress(f"recorded and lowered ({times['record+lower']:.0f}s); compiling for the slice")
    t0 = time.perf_counter()
    compiled = lowered.compile(**target)
    times["compile"] = time.perf_counter() - t0
    return compiled, n_params, times


# ---- the same model in JAX -----------------------------------------------------------------------


def _rms(x, w, eps):
    return w * (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps))


def _rope(x, cos, sin):
    """HF's rotate-half rotary embedding of x (B, T, H, Dh); cos, sin (T, Dh)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rotated * sin[:, None]


def jax_loss(p, ids, labels, cfg, batch_sharding):
    """HF LlamaForCausalLM's loss: the mean cross entropy of each position's next token."""
    b, t = ids.shape
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    dh, eps = cfg.hidden_size // h, cfg.rms_norm_eps
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    inv = 1.0 / theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
    freqs = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None]
    emb = jnp.concatenate([freqs, freqs], -1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    x = p["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        y = _rms(x, p[pre + "input_layernorm.weight"], eps)
        q = (y @ p[pre + "self_attn.q_proj.weight"].T).reshape(b, t, h, dh)
        k = (y @ p[pre + "self_attn.k_proj.weight"].T).reshape(b, t, kv, dh)
        v = (y @ p[pre + "self_attn.v_proj.weight"].T).reshape(b, t, kv, dh)
        a = jax.nn.dot_product_attention(_rope(q, cos, sin), _rope(k, cos, sin), v, is_causal=True)
        x = x + a.reshape(b, t, h * dh) @ p[pre + "self_attn.o_proj.weight"].T
        y = _rms(x, p[pre + "post_attention_layernorm.weight"], eps)
        gate = jax.nn.silu(y @ p[pre + "mlp.gate_proj.weight"].T) * (y @ p[pre + "mlp.up_proj.weight"].T)
        x = x + gate @ p[pre + "mlp.down_proj.weight"].T
        x = jax.lax.with_sharding_constraint(x, batch_sharding)  # (FSDPv2's layer output)
    logits = _rms(x, p["model.norm.weight"], eps) @ p["lm_head.weight"].T
    logits = jax.lax.with_sharding_constraint(logits, batch_sharding)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, labels[:, 1:, None], axis=-1)
    return -jnp.mean(picked)


def jax_step(params, m, v, count, ids, labels, cfg, batch_sharding):
    loss, grads = jax.value_and_grad(jax_loss)(params, ids, labels, cfg, batch_sharding)
    count = count + 1
    bc1, bc2 = 1 - BETAS[0] ** count, 1 - BETAS[1] ** count
    new_p, new_m, new_v = {}, {}, {}
    for k, g in grads.items():
        new_m[k] = BETAS[0] * m[k] + (1 - BETAS[0]) * g
        new_v[k] = BETAS[1] * v[k] + (1 - BETAS[1]) * g * g
        new_p[k] = params[k] * (1 - LR * WD) - (LR / bc1) * new_m[k] / (jnp.sqrt(new_v[k] / bc2) + EPS)
    return new_p, new_m, new_v, count, loss


def _progress(text: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {text}")


def jax_compiled(c, cfg, shapes: dict, batch: int, mesh):
    """(jax.stages.Compiled, seconds): the same step in JAX on ``mesh`` (the compile-only devices)."""
    t0 = time.perf_counter()

    def abstract(shape, spec, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, JP(*spec)))

    params = {k: abstract(s, largest_dim_spec(s)) for k, s in shapes.items()}
    count = abstract((), ())
    tokens = abstract((batch, c["seq"]), ("fsdp", None), jnp.int32)
    batch_sharding = NamedSharding(mesh, JP("fsdp"))

    def step(params, m, v, count, ids, labels):
        return jax_step(params, m, v, count, ids, labels, cfg, batch_sharding)

    with jax.default_matmul_precision("highest"):
        lowered = jax.jit(step, donate_argnums=(0, 1, 2, 3)).lower(params, params, params, count, tokens, tokens)
    compiled = lowered.compile()
    return compiled, time.perf_counter() - t0


# ---- the report ----------------------------------------------------------------------------------


def memory(stats) -> dict:
    m = dict(
        argument=stats.argument_size_in_bytes,
        output=stats.output_size_in_bytes,
        temp=stats.temp_size_in_bytes,
        alias=stats.alias_size_in_bytes,
    )
    m["total"] = m["argument"] + m["output"] + m["temp"] - m["alias"]
    return m


def _topology(name: str):
    """The compile-only devices of TPU slice ``name`` (libtpu; a bare name first, then v5e's
    host bounds spelled out, as some libtpu versions want them)."""
    from jax.experimental import topologies  # noqa: PLC0415

    attempts = [{}, dict(chip_config_name="default", chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False,) * 3)]
    error = None
    for options in attempts:
        try:
            return topologies.get_topology_desc(name, "tpu", **options)
        except Exception as e:  # noqa: BLE001  (the next spelling, then the first error)
            error = error or e
    raise SystemExit(f"no TPU topology {name!r} here ({error}); this needs libtpu (jax[tpu]) installed")


def compare(name: str, chips: int, c: dict, smoke: bool) -> bool:
    cfg = _config(c)
    batch = chips  # one sequence per chip
    _progress(f"{name} ({chips} chips): building the Llama")
    target = dict(devices=jax.devices()[:chips][::-1]) if smoke else dict(topology=_topology(name))
    st_compiled, n_params, times = shardtensor_compiled(c, cfg, chips, batch, target, c["hidden"] < 1024)
    _progress(f"shardtensor's step compiled ({times['compile']:.0f}s); JAX's step")
    model_shapes = _shapes(cfg)
    jx, jax_seconds = jax_compiled(c, cfg, model_shapes, batch, st_compiled.target.mesh)
    times["jax lower+compile"] = jax_seconds
    sides = {
        "shardtensor": (memory(st_compiled.memory_analysis()), collectives_in_hlo(st_compiled.as_text())),
        "jax": (memory(jx.memory_analysis()), collectives_in_hlo(jx.as_text())),
    }
    print(
        f"\n== {name}: {chips} chips, Llama {n_params / 1e6:,.2f}M parameters, batch {batch} x {c['seq']} tokens, "
        f"FSDPv2, AdamW ({', '.join(f'{k} {v:.1f}s' for k, v in times.items())})"
    )
    print(f"{'per chip':<22}{'shardtensor':>16}{'jax':>16}{'ratio':>8}")
    ratios = {}
    for key in ("argument", "output", "temp", "alias", "total"):
        a, b = sides["shardtensor"][0][key], sides["jax"][0][key]
        ratio = a / b if b else float("nan")
        print(f"  memory {key:<13}{format_bytes(a):>16}{format_bytes(b):>16}{ratio:>8.3f}")
    ratios["memory"] = sides["shardtensor"][0]["total"] / sides["jax"][0]["total"]
    kinds = [k for k in sides["jax"][1] if sides["jax"][1][k].count or sides["shardtensor"][1].get(k, (0, 0))[0]]
    for kind in kinds:
        a, b = sides["shardtensor"][1].get(kind, (0, 0)), sides["jax"][1].get(kind, (0, 0))
        ratio = a[1] / b[1] if b[1] else float("nan")
        cell = lambda x: f"{x[0]} / {format_bytes(x[1])}"  # noqa: E731
        print(f"  {kind:<20}{cell(a):>16}{cell(b):>16}{ratio:>8.3f}")
    totals = [sum(x.bytes for x in sides[s][1].values()) for s in ("shardtensor", "jax")]
    ratios["collective bytes"] = totals[0] / totals[1] if totals[1] else (1.0 if not totals[0] else float("inf"))
    ratio = ratios["collective bytes"]
    print(f"  {'collectives, bytes':<20}{format_bytes(totals[0]):>16}{format_bytes(totals[1]):>16}{ratio:>8.3f}")
    ok = all(r <= TARGET for r in ratios.values())
    verdict = "within" if ok else "OVER"
    print(f"  {verdict} {TARGET}x of JAX: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return ok


def _shapes(cfg) -> dict:
    """name -> shape of each parameter of the HF Llama (built on the meta device: no memory)."""
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return {k: tuple(p.shape) for k, p in model.named_parameters()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny Llama; simulated CPU devices stand for the slices")
    p.add_argument("--cpu", action="store_true", help="simulated CPU devices stand for the slices (full widths)")
    p.add_argument("--topology", action="append", choices=list(CHIPS), help="a TPU slice (default: each)")
    p.add_argument("--layers", type=int, help="decoder layers (default 22; 2 with --cpu-smoke)")
    p.add_argument("--seq", type=int, help="tokens per sequence, one sequence per chip (default 512)")
    p.add_argument("--slice", help=argparse.SUPPRESS)  # (one slice, in this process)
    args = p.parse_args(argv)
    c = dict(TINY if args.cpu_smoke else FULL)
    if args.layers:
        c["layers"] = args.layers
    if args.seq:
        c["seq"] = args.seq
    if args.slice:
        return 0 if compare(args.slice, _devices, c, SMOKE) else 1
    slices = list(SMOKE_CHIPS) if SMOKE else (args.topology or list(CHIPS))
    print(f"jax {jax.__version__}, torch {torch.__version__}; each slice recorded on as many simulated CPU devices")
    failed = []
    for name in slices:
        command = [sys.executable, os.path.abspath(__file__), "--slice", name]
        command += ["--cpu-smoke"] * args.cpu_smoke + ["--cpu"] * args.cpu
        command += ["--layers", str(args.layers)] if args.layers else []
        command += ["--seq", str(args.seq)] if args.seq else []
        code = subprocess.run(command, check=False).returncode
        if code:
            failed.append(f"{name} (exit {code})")
    print("\nall within target" if not failed else f"\nover target or failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
