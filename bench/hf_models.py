"""Hugging Face models on shardtensor (issue 18): programs per training step, frozen compiled steps,
step time, and the first ``generate``'s compiles.

Six families, tiny but not trivial random-init configs (by default width 128, 2 layers, 4 heads, MLP
256, vocabulary 1000, sequence 64, batch 8; dropout 0 so that every mode computes the same losses):

  gpt2      GPT2LMHeadModel, ``labels=input_ids`` (no attention mask: transformers' pad-token check)
  llama     LlamaForCausalLM, the same
  bert      BertForMaskedLM with an ``attention_mask`` (half the batch padded; the padding not in the loss)
  t5        T5ForConditionalGeneration, ``input_ids`` and ``labels``
  mixtral   MixtralForCausalLM, 4 experts, top-2, transformers' default experts (``_grouped_mm``)
  vit       ViTForImageClassification, 64x64 images, patch 8 (64 patches)

and, on request (``--models mixtral-eager``), Mixtral with ``experts_implementation="eager"`` (the
data-dependent routing of the issue). Each model trains ``--steps`` AdamW steps on the same batches:

  eager       plain torch on the CPU (the reference; one thread by default, see bench/inference.py)
  lazy        the model moved with ``model.to(st.device())`` (tied weights stay tied; docs/hf.md;
              no global mesh first, as a new user would: ``--global-mesh`` sets one), the batch
              sharded over the 8 devices, one step in ``with st.step():``, AdamW(capturable=True)
  st.compile  ``st.compile`` of the same step function, on a second copy of the initial weights

Per steady step (after ``--warmup`` steps: the first creates the optimizer's state, the next ones
compile the steady program and let ``st.compile`` freeze) it counts, from shardtensor's metrics, the
programs run (``ExecuteReplicated``), the programs compiled (``UncachedCompile``) and the parameters
copied onto the batch's mesh again (``ReplicateToGraphMesh``: the issue's re-copies); for
``st.compile``, whether every steady call was a frozen replay (``CompileReplay``, no ``CompileTrace``).
A step's time runs from the call to the loss read back on the CPU; the fastest steady step is
reported (on a shared machine the spread comes from the other jobs). Every loss is checked against
eager torch's (|diff| <= 1e-3 * max(1, |loss|)).

Plain JAX: transformers 5.x has no Flax models any more (the bench checks and says so), so there is
no plain-JAX twin of these models to run; step times are compared with eager torch and with the best
shardtensor mode instead.

Generation (the decoders and T5): greedy ``generate`` of ``--new-tokens`` tokens from a batch of 2
prompts of 8 tokens, with the executable cache cleared first: ``st.generate`` (static cache,
shardtensor/generation.py) and plain ``model.generate(ids on the device,
cache_implementation="static")``, the prompt uploaded before the count: programs compiled by the
first call (``UncachedCompile``), its
time, a second call's time, and whether the tokens equal eager torch's.

``SHARDTENSOR_DEBUG=1`` shows why a step does not freeze (the file and line where two consecutive
traces first differ) and each sync's reason; ``--models``/``--no-generate`` keep such a run short.

Targets (issue 18): 1 program per training step, frozen ``st.compile`` steps for every family,
generation in <= 2 compiles. The tables mark each met or MISSED.

Usage::

    python bench/hf_models.py --quick                 # a few minutes on 2 busy cores
    python bench/hf_models.py                         # more steps and tokens
    python bench/hf_models.py --models gpt2 bert --steps 6 --no-generate
    python bench/hf_models.py --models mixtral mixtral-eager --global-mesh
    SHARDTENSOR_DEBUG=1 python bench/hf_models.py --models bert t5 --steps 5 --no-generate

It uses only shardtensor's public API.
"""

from __future__ import annotations

import os

# Before anything imports jax.
os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")

import argparse  # noqa: E402
import copy  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from inference import _short  # noqa: E402  (bench/inference.py: one line for a failure)
from overhead import _set_device_count  # noqa: E402  (bench/overhead.py's device-count set-up)

