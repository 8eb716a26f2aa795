"""bench/tpu.py --llama (issue 37's rows): a Hugging Face ``LlamaForCausalLM`` of ~168M parameters
(bf16, hidden 1024, 8 layers, 16 heads, MLP 2816, vocab 32000, untied head) on the chip.

* training, batch 8 x 1024 tokens, ``AdamW(capturable=True)``: lazy ``with st.step()`` +
  ``loss.item()`` each step against ``st.compile`` of the same step (MFU of each);
* greedy generation, 64 new tokens after a 32-token prompt, batch 1 and 8: ``st.generate`` with its
  device loop and with transformers' loop (the best of three calls after two; the second call's rate
  and the first call's compiles in the note) against a plain-JAX decode loop
  of the same weights with a static KV cache (one ``jax.jit`` function: a prefill program and a decode
  step program called per token, the cache donated), in tokens per second, with the share of
  generated tokens on which the two agree.

Imported by bench/tpu.py only when asked (it needs transformers).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import shardtensor as st

FULL = dict(vocab=32000, hidden=1024, inter=2816, layers=8, heads=16, batch=8, seq=1024, prompt=32, new=64)
REPEATS = 3  # timed generations per row (after the compiling ones); the best counts
TINY = dict(vocab=512, hidden=64, inter=176, layers=2, heads=4, batch=2, seq=64, prompt=8, new=8)


def _model(c):
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415  (optional dependency)

    cfg = LlamaConfig(
        vocab_size=c["vocab"],
        hidden_size=c["hidden"],
        intermediate_size=c["inter"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["heads"],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(3)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval(), cfg


# ---- the same Llama in plain JAX, with a static KV cache ---------------------------------------


def _rms(x, w, eps):
    xf = x.astype(jnp.float32)
    return w * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype)


def _rope(x, positions, theta):
    """HF's rotate-half rotary embedding of x (B, H, T, Dh) at ``positions`` (T,)."""
    dh = x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
    freqs = positions.astype(jnp.float32)[:, None] * inv[None]
    emb = jnp.concatenate([freqs, freqs], -1)
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = jnp.concatenate([-x[..., dh // 2 :], x[..., : dh // 2]], -1)
    return x * cos + half * sin


def jax_llama(p, ids, cache, start, cfg):
    """Logits of the last position and the updated cache; ``cache``: (k, v) each (L, B, H, S, Dh)."""
    b, t = ids.shape
    h, dh = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    eps, theta = cfg.rms_norm_eps, getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    positions = start + jnp.arange(t)
    ks, vs = cache
    x = p["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        y = _rms(x, p[pre + "input_layernorm.weight"], eps)
        q, k, v = (
            (y @ p[pre + f"self_attn.{n}_proj.weight"].T).reshape(b, t, h, dh).transpose(0, 2, 1, 3) for n in "qkv"
        )
        q, k = _rope(q, positions, theta), _rope(k, positions, theta)
        ks = jax.lax.dynamic_update_slice(ks, k[None], (i, 0, 0, start, 0))
        vs = jax.lax.dynamic_update_slice(vs, v[None], (i, 0, 0, start, 0))
        s = jnp.einsum("bhqd,bhkd->bhqk", q, ks[i], preferred_element_type=jnp.float32) / np.sqrt(dh)
        visible = jnp.arange(ks.shape[3])[None, :] <= positions[:, None]
        w = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), -1).astype(x.dtype)
        o = jnp.einsum("bhqk,bhkd->bhqd", w, vs[i]).transpose(0, 2, 1, 3).reshape(b, t, h * dh)
        x = x + o @ p[pre + "self_attn.o_proj.weight"].T
        y = _rms(x, p[pre + "post_attention_layernorm.weight"], eps)
        gate, up = y @ p[pre + "mlp.gate_proj.weight"].T, y @ p[pre + "mlp.up_proj.weight"].T
        x = x + (jax.nn.silu(gate) * up) @ p[pre + "mlp.down_proj.weight"].T
    logits = _rms(x[:, -1:], p["model.norm.weight"], eps) @ p["lm_head.weight"].T
    return logits[:, 0], (ks, vs)


def jax_generate(params, prompt, new, cfg, fns):
    """Greedy tokens after ``prompt`` (B, P) with a static cache of P + ``new`` positions."""
    b, plen = prompt.shape
    h, dh = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_hidden_layers, b, h, plen + new, dh)
    cache = (jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))
    prefill, decode = fns
    logits, cache = prefill(params, prompt, cache, 0)
    token = jnp.argmax(logits, -1)
    out = [token]
    for i in range(new - 1):
        logits, cache = decode(params, token[:, None], cache, plen + i)
        token = jnp.argmax(logits, -1)
        out.append(token)
    return np.asarray(jnp.stack(out, 1))


# ---- the section --------------------------------------------------------------------------------


