"""The decode step ``st.generate`` runs against the one a plain-JAX greedy loop runs, for the same
HF Llama at the same batch (issue 37 §3: at batch 8 the chip decoded at 69% of JAX's rate, at batch
1 at 95%: device work that grows with the batch). Costs no accelerator: the StableHLO is the same on
every platform, and the HLO XLA's CPU compiler optimized is a proxy for a TPU's (copies, selects and
in-place updates of the KV cache; CPU alone also converts a bf16 cache to f32 for its dots, on both
sides).

shardtensor's side is the frozen decode step of ``st.generate``'s device loop (its prefill and step
are ``st.compile``'d, on-device checks on as by default); JAX's is bench/tpu_llama.py's ``jax_llama``
called with one token and its (L, B, H, S, Dh) cache donated, as ``jax_generate`` calls it. Printed:
op counts by kind (StableHLO, optimized HLO), copies outside fusions and their bytes, the big ops
(results of at least one layer's cache: copies, selects, in-place updates, passes over the cache),
and the donated inputs the compiled program aliases to outputs (``input_output_alias``).
``--time`` also times both generations on this CPU (ms per new token, the best of ``--reps``): compare
st's own times before and after a change there; JAX's loop is no reference on the CPU (XLA:CPU
converts its stacked bf16 cache to float32 for every layer's products: several times st's time).

Issue 37 §3 found here (code at e58aa9c, batch 8, checks on): the step restored every cell it
overwrites when a check failed, by a select per cell, so XLA copied each layer's keys and values
and passed over them with a select every step (16 out-of-place update fusions + 16 selects over
2.1 MB buffers; JAX's step: 16 in-place updates); the device loop's cache is no longer restored
(``graph.program.mark_scratch``).

Example::

    .venv/bin/python bench/decode_hlo.py                   # the 168M Llama of the chip run, batch 8
    .venv/bin/python bench/decode_hlo.py --batch 1 --tiny
    .venv/bin/python bench/decode_hlo.py --no-checks --dump /tmp/hlo
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import time

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "1")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import shardtensor as st  # noqa: E402
import tpu_llama  # noqa: E402
from hlo_compare import _SIZES, copies, hlo_counts, stablehlo_counts  # noqa: E402
from shardtensor import decode_loop  # noqa: E402
from shardtensor.graph import execute  # noqa: E402  (white box: the frozen step's program)
from shardtensor.runtime import x64_scope  # noqa: E402

BIG_KINDS = ("copy", "select", "dynamic-update-slice", "convert", "fusion", "transpose", "scatter", "gather")


def _instructions(text: str):
    """(opcode, result dtype, result bytes, inside a fused computation?) of every instruction of an HLO
    text."""
    inside = False
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            inside = "fused" in line.split("(")[0] or "fusion" in line.split("(")[0] or "wrapped" in line
        m = re.match(r"\s*(?:ROOT )?%\S+ = ([a-z0-9]+)\[([0-9,]*)\]\S* ([a-z][a-z0-9\-]*)\(", line)
        if m and m.group(1) in _SIZES:
            n = 1
            for d in filter(None, m.group(2).split(",")):
                n *= int(d)
            yield m.group(3), m.group(1), n * _SIZES[m.group(1)], inside


def big_ops(text: str, min_bytes: int) -> tuple[collections.Counter, collections.Counter]:
    """(count, MB of the results) of the instructions whose result has at least ``min_bytes``, by
    opcode and result dtype (``name*``: inside a fusion, where it is no pass over memory of its own;
    a top-level fusion is one: in place when it updates a donated buffer)."""
    counts: collections.Counter = collections.Counter()
    mb: collections.Counter = collections.Counter()
    for op, dtype, nbytes, inside in _instructions(text):
        if nbytes >= min_bytes:
            kind = f"{op}{'*' if inside else ''} {dtype}"
            counts[kind] += 1
            mb[kind] += nbytes / 1e6
    return counts, mb


def aliased(text: str) -> int:
    """How many outputs the compiled program writes into a donated input's buffer."""
    m = re.search(r"input_output_alias=\{(.*?)\}, entry", text)
    return len(re.findall(r"may-alias|must-alias", m.group(1))) if m else 0


def st_step(model, prompt, new):
    """(StableHLO, optimized HLO, st.generate call) of the frozen decode step at this batch."""
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    call = functools.partial(st.generate, model, prompt, **kwargs)
    call()
    call()  # (both programs frozen)
    loop = list(decode_loop._LOOPS[model].values())[-1]
    (frozen,) = loop.step._frozen.values()
    program = frozen.executable.program
    values = [ref().value if kind == "old" else ref for kind, _, ref in frozen.sources]
    values = [None if kind == "arg" else v for (kind, _, _), v in zip(frozen.sources, values)]
    with x64_scope():
        lowered = frozen.executable.lower(*execute._call_arguments(program, values, frozen.scalars))
        return lowered.as_text(), lowered.compile().as_text(), call


