"""Inference on shardtensor against eager CPU torch: the seeds' Dynamo models and HF generation (issue 16 §4).

Models (random weights): resnet18, resnet50, mobilenet_v2 (bench/vision_models.py: torchvision's
architectures written out, since torchvision's build here needs CUDA), BERT (``BertModel``) and ViT
(``ViTModel``), forward only. Each runs in four modes:

  eager          plain torch on the CPU, ``torch.no_grad()``                        (reference)
  lazy           the model moved to ``st.device()``, the batch sharded over the mesh's one axis
                 (weights replicated on that mesh, the global one: data-parallel inference), forward
                 under ``torch.no_grad()``, then ``st.sync()``
  st.compile     ``st.compile`` of the same forward
  torch.compile  ``torch.compile(forward, backend="shardtensor")``

A call's time runs from the call to the output read back on the CPU (eager torch's output is there
already): the fastest of ``--iters`` calls after ``--warmup`` calls (the first compiles; the fastest
because on a shared machine the spread comes from the other jobs). Each output
is checked against eager torch's (max |diff| <= 1e-2 of the reference's largest magnitude: float32
sums in another order, not a wrong op, stay far below that). A mode that fails on a model prints
its error in the table's cell; the rest of the run goes on.

Generation: ``model.generate(ids, max_new_tokens=N)`` (greedy) of tiny random GPT-2 and Llama
configs, with the default dynamic KV cache and ``cache_implementation="static"``, in eager torch and
in lazy shardtensor (the ids on the device: a program per token), then through ``st.generate``
(static cache, and its growing cache for "dynamic"): tokens/s of the first call (compiles
included) and of a second call with the same prompt (eager: the faster of two calls), the programs
compiled by each
(``st.counter_value("UncachedCompile")``), and whether the tokens equal eager torch's. The generation
part runs on 8 devices only by default (``--gen-devices``).

Eager torch runs on one thread by default (``--torch-threads``): on a 2-core machine shared with other
jobs, torch's 2-thread pool stalls whenever another process takes a core (ResNet-18, batch 8 of 64x64:
58-71 ms per call on one thread, 78-460 ms on two; over a whole run some models' calls took 5-20x
their quiet time), while one thread gives a steady reference that is also the faster one here.

By default everything runs twice, on 8 and on 1 simulated CPU device(s), each in its own process (the
device count must be fixed before jax is imported), and one table shows both. The defaults are small
(batch 8, 96x96 images, BERT/ViT of 4 layers and width 256, sequence 64) so that the run takes a few
minutes on two busy cores; ``--full`` uses 224x224 images and BERT-base / ViT-base (12 layers, width
768, sequence 128).

Usage::

    python bench/inference.py                      # 8 and 1 device(s), small sizes
    python bench/inference.py --full               # base sizes, 224x224
    python bench/inference.py --devices 8 --models resnet18 bert --no-generate

It uses only shardtensor's public API.
"""

from __future__ import annotations

import os

# Before anything imports jax.
os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from overhead import _set_device_count  # noqa: E402  (the same environment set-up as bench/overhead.py)

ALL_DEVICE_COUNTS = (8, 1)
MODELS = ("resnet18", "resnet50", "mobilenet_v2", "bert", "vit")
MODES = ("eager", "lazy", "st.compile", "torch.compile")
GEN_MODELS = ("gpt2", "llama")
RESULT_TAG = "@@inference-results "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="all", help=f"simulated CPU devices, or 'all' for {ALL_DEVICE_COUNTS}")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--full", action="store_true", help="224x224 images, BERT-base / ViT-base, sequence 128")
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8: one example per device)")
    p.add_argument("--image", type=int, default=None, help="image side (default 96, 224 with --full)")
    p.add_argument("--seq", type=int, default=None, help="BERT sequence length (default 64, 128 with --full)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first; the first compiles (default 1)")
    p.add_argument("--iters", type=int, default=3, help="timed calls; the fastest is reported (default 3)")
    p.add_argument("--no-generate", dest="generate", action="store_false", help="skip the generation part")
    p.add_argument("--new-tokens", type=int, default=8, help="max_new_tokens of each generate call (default 8)")
    p.add_argument(
        "--gen-devices",
        default="8",
        help="device count(s) whose process also runs the generation part, or 'all' (default 8: the first"
        " call compiles a program per token, the slowest part of the run)",
    )
    p.add_argument("--prompt", type=int, default=8, help="prompt length in tokens (default 8)")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch.set_num_threads for eager torch (default 1; 0 keeps torch's own: see the module's docstring)",
    )
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a child of --devices all
    args = p.parse_args(argv)
    # Not 64: ResNet's last stage would be 2x2, where XLA:CPU's 3x3 convolution is ~100x slower than
    # torch's (measured with plain jax.lax.conv_general_dilated: 8x512x2x2, 177 ms against 1.7 ms; at
    # 3x3 and beyond, 1-3x), so 64x64 times that pathology rather than the models.
    args.image = args.image or (224 if args.full else 96)
    args.seq = args.seq or (128 if args.full else 64)
    return args


