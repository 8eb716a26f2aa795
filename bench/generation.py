"""Hugging Face greedy generation on shardtensor: programs compiled and wall time, by way of calling.

For a tiny random-init GPT-2 and Llama (``--layers``, ``--width``), ``--tokens`` new tokens from a
prompt of ``--prompt`` tokens, then from a second prompt of another length in the same bucket:

- ``eager``: the model's ``generate`` in eager torch on CPU (the reference; tokens must equal it);
- ``dynamic``: ``model.generate(ids.to(st.device()))``, transformers' default (dynamic) cache;
- ``static``: the same with ``cache_implementation="static"``;
- ``static, host ids``: ``model.generate(ids, cache_implementation="static")`` with ``ids`` on CPU;
- ``st.generate``: ``st.generate(model, ids)`` (docs/generation.md);
- ``st.generate-dynamic``: ``st.generate(model, ids, cache_implementation="dynamic")``, the cache
  growing by buckets;
- ``st.generate-compiled``: ``st.generate(model, ids, compile_decode=True)``, the decode step
  captured by ``torch.compile(backend="shardtensor")`` and replayed frozen.

Each row prints the compiles (``UncachedCompile``) and the wall time of the first call (compiles
included) and of the second prompt's call, and that call's time per token. On a CPU host shared
with other jobs the times are indicative: compare the compile counts, and the times between rows.

Usage::

    python bench/generation.py
    python bench/generation.py --tokens 50 --devices 1

It uses only shardtensor's public API.
"""

from __future__ import annotations

import argparse
import os
import sys


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--prompt", type=int, default=7)
    p.add_argument("--second-prompt", type=int, default=12)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--models", default="gpt2,llama")
    p.add_argument(
        "--ways", default="eager,dynamic,static,static-host,st.generate,st.generate-dynamic,st.generate-compiled"
    )
    return p.parse_args()


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", str(ARGS.devices))
    os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")

import time  # noqa: E402

import torch  # noqa: E402

import shardtensor as st  # noqa: E402

VOCAB = 128


def build(kind, layers, width):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(
            n_layer=layers,
            n_embd=width,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=256,
            bos_token_id=None,
            eos_token_id=None,
        )
        return GPT2LMHeadModel(config).eval()
    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        intermediate_size=2 * width,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def call(way, model, ids, tokens):
    """One generation the named way; returns the tokens on CPU."""
    greedy = {"max_new_tokens": tokens, "do_sample": False, "pad_token_id": 0}
    if way == "eager":
        return model.generate(ids, **greedy)
    if way == "dynamic":
        return model.generate(ids.to(st.device()), **greedy).cpu()
    if way == "static":
        return model.generate(ids.to(st.device()), cache_implementation="static", **greedy).cpu()
    if way == "static-host":
        return model.generate(ids, cache_implementation="static", **greedy).cpu()
    if way == "st.generate":
        return st.generate(model, ids, **greedy).cpu()
    if way == "st.generate-dynamic":
        return st.generate(model, ids, cache_implementation="dynamic", **greedy).cpu()
    if way == "st.generate-compiled":
        return st.generate(model, ids, compile_decode=True, **greedy).cpu()
    raise ValueError(f"unknown way {way!r}")


def timed(way, model, ids, tokens):
    compiles = st.counter_value("UncachedCompile") or 0
    start = time.perf_counter()
    with torch.no_grad():
        out = call(way, model, ids, tokens)
    return out, time.perf_counter() - start, (st.counter_value("UncachedCompile") or 0) - compiles


def main(args):
    torch.manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (1, args.prompt)), torch.randint(1, VOCAB, (1, args.second_prompt))]
    print(
        f"{args.tokens} new tokens, prompts of {args.prompt} then {args.second_prompt} tokens, "
        f"{args.layers} layers of width {args.width}, {st.global_runtime_device_count()} devices"
    )
    print(
        f"{'model':6} {'way':20} {'compiles':>8} {'1st s':>7} {'2nd prompt: compiles':>21} {'s':>6} "
        f"{'ms/token':>8}  tokens"
    )
    for kind in args.models.split(","):
        model = build(kind, args.layers, args.width)
        with torch.no_grad():
            reference = [
                model.generate(p, max_new_tokens=args.tokens, do_sample=False, pad_token_id=0) for p in prompts
            ]
        on_device = False
        for way in args.ways.split(","):
            if way != "eager" and not on_device:
                model.to(st.device())
                st.sync()
                on_device = True
            st.clear_executables()  # every way starts from an empty executable cache
            torch._dynamo.reset()
            first, t1, c1 = timed(way, model, prompts[0], args.tokens)
            second, t2, c2 = timed(way, model, prompts[1], args.tokens)
            same = torch.equal(first, reference[0]) and torch.equal(second, reference[1])
            per_token = 1000 * t2 / args.tokens
            verdict = "equal" if same else "DIFFER"
            print(f"{kind:6} {way:20} {c1:8d} {t1:7.2f} {c2:21d} {t2:6.2f} {per_token:8.1f}  {verdict}")


if __name__ == "__main__":
    sys.exit(main(ARGS))