def jax_step(state, cfg, batch, positions):
    """(StableHLO, optimized HLO, greedy generation) of the plain-JAX loop's decode step."""
    params = {k: jnp.asarray(v.float().numpy(), jnp.bfloat16) for k, v in state.items()}
    h, dh = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_hidden_layers, batch, h, positions, dh)
    cache = (jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))
    fn = jax.jit(functools.partial(tpu_llama.jax_llama, cfg=cfg), donate_argnums=(2,))
    lowered = fn.lower(params, jnp.zeros((batch, 1), jnp.int32), cache, 1)
    return lowered.as_text(), lowered.compile().as_text(), (params, fn)


def _best_ms_per_token(call, reps, tokens):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return 1000 * best / tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="bench/tpu_llama.py's TINY config (2 layers, width 64)")
    ap.add_argument("--layers", type=int, help="override the config's layers")
    ap.add_argument("--prompt", type=int, help="override the config's prompt length")
    ap.add_argument("--new", type=int, help="override the config's new tokens")
    ap.add_argument("--no-checks", action="store_true", help="st.set_checks(False)")
    ap.add_argument("--time", action="store_true", help="also time both generations on this CPU")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dump", help="a folder to write the four texts into")
    args = ap.parse_args()
    c = dict(tpu_llama.TINY if args.tiny else tpu_llama.FULL)
    for name in ("layers", "prompt", "new"):
        if getattr(args, name) is not None:
            c[name] = getattr(args, name)
    if args.no_checks:
        st.set_checks(False)
    model, cfg = tpu_llama._model(c)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model = model.to(st.device())
    st.sync()
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, c["vocab"], (args.batch, c["prompt"]), generator=g)
    st_text, st_opt, st_call = st_step(model, prompt, c["new"])
    jx_text, jx_opt, (params, fn) = jax_step(state, cfg, args.batch, c["prompt"] + c["new"])
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        for name, text in (("st", st_text), ("st_opt", st_opt), ("jax", jx_text), ("jax_opt", jx_opt)):
            with open(os.path.join(args.dump, f"decode_{name}.txt"), "w") as f:
                f.write(text)
    st_layer = decode_loop.kept_cache_bytes(model) // (2 * c["layers"])  # (st's cache: a bucket of positions)
    jax_layer = args.batch * c["hidden"] * (c["prompt"] + c["new"]) * 2
    print(
        f"HF Llama hidden {c['hidden']}, {c['layers']} layers, bf16, batch {args.batch}, prompt {c['prompt']} "
        f"+ {c['new']} new; checks {'off' if args.no_checks else 'on'}; KV cache: st's "
        f"{2 * c['layers'] * st_layer / 1e6:.1f} MB ({st_layer / 1e6:.2f} MB a layer's keys), "
        f"JAX's {2 * c['layers'] * jax_layer / 1e6:.1f} MB ({jax_layer / 1e6:.2f} MB)"
    )
    a, b = stablehlo_counts(st_text), stablehlo_counts(jx_text)
    print("\n== decode step: StableHLO ops       shardtensor    jax")
    for kind in sorted(set(a) | set(b)):
        print(f"   {kind:30s} {a[kind]:10d} {b[kind]:6d}")
    print(f"   {'(all ops)':30s} {sum(a.values()):10d} {sum(b.values()):6d}")
    a, b = hlo_counts(st_opt), hlo_counts(jx_opt)
    print("== decode step: optimized CPU HLO  shardtensor    jax")
    for kind in ("fusion", "copy", "select", "dynamic-update-slice", "dynamic-slice", "convert", "gather", "dot"):
        print(f"   {kind:30s} {a[kind]:10d} {b[kind]:6d}")
    (n_st, b_st), (n_jx, b_jx) = copies(st_opt), copies(jx_opt)
    print(f"   {'copies outside fusions':30s} {n_st:10d} {n_jx:6d}")
    print(f"   {'their bytes':30s} {b_st:10d} {b_jx:6d}")
    print(f"   {'outputs aliased to inputs':30s} {aliased(st_opt):10d} {aliased(jx_opt):6d}")
    (a, a_mb), (b, b_mb) = big_ops(st_opt, st_layer), big_ops(jx_opt, jax_layer)
    print("== results of >= one layer's keys (*: inside a fusion)   shardtensor (MB)      jax (MB)")
    for kind in sorted(k for k in set(a) | set(b) if k.split()[0].rstrip("*") in BIG_KINDS):
        print(f"   {kind:30s} {a[kind]:10d} {a_mb[kind]:8.1f} {b[kind]:6d} {b_mb[kind]:8.1f}")
    if args.time:
        tokens = args.batch * c["new"]
        jprompt = jnp.asarray(prompt.numpy().astype(np.int32))
        jax_call = functools.partial(tpu_llama.jax_generate, params, jprompt, c["new"], cfg, (fn, fn))
        jax_call()
        st_ms = _best_ms_per_token(st_call, args.reps, c["new"])
        jax_ms = _best_ms_per_token(jax_call, args.reps, c["new"])
        print(
            f"== CPU, the best of {args.reps} generations: st.generate {st_ms:.1f} ms a token, "
            f"JAX {jax_ms:.1f} ({tokens} tokens each: {100 * jax_ms / st_ms:.0f}% of JAX's rate)"
        )


if __name__ == "__main__":
    main()