# ----------------------------------------------------------------------------- one process per device count


def _without_devices(argv):
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--devices":
            skip = True
        elif not a.startswith("--devices="):
            rest.append(a)
    return rest


def _run_all(argv):
    """One subprocess per device count, each with the environment set before jax starts; results come back as JSON."""
    results, rc = [], 0
    for n in ALL_DEVICE_COUNTS:
        cmd = [sys.executable, os.path.abspath(__file__), "--devices", str(n), "--json", *_without_devices(argv)]
        r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        for line in r.stdout.splitlines():
            if line.startswith(RESULT_TAG):
                results.append(json.loads(line[len(RESULT_TAG) :]))
            else:
                print(line)
        if r.returncode != 0:
            print(f"[inference] the run with {n} device(s) exited with {r.returncode}", file=sys.stderr)
            rc = rc or r.returncode
    return results, rc


# ----------------------------------------------------------------------------- models


def build_model(name, args):
    """(model in eval mode, example CPU input, forward(model, x) -> one tensor)."""
    width, layers, heads = (768, 12, 12) if args.full else (256, 4, 4)
    return make_model(name, args.batch, args.image, args.seq, width=width, layers=layers, heads=heads)


def make_model(name, batch, image, seq, *, width=768, layers=12, heads=12, vocab=None, width_mult=1.0):
    """``build_model`` with the sizes given: the vision models at ``image``, their channels scaled by
    ``width_mult`` (1.0: torchvision's), BatchNorm statistics random; BERT (``BertModel``, no
    pooler; ``vocab`` tokens, default BertConfig's) and ViT (``ViTModel``, patch 16, no pooler) of
    ``layers`` layers ``width`` wide with ``heads`` heads and an MLP 4x wide. Random weights, seed 0.

    Example: ``model, x, forward = make_model("bert", 2, 0, 16, width=64, layers=2, heads=2)``.
    """
    import torch

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name in ("resnet18", "resnet50", "mobilenet_v2"):
        import vision_models

        model = vision_models.randomize_batchnorm(getattr(vision_models, name)(width_mult=width_mult), g)
        x = torch.randn(batch, 3, image, image, generator=g)
        return model.eval(), x, lambda m, x: m(x)
    import transformers

    sizes = dict(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * width)
    if name == "bert":
        config = transformers.BertConfig(**sizes, **({"vocab_size": vocab} if vocab else {}))
        model = transformers.BertModel(config, add_pooling_layer=False)
        x = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    else:
        config = transformers.ViTConfig(image_size=image, patch_size=16, **sizes)
        model = transformers.ViTModel(config, add_pooling_layer=False)
        x = torch.randn(batch, 3, image, image, generator=g)
    return model.eval(), x, lambda m, x: m(x).last_hidden_state


# ----------------------------------------------------------------------------- inference


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:70]}"


def _matches(got, want) -> tuple[bool, float]:
    diff = (got.float() - want.float()).abs().max().item()
    return diff <= 1e-2 * max(1.0, want.abs().max().item()), diff


def _time_calls(call, args, iters=None):
    """call() -> CPU tensor; returns (the fastest timed call's seconds, last output).

    The fastest, not the median: on a machine shared with other jobs the spread comes from them.
    """
    for _ in range(args.warmup):
        out = call()
    times = []
    for _ in range(iters or args.iters):
        t0 = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - t0)
    return min(times), out


def bench_model(name, args, mesh, n_devices, log):
    import torch

    import shardtensor as st

    model, x, forward = build_model(name, args)
    rows = []

    def eager_call():
        with torch.no_grad():
            return forward(model, x)

    secs, ref = _time_calls(eager_call, args, iters=max(args.iters, 5))  # cheap: a few more calls
    rows.append(dict(model=name, mode="eager", devices=n_devices, ms=1e3 * secs, ok=True, diff=0.0, compiles=0))
    log(f"{name:13s} eager          {1e3 * secs:9.1f} ms")

    dev_model = model.to(st.device())  # the CPU copy is no longer needed: the reference is computed
    xs = st.shard(x, mesh, ("d",) + (None,) * (x.dim() - 1))

    def fwd(x):
        with torch.no_grad():
            return forward(dev_model, x)

    def lazy_call():
        out = fwd(xs)
        st.sync()
        return out.cpu()

    def compiled_call(fn):
        return lambda: fn(xs).cpu()

    for mode in MODES[1:]:
        row = dict(model=name, mode=mode, devices=n_devices)
        compiles = st.counter_value("UncachedCompile") or 0
        try:
            if mode == "lazy":
                call = lazy_call
            elif mode == "st.compile":
                call = compiled_call(st.compile(fwd, name=f"{name}_forward"))
            else:
                torch._dynamo.reset()  # each model's forward is a new closure: start Dynamo's cache afresh
                call = compiled_call(torch.compile(fwd, backend="shardtensor"))
            secs, out = _time_calls(call, args)
            row["ms"] = 1e3 * secs
            row["ok"], row["diff"] = _matches(out, ref)
            log(f"{name:13s} {mode:14s} {1e3 * secs:9.1f} ms  max|diff| {row['diff']:.1e}")
        except Exception as e:  # one failing mode must not end the benchmark: the table shows it
            row["error"] = _short(e)
            log(f"{name:13s} {mode:14s} FAILED {row['error']}")
        row["compiles"] = (st.counter_value("UncachedCompile") or 0) - compiles
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- generation