def section(args, row, time_calls):
    import transformers  # noqa: PLC0415  (optional dependency)

    c = TINY if args.tiny else FULL
    print(f"transformers {transformers.__version__}")
    model, cfg = _model(c)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n = sum(v.numel() for v in state.values())
    print(f"\n== HF LlamaForCausalLM, {n / 1e6:.0f}M parameters (hidden {c['hidden']}, {c['layers']} layers), bf16")
    if not getattr(args, "llama_generate_only", False):
        _training(row, time_calls, model, c, n)
    if not getattr(args, "llama_training_only", False):
        _generation(args, row, model, cfg, state, c)


def _training(row, time_calls, model, c, n):
    d, layers, seq, batch, vocab = c["hidden"], c["layers"], c["seq"], c["batch"], c["vocab"]
    per_token = 6 * (n - vocab * d) + 12 * layers * seq * d  # the embedding lookup is no product
    flops = batch * seq * per_token
    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(4)]
    results, losses = {}, {}
    for mode in ("lazy", "compile"):

        def read(loss, mode=mode):
            losses[mode] = loss.item()  # the last one read: both modes ran as many steps from one start
            return losses[mode]

        m = type(model)(model.config).to(torch.bfloat16)
        m.load_state_dict(model.state_dict())
        m.to(st.device()).train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, capturable=True)
        dev = [x.to(st.device()) for x in batches]
        st.sync()

        def step(x, m=m, opt=opt):
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        if mode == "compile":
            compiled = st.compile(step)
            calls = iter(range(10**9))

            def call(compiled=compiled, calls=calls, dev=dev):
                return compiled(dev[next(calls) % len(dev)])

            seconds = time_calls(call, read)
        else:
            calls = iter(range(10**9))

            def call(calls=calls, dev=dev, step=step):
                with st.step():
                    loss = step(dev[next(calls) % len(dev)])
                loss.item()
                return loss

            seconds = time_calls(call, read)
        results[mode] = seconds
    row(
        "HF Llama",
        "training, st.compile, AdamW(capturable=True)",
        results["compile"],
        results["compile"],
        flops,
        f"loss {losses['compile']:.4f}",
    )
    row(
        "HF Llama",
        "training, lazy with st.step() + loss.item() each step",
        results["lazy"],
        results["compile"],
        flops,
        f"x st.compile; loss {losses['lazy']:.4f} (st.compile {losses['compile']:.4f})",
    )


def _generation(args, row, model, cfg, state, c):
    params = {k: jnp.asarray(v.float().numpy(), jnp.bfloat16) for k, v in state.items()}
    prefill = decode = jax.jit(functools.partial(jax_llama, cfg=cfg), donate_argnums=(2,))  # 2 shapes, 2 programs
    dev_model = model.to(st.device())
    st.sync()  # the upload is not part of the first generation's compiles
    new = c["new"]
    for batch in (1, 8):
        g = torch.Generator().manual_seed(5)
        prompt = torch.randint(0, c["vocab"], (batch, c["prompt"]), generator=g)
        jprompt = jnp.asarray(prompt.numpy().astype(np.int32))
        jax_generate(params, jprompt, new, cfg, (prefill, decode))  # compiles
        jax_call = functools.partial(jax_generate, params, jprompt, new, cfg, (prefill, decode))
        jax_s, jax_tokens = _best_of(REPEATS, jax_call)
        kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        row(
            "HF Llama generate",
            f"batch {batch}: plain JAX greedy loop, static cache",
            jax_s,
            jax_s,
            None,
            f"{tokens_of(batch, new) / jax_s:.0f} tokens/s",
        )
        for label, loop in (("st.generate", True), ("st.generate(device_loop=False)", False)):
            compiled = st.counter_value("UncachedCompile") or 0
            st.generate(dev_model, prompt, device_loop=loop, **kwargs)  # compiles
            compiled = (st.counter_value("UncachedCompile") or 0) - compiled
            t0 = time.perf_counter()
            st.generate(dev_model, prompt, device_loop=loop, **kwargs)
            second = time.perf_counter() - t0
            call = functools.partial(st.generate, dev_model, prompt, device_loop=loop, **kwargs)
            st_s, out = _best_of(REPEATS, call)
            st_tokens = out[:, c["prompt"] :].cpu().numpy()
            agree = float(np.mean(st_tokens[:, : jax_tokens.shape[1]] == jax_tokens))
            tokens = tokens_of(batch, new)
            note = (
                f"{tokens / st_s:.0f} tokens/s ({100 * jax_s / st_s:.0f}% of JAX's; "
                f"second call {tokens / second:.0f}); {compiled} compiles; tokens agree {100 * agree:.0f}%"
            )
            row("HF Llama generate", f"batch {batch}: {label}, steady", st_s, jax_s, None, note)


def _best_of(n: int, generate):
    """(the fastest of ``n`` calls in seconds, the last call's tokens): the machine's noise only slows."""
    best, out = float("inf"), None
    for _ in range(n):
        t0 = time.perf_counter()
        out = generate()
        best = min(best, time.perf_counter() - t0)
    return best, out


def tokens_of(batch: int, new: int) -> int:
    return batch * new