MODELS = ("gpt2", "llama", "bert", "t5", "mixtral", "vit")
EXTRA_MODELS = ("mixtral-eager",)
GEN_MODELS = ("gpt2", "llama", "t5", "mixtral", "mixtral-eager")
GEN_WAYS = ("st.generate", "static")  # st.generate; model.generate(cache_implementation="static")
VOCAB = 1000
LR = 1e-3
LOSS_TOL = 1e-3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS + EXTRA_MODELS)
    p.add_argument("--quick", action="store_true", help="fewer steps (6) and new tokens (4): a few minutes")
    p.add_argument("--steps", type=int, default=None, help="training steps per mode (default 10, 6 with --quick)")
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed first steps (default 3: st.compile freezes on the 3rd)"
    )
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--width", type=int, default=128, help="hidden size (default 128)")
    p.add_argument("--layers", type=int, default=2, help="layers (default 2; T5: 2 encoder + 2 decoder)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8: one example per device)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per generate call (default 8, 4 with --quick)")
    p.add_argument("--no-generate", dest="generate", action="store_false", help="skip the generation part")
    p.add_argument("--global-mesh", action="store_true", help="st.set_global_mesh before moving the models")
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads for eager torch (0: torch's own)")
    args = p.parse_args(argv)
    args.steps = args.steps or (6 if args.quick else 10)
    args.new_tokens = args.new_tokens or (4 if args.quick else 8)
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): the steady steps are the ones after it")
    if args.batch % args.devices:
        p.error(f"--batch {args.batch} must be a multiple of --devices {args.devices} (the batch is split over them)")
    return args


# ----------------------------------------------------------------------------- models and batches