def build_lm(name):
    import torch
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=256, bos_token_id=999, eos_token_id=999
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
            max_position_embeddings=256,
        )
        model = transformers.LlamaForCausalLM(config)
    return model.eval()


def bench_generation(name, args, n_devices, log):
    import torch

    import shardtensor as st

    model = build_lm(name)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 1000, (2, args.prompt), generator=g)
    mask = torch.ones_like(ids)
    opts = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    caches = {"dynamic": {}, "static": {"cache_implementation": "static"}}
    new_tokens = ids.shape[0] * args.new_tokens
    refs, rows = {}, []
    for cache, extra in caches.items():
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            refs[cache] = model.generate(ids, attention_mask=mask, **opts, **extra)
            times.append(time.perf_counter() - t0)
        row = dict(model=name, cache=cache, mode="eager", devices=n_devices, compiles=[0, 0], ok=True)
        row["tok_s"] = [new_tokens / times[0], new_tokens / min(times[1:])]
        rows.append(row)
    dev_model = model.to(st.device())
    dev_ids, dev_mask = ids.to(st.device()), mask.to(st.device())
    # model.generate with the ids on the device (one program per token), then st.generate (two programs)
    runs = [("lazy", cache, extra) for cache, extra in caches.items()]
    runs += [("st.generate", "static", {}), ("st.generate", "dynamic", {"cache_implementation": "dynamic"})]
    for mode, cache, extra in runs:
        row = dict(model=name, cache=cache, mode=mode, devices=n_devices, tok_s=[], compiles=[])
        try:
            for _ in range(2):
                compiles = st.counter_value("UncachedCompile") or 0
                t0 = time.perf_counter()
                if mode == "lazy":
                    out = dev_model.generate(dev_ids, attention_mask=dev_mask, **opts, **extra).cpu()
                else:
                    out = st.generate(dev_model, ids, attention_mask=mask, **opts, **extra).cpu()
                row["tok_s"].append(new_tokens / (time.perf_counter() - t0))
                row["compiles"].append((st.counter_value("UncachedCompile") or 0) - compiles)
            row["ok"] = out.shape == refs[cache].shape and bool((out == refs[cache]).all())
            log(f"{name:6s} {cache:8s} {mode} tok/s {row['tok_s']} compiles {row['compiles']} equal {row['ok']}")
        except Exception as e:  # the table shows it; the rest of the run goes on
            row["error"] = _short(e)
            log(f"{name:6s} {cache:8s} {mode} FAILED {row['error']}")
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- one device count


def run_one(args):
    import logging

    import torch

    import shardtensor as st

    # The bench counts compiles itself; a recompilation warning per generated token would bury the tables.
    logging.getLogger("shardtensor").setLevel(logging.ERROR)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    n = st.global_runtime_device_count()
    if args.batch % n:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the device count {n}")
    mesh = st.Mesh(range(n), (n,), ("d",))
    st.set_global_mesh(mesh)  # the models' weights live on the batch's mesh: nothing is copied per call

    def log(msg):
        print(f"[{n} dev] {msg}", file=sys.stderr, flush=True)

    log(f"torch threads {torch.get_num_threads()}, batch {args.batch}, image {args.image}, seq {args.seq}")
    results = {"devices": n, "inference": [], "generation": []}
    for name in args.models:
        results["inference"] += bench_model(name, args, mesh, n, log)
    if args.generate and args.gen_devices in ("all", str(n)):
        for name in GEN_MODELS:
            results["generation"] += bench_generation(name, args, n, log)
    return results


# ----------------------------------------------------------------------------- the tables


def _geomean(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _fmt_ratio(r):
    return "-" if r is None else f"{r:.2f}x"


def print_tables(all_results, args):
    print(
        f"\nInference: batch {args.batch}, images {args.image}x{args.image}, BERT sequence {args.seq}, "
        f"{'base-size' if args.full else 'small (4 layers, width 256)'} BERT/ViT; fastest of {args.iters} calls "
        f"after {args.warmup}. Cells: ms per call, (time / eager torch), check against eager torch."
    )
    header = f"{'model':13s} {'dev':>3s}  " + "  ".join(f"{m:>26s}" for m in MODES)
    print(header)
    print("-" * len(header))
    ratios = {}  # (devices, mode) -> [time / eager]
    lazy_over = {}  # (devices, mode) -> [lazy time / compiled time]
    failures = []
    for res in all_results:
        n = res["devices"]
        by_model = {}
        for row in res["inference"]:
            by_model.setdefault(row["model"], {})[row["mode"]] = row
        for name, modes in by_model.items():
            eager_ms = modes["eager"]["ms"]
            cells = []
            for mode in MODES:
                row = modes.get(mode)
                if row is None:
                    cells.append(f"{'-':>26s}")
                elif "error" in row:
                    failures.append((n, name, mode, row["error"]))
                    cells.append(f"{'FAILED (see below)':>26s}")
                    ratios.setdefault((n, mode), []).append(None)
                else:
                    r = row["ms"] / eager_ms
                    ratios.setdefault((n, mode), []).append(r)
                    mark = "✓" if row["ok"] else f"✗ {row['diff']:.0e}"
                    cells.append(f"{row['ms']:9.1f} ms ({r:6.2f}x) {mark:<4s}".rjust(26))
            for mode in ("st.compile", "torch.compile"):
                lazy, comp = modes.get("lazy", {}), modes.get(mode, {})
                if "ms" in lazy and "ms" in comp:
                    lazy_over.setdefault((n, mode), []).append(lazy["ms"] / comp["ms"])
            print(f"{name:13s} {n:3d}  " + "  ".join(cells))
        geo = [_fmt_ratio(_geomean(ratios.get((n, m), []))) for m in MODES]
        print(f"{'geomean':13s} {n:3d}  " + "  ".join(f"{g:>26s}" for g in geo))
        print()
    print("Compiled against lazy on the same backend (lazy time / compiled time; seeds' TPU table: 3.04x geomean):")
    for res in all_results:
        n = res["devices"]
        parts = [
            f"{mode} {_fmt_ratio(_geomean(lazy_over.get((n, mode), [])))}" for mode in ("st.compile", "torch.compile")
        ]
        print(f"  {n} device(s): geomean " + ", ".join(parts))
    gen_rows = [row for res in all_results for row in res["generation"]]
    if gen_rows:
        print(
            f"\nGeneration: batch 2, prompt {args.prompt}, {args.new_tokens} new tokens, greedy. "
            "tok/s of the 1st call (compiles included) / 2nd call; programs compiled by each call."
        )
        print(
            f"{'model':6s} {'cache':8s} {'way':11s} {'dev':>3s} {'eager tok/s':>16s} {'tok/s':>16s} "
            f"{'time/eager':>12s} {'compiles':>9s} {'tokens':>6s}"
        )
        for res in all_results:
            eager = {(r["model"], r["cache"]): r for r in res["generation"] if r["mode"] == "eager"}
            for row in res["generation"]:
                if row["mode"] == "eager":
                    continue
                e = eager[(row["model"], row["cache"])]
                lead = (
                    f"{row['model']:6s} {row['cache']:8s} {row['mode']:11s} {res['devices']:3d} "
                    + f"{e['tok_s'][0]:7.0f} /{e['tok_s'][1]:7.0f} "
                )
                if "error" in row:
                    where = f"{row['mode']}, {row['cache']} cache"
                    failures.append((res["devices"], row["model"], where, row["error"]))
                    print(lead + "FAILED (see below)")
                    continue
                ratio = e["tok_s"][1] / row["tok_s"][1]  # the 2nd calls' time per token, lazy over eager
                print(
                    lead + f"{row['tok_s'][0]:7.1f} /{row['tok_s'][1]:7.1f} {ratio:11.2f}x "
                    f"{row['compiles'][0]:4d} /{row['compiles'][1]:3d} {'✓' if row['ok'] else '✗':>6s}"
                )
    if failures:
        print("\nFailures:")
        for n, name, mode, err in failures:
            print(f"  {n} dev  {name} / {mode}: {err}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    start = time.perf_counter()
    if not args.json:
        print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.devices == "all":
        results, rc = _run_all(argv)
        print_tables(results, args)
        print(f"\n(total {time.perf_counter() - start:.0f} s; load average at end: {os.getloadavg()[0]:.1f})")
        return rc
    _set_device_count(int(args.devices))
    results = run_one(args)
    if args.json:
        print(RESULT_TAG + json.dumps(results), flush=True)
    else:
        print_tables([results], args)
        print(f"\n(total {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