def build(name, args, for_generation=False):
    """The model (random weights, seed 0, train mode) and its batch maker: ``batch(generator)`` -> dict."""
    import torch
    import transformers as tf

    w, n, seq, b = args.width, args.layers, args.seq, args.batch
    decoder = dict(
        hidden_size=w,
        intermediate_size=2 * w,
        num_hidden_layers=n,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=2 * seq,
    )
    torch.manual_seed(0)
    if name == "gpt2":
        drop = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        tokens = dict(bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)  # (GPT-2's own 50256 is past VOCAB)
        config = tf.GPT2Config(n_embd=w, n_layer=n, n_head=4, n_positions=2 * seq, vocab_size=VOCAB, **drop, **tokens)
        model = tf.GPT2LMHeadModel(config)
    elif name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**decoder))
    elif name.startswith("mixtral"):
        experts = {"experts_implementation": "eager"} if name == "mixtral-eager" else {}
        config = tf.MixtralConfig(**decoder, num_local_experts=4, num_experts_per_tok=2, **experts)
        model = tf.MixtralForCausalLM(config)
    elif name == "bert":
        drop = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        sizes = dict(hidden_size=w, intermediate_size=2 * w, num_hidden_layers=n, num_attention_heads=4)
        config = tf.BertConfig(**sizes, vocab_size=VOCAB, max_position_embeddings=2 * seq, **drop)
        model = tf.BertForMaskedLM(config)
    elif name == "t5":
        config = tf.T5Config(
            d_model=w,
            d_ff=2 * w,
            d_kv=w // 4,
            num_layers=n,
            num_decoder_layers=n,
            num_heads=4,
            vocab_size=VOCAB,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
        model = tf.T5ForConditionalGeneration(config)
    elif name == "vit":
        drop = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        sizes = dict(hidden_size=w, intermediate_size=2 * w, num_hidden_layers=n, num_attention_heads=4)
        config = tf.ViTConfig(image_size=64, patch_size=8, num_labels=10, **sizes, **drop)
        model = tf.ViTForImageClassification(config)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS + EXTRA_MODELS}")

    def batch(g):
        if name == "vit":
            return {
                "pixel_values": torch.randn(b, 3, 64, 64, generator=g),
                "labels": torch.randint(0, 10, (b,), generator=g),
            }
        ids = torch.randint(2, VOCAB, (b, seq), generator=g)  # (0 and 1: T5's pad and eos)
        if name == "bert":
            mask = torch.ones_like(ids)
            mask[: b // 2, -seq // 4 :] = 0  # half the batch padded at the end
            return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        if name == "t5":
            return {"input_ids": ids, "labels": torch.randint(2, VOCAB, (b, seq), generator=g)}
        return {"input_ids": ids, "labels": ids}

    return (model.eval() if for_generation else model.train()), batch


def _to_device(model):
    """The model on ``st.device()``, as a user moves it (tied weights stay tied: docs/hf.md)."""
    import shardtensor as st

    return model.to(st.device())


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- training


def _train_step(model, opt, batch):
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


class _Deltas:
    """Counters' growth over a block: ``with _Deltas(st) as d: ...; d["ExecuteReplicated"]``."""

    NAMES = ("ExecuteReplicated", "UncachedCompile", "ReplicateToGraphMesh", "CompileTrace", "CompileReplay")

    def __init__(self, st):
        self.st, self.values = st, {}

    def __enter__(self):
        self.start = {k: self.st.counter_value(k) or 0 for k in self.NAMES}
        return self

    def __exit__(self, *exc):
        self.values = {k: (self.st.counter_value(k) or 0) - self.start[k] for k in self.NAMES}
        return False

    def __getitem__(self, name):
        return self.values[name]


def run_eager(model, batches, args, log, name):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, times = [], []
    for batch in batches:
        t0 = time.perf_counter()
        loss = float(_train_step(model, opt, batch))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    log(f"{name:13s} eager      {1e3 * min(times[args.warmup :]):8.1f} ms/step")
    return {"losses": losses, "times": times}


def run_shardtensor(mode, model, batches, mesh, args, log, name):
    """Train ``model`` (already on the device) lazily or under st.compile; counters per step."""
    import torch

    import shardtensor as st

    opt = torch.optim.AdamW(model.parameters(), lr=LR, capturable=True)  # step counts on the devices

    def step(batch):
        return _train_step(model, opt, batch)

    compiled = st.compile(step, name=f"{name}_train_step") if mode == "st.compile" else None
    losses, times, per_step = [], [], []
    for batch in batches:
        dev = {k: st.shard(v, mesh, ("d",) + (None,) * (v.dim() - 1)) for k, v in batch.items()}
        with _Deltas(st) as d:
            t0 = time.perf_counter()
            if compiled is not None:
                loss = compiled(dev)
            else:
                with st.step():
                    loss = step(dev)
            losses.append(float(loss.cpu()))
            times.append(time.perf_counter() - t0)
        per_step.append(d.values)
    steady = per_step[args.warmup :]
    res = {"losses": losses, "times": times, "per_step": per_step}
    for key in _Deltas.NAMES:
        res[key] = sum(s[key] for s in steady) / len(steady)
    res["first_compiles"] = sum(s["UncachedCompile"] for s in per_step[: args.warmup])
    res["frozen"] = all(s["CompileReplay"] == 1 and s["CompileTrace"] == 0 for s in steady)
    log(
        f"{name:13s} {mode:10s} {1e3 * min(times[args.warmup :]):8.1f} ms/step; per steady step: "
        f"{res['ExecuteReplicated']:.1f} programs, {res['UncachedCompile']:.1f} compiles, "
        f"{res['ReplicateToGraphMesh']:.0f} re-copies"
        + (f", frozen {res['frozen']}" if compiled else "")
        + "; losses "
        + " ".join(f"{x:.6f}" for x in losses)
    )
    return res


def bench_training(name, args, mesh, log):
    import torch

    model, make_batch = build(name, args)
    copies = {mode: copy.deepcopy(model) for mode in ("lazy", "st.compile")}
    g = torch.Generator().manual_seed(1)
    batches = [make_batch(g) for _ in range(args.steps)]
    row = {"model": name, "params": _count(model), "eager": run_eager(model, batches, args, log, name)}
    for mode, m in copies.items():
        try:
            row[mode] = run_shardtensor(mode, _to_device(m), batches, mesh, args, log, name)
            ref = row["eager"]["losses"]
            row[mode]["diff"] = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(row[mode]["losses"], ref))
        except Exception as e:  # one failing mode must not end the benchmark: the table shows it
            row[mode] = {"error": _short(e)}
            log(f"{name:13s} {mode:10s} FAILED {row[mode]['error']}")
    return row


# ----------------------------------------------------------------------------- generation


def _compile_ns(st) -> float:
    """Nanoseconds spent compiling so far (shardtensor's CompileTime: tracing, lowering, XLA)."""
    data = st.metric_data("CompileTime")
    return data[1] if data else 0.0


def bench_generation(name, args, log):
    import torch

    import shardtensor as st

    model, _ = build(name, args, for_generation=True)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, VOCAB, (2, 8), generator=g)
    mask = torch.ones_like(ids)
    opts = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    t0 = time.perf_counter()
    ref = model.generate(ids, attention_mask=mask, **opts)
    row = {"model": name, "eager_s": time.perf_counter() - t0}
    dev_model = _to_device(model)
    st.sync()
    for way in GEN_WAYS:
        st.clear_executables()  # the first call's compiles, whatever ran before
        cell = {"compiles": [], "secs": [], "compile_s": []}
        try:
            for _ in range(2):
                if way != "st.generate":  # the prompt on the device (its upload is the caller's, not counted)
                    dev_ids, dev_mask = ids.to(st.device()), mask.to(st.device())
                    st.sync(wait=True)
                before, compile_ns = st.counter_value("UncachedCompile") or 0, _compile_ns(st)
                t0 = time.perf_counter()
                if way == "st.generate":
                    out = st.generate(dev_model, ids, attention_mask=mask, **opts).cpu()
                else:
                    out = dev_model.generate(dev_ids, attention_mask=dev_mask, cache_implementation="static", **opts)
                    out = out.cpu()
                cell["secs"].append(time.perf_counter() - t0)
                cell["compiles"].append((st.counter_value("UncachedCompile") or 0) - before)
                cell["compile_s"].append((_compile_ns(st) - compile_ns) / 1e9)
            cell["ok"] = out.shape == ref.shape and bool((out == ref).all())
            log(f"{name:13s} {way:11s} compiles {cell['compiles']} secs {cell['secs']} tokens equal {cell['ok']}")
        except Exception as e:  # the table shows it; the rest of the run goes on
            cell["error"] = _short(e)
            log(f"{name:13s} {way:11s} FAILED {cell['error']}")
        row[way] = cell
    return row


# ----------------------------------------------------------------------------- the tables


def _mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _time_cell(ms, mode, eager_ms, best):
    if mode not in ms:
        return f"{'FAILED':>22s}"
    return f"{ms[mode]:7.1f} ({ms[mode] / eager_ms:5.2f}x) [{ms[mode] / best:4.2f}]"


def _lazy_cells(lazy):
    """(programs/step, compiles in the first steps, re-copies/step) of the lazy mode's results."""
    if "error" in lazy:
        return f"{'FAILED':>16s}", f"{'-':>4s}", f"{'-':>9s}"
    n, steady_compiles = lazy["ExecuteReplicated"], lazy["UncachedCompile"]
    programs = f"{n:4.1f} {_mark(n == 1):6s}" + (f" +{steady_compiles:.0f}c" if steady_compiles else "")
    return f"{programs:>16s}", f"{lazy['first_compiles']:4d}", f"{lazy['ReplicateToGraphMesh']:9.0f}"


def _frozen_cell(comp):
    if "error" in comp:
        return f"{'FAILED':>19s}"
    text = f"{('yes' if comp['frozen'] else 'no'):>3s} {_mark(comp['frozen']):6s} ({comp['CompileTrace']:.0f} tr)"
    return f"{text:>19s}"


def print_training(rows, args):
    print(
        f"\nTraining: batch {args.batch}, sequence {args.seq}, width {args.width}, {args.layers} layers, AdamW; "
        f"{args.steps} steps, counted and timed over the last {args.steps - args.warmup}. "
        "Times: fastest steady step, (x eager torch), [x the best shardtensor mode]."
    )
    head = (
        f"{'model':13s} {'params':>7s}  {'programs/step':>16s} {'1st':>4s} {'re-copies':>9s}  "
        f"{'st.compile frozen':>19s}  {'eager ms':>8s}  {'lazy ms':>22s}  {'st.compile ms':>22s}  {'loss':>4s}"
    )
    print(head)
    print("-" * len(head))
    misses = []
    for row in rows:
        for mode in ("lazy", "st.compile"):
            if "error" in row[mode]:
                misses.append((row["model"], mode, row[mode]["error"]))
        eager_ms = 1e3 * min(row["eager"]["times"][args.warmup :])
        ms = {m: 1e3 * min(row[m]["times"][args.warmup :]) for m in ("lazy", "st.compile") if "error" not in row[m]}
        best = min(ms.values()) if ms else None
        programs, first, recopies = _lazy_cells(row["lazy"])
        checks = [row[m]["diff"] <= LOSS_TOL for m in ("lazy", "st.compile") if "diff" in row[m]]
        loss_ok = "✓" if checks and all(checks) else "✗"
        print(
            f"{row['model']:13s} {row['params'] / 1e6:6.2f}M  {programs} {first} {recopies}  "
            f"{_frozen_cell(row['st.compile'])}  {eager_ms:8.1f}  {_time_cell(ms, 'lazy', eager_ms, best)}  "
            f"{_time_cell(ms, 'st.compile', eager_ms, best)}  {loss_ok:>4s}"
        )
    print(
        "programs/step: programs run per steady lazy step (target 1; '+Nc': N programs compiled per steady "
        f"step); 1st: programs compiled by the first {args.warmup} lazy steps; re-copies: arrays copied onto the "
        "batch's mesh again per steady lazy step (ReplicateToGraphMesh); st.compile frozen: every steady call a "
        "frozen replay (target), with the number of steady calls that traced (tr); "
        f"loss: every step's loss within {LOSS_TOL:g} (relative) of eager torch's, both modes."
    )
    return misses


def print_generation(rows, args):
    print(
        f"\nGeneration: batch 2, prompt 8, {args.new_tokens} new tokens, greedy, executables cleared before each way. "
        "Cells: programs compiled by the 1st call (target <= 2) / by the 2nd call; the 1st call's seconds "
        "(of which compiling) / the 2nd call's; tokens equal eager torch's."
    )
    width = 40
    head = f"{'model':13s} {'eager s':>8s}  " + "  ".join(
        f"{w:>{width}s}" for w in ("st.generate", "model.generate, static cache")
    )
    print(head)
    print("-" * len(head))
    misses = []
    for row in rows:
        cells = []
        for way in GEN_WAYS:
            c = row[way]
            if "error" in c:
                cells.append(f"{'FAILED':>{width}s}")
                misses.append((row["model"], way, c["error"]))
                continue
            first, second = c["compiles"]
            text = (
                f"{first:3d} {_mark(first <= 2):6s}/{second:2d}  {c['secs'][0]:6.2f} ({c['compile_s'][0]:5.2f})"
                f" /{c['secs'][1]:5.2f}  {'✓' if c['ok'] else '✗'}"
            )
            cells.append(f"{text:>{width}s}")
        print(f"{row['model']:13s} {row['eager_s']:8.3f}  " + "  ".join(cells))
    return misses


# ----------------------------------------------------------------------------- main


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    load_start = os.getloadavg()
    _set_device_count(args.devices)
    import logging

    import jax
    import torch
    import transformers

    import shardtensor as st

    # The bench counts compiles itself; a recompilation warning per generated token would bury the tables.
    logging.getLogger("shardtensor").setLevel(logging.ERROR)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    n = st.global_runtime_device_count()
    mesh = st.Mesh(range(n), (n,), ("d",))
    if args.global_mesh:
        st.set_global_mesh(mesh)

    def log(msg):
        print(f"[hf_models] {msg}", file=sys.stderr, flush=True)

    flax = any(hasattr(transformers, f"Flax{c}") for c in ("GPT2LMHeadModel", "BertForMaskedLM", "ViTModel"))
    print(
        f"Hugging Face models on shardtensor — {platform.node()} ({os.cpu_count()} cores), torch {torch.__version__}, "
        f"transformers {transformers.__version__}, jax {jax.__version__}, {n} simulated CPU devices, mesh ({n},) "
        f"('d',), {'with' if args.global_mesh else 'no'} global mesh; load average at start "
        + " ".join(f"{x:.1f}" for x in load_start)
    )
    print(
        "Plain JAX: "
        + (
            "transformers has Flax models, but this bench does not run them: "
            if flax
            else f"transformers {transformers.__version__} has no Flax models, so there is no plain-JAX twin: "
        )
        + "step times are compared with eager torch and the best shardtensor mode."
    )
    train_rows, gen_rows = [], []
    for name in args.models:
        train_rows.append(bench_training(name, args, mesh, log))
    if args.generate:
        for name in (m for m in args.models if m in GEN_MODELS):
            gen_rows.append(bench_generation(name, args, log))
    misses = print_training(train_rows, args)
    if gen_rows:
        misses += print_generation(gen_rows, args)
    if misses:
        print("\nFailures:")
        for name, mode, err in misses:
            print(f"  {name} / {mode}: {err}")
    print(f"\n(total {time.perf_counter() - start:.0f} s; load average at end {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
