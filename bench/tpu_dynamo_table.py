"""The design documents' Dynamo table on the chip (issue 50 §2): inference in lazy mode, ``st.compile``
and ``torch.compile(backend="shardtensor")``, and for ResNet-50 plain JAX, beside PyTorch/XLA's
published speed-ups of Dynamo over lazy.

PyTorch/XLA's numbers: inference on a Cloud TPU v4-8, torchbench, Dynamo over lazy tensors —
resnet18 2.59, resnet50 2.64, mobilenet_v2 18.62, BERT_pytorch 7.49, timm_vision_transformer 3.52,
geomean 3.04 over their ten models (5.07 over these five). They are the seeds' table
(/work/shared/reference/seed_torchtpu.md, "Dynamo Performance (Inference on TPU v4-8)"; also
/work/shared/reference/torch_xla_spmd.md §4), from pytorch/xla's docs/source/perf/dynamo.md, whose
numbers date from pytorch/xla PR #5660 (September 2023).

Models and sizes: torchbench's eval defaults (pytorch/benchmark, ``torchbenchmark/models/<name>/
__init__.py`` ``DEFAULT_EVAL_BSIZE``, the same in September 2023 as at 0e83c44, 2026), random weights:

  ===========  =========================  =====  =============================================
  here         torchbench model           batch  input and sizes
  ===========  =========================  =====  =============================================
  resnet18     resnet18                   8      3x224x224 (util/framework/vision/model_factory.py)
  resnet50     resnet50                   32     3x224x224
  mobilenet_v2 mobilenet_v2               16     3x224x224
  bert         BERT_pytorch               16     sequence 128; 768 wide, 12 layers, 12 heads, MLP
                                                 3072 (bert_pytorch/__init__.py's defaults);
                                                 vocabulary 20005 (its 20000 generated words and
                                                 5 special tokens)
  vit          timm_vision_transformer    32     vit_small_patch16_224: 3x224x224, patch 16, 384
                                                 wide, 12 layers, 6 heads, MLP 1536
  ===========  =========================  =====  =============================================

The vision models are bench/vision_models.py's (torchvision's layers written out); BERT and ViT are
transformers' ``BertModel`` and ``ViTModel`` (no pooler; bench/inference.py's ``make_model``) of
those sizes: the hidden states torchbench's BERT_pytorch returns, and ViT without timm's 384x1000
head (0.01% of its FLOPs).

Precision: torchbench's default for inference off CUDA is fp32 (``torchbenchmark/util/
extra_args.py``, ``get_precision_default``: fp16 is only CUDA's ``DEFAULT_EVAL_CUDA_PRECISION``), so
PyTorch/XLA's TPU numbers ran float32 models, whose products XLA computes on a TPU at its default
precision (one bf16 pass). Here likewise: float32 weights and inputs, with
``torch.set_float32_matmul_precision("medium")`` (= ``st.set_mat_mul_precision("default")``: XLA's
``Precision.DEFAULT`` for every float32 product and convolution) and JAX at ``Precision.DEFAULT``.
``--precision highest`` and ``--dtype bfloat16`` (weights and inputs) vary it.

Modes, each with the model on ``st.device()`` (weights replicated over the mesh of all devices, the
batch sharded over it: one device on the chip), the same device-resident batch every call:

  lazy           ``out = forward(x)`` under ``torch.no_grad()``, then ``st.sync()``
  st.compile     ``st.compile`` of that forward
  torch.compile  ``torch.compile(forward, backend="shardtensor")``
  JAX NHWC/NCHW  ResNet-50 only: the same layers in jax.numpy/lax on the same weights
                 (bench/jax_resnet.py), ``jax.jit``; NHWC activations and HWIO kernels (JAX's
                 libraries' convention and the TPU's native layout: channels on the lane axis, its
                 input given NHWC), and NCHW/OIHW as torch's. The faster is the anchor.

Timing: ``--warmup`` calls (compiles; ``st.compile`` traces, then freezes), then ``--repeats`` times
``--calls`` calls back to back ending with one read of the last output to the host; the time per call
of the fastest repetition (the chip runs ahead of the host as far as each mode lets it). "host" is
the time until the calls had returned, per call (on a busy chip bounded by the device's time).
The read copies the output to the host once per repetition (the same copy in every mode, JAX's
too), so the time per call includes 1/``--calls`` of it. "check" is the largest |difference| from
eager torch on the CPU (float32 at ``set_float32_matmul_precision("highest")``), relative to the
reference's largest magnitude; ✓ within 1e-3 (float32 products throughout: ``--precision highest``)
or 5e-2 (products with a bf16 pass, or ``--dtype bfloat16``), and a ✗ is listed under the table's
failures.

Usage::

    TPU_SETUP_HF=1 source bench/tpu_setup.sh                   # on the TPU machine (transformers too)
    python3 bench/tpu_dynamo_table.py                          # all five models
    python3 bench/tpu_dynamo_table.py --models resnet50 bert   # some of them
    python bench/tpu_dynamo_table.py --cpu-smoke               # tiny sizes, 8 simulated CPU devices

Each model compiles its programs once (lazy mode's two; ``st.compile`` and ``torch.compile`` find the
same programs in the cache; JAX's two layouts two more), so the compiles are most of the run; the
per-model times go to stderr as it runs. ``--deadline`` (default 420 s) starts no model that the
longest one so far says would end past it, so the table prints within one device call's 10 minutes;
the models left out are named under the table (run them with ``--models``).
"""

from __future__ import annotations

import os
import sys

# bench/inference.py (and bench/overhead.py, which it imports) default the platform to a CPU for their own
# runs; here the chip's platform is JAX's choice (or SHARDTENSOR_PLATFORM), so their defaults are undone.
_SAVED_ENV = {k: os.environ.get(k) for k in ("SHARDTENSOR_PLATFORM", "SHARDTENSOR_CPU_DEVICES")}
import inference  # noqa: E402
from overhead import _set_device_count  # noqa: E402

for _k, _v in _SAVED_ENV.items():
    if _v is None:
        os.environ.pop(_k, None)
    else:
        os.environ[_k] = _v

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

MODELS = ("resnet18", "resnet50", "mobilenet_v2", "bert", "vit")
MODES = ("lazy", "st.compile", "torch.compile")
JAX_MODELS = ("resnet50",)
JAX_LAYOUTS = ("NHWC", "NCHW")
# PyTorch/XLA's Dynamo-over-lazy inference speed-ups on a TPU v4-8 (see the module's docstring)
PUBLISHED = {"resnet18": 2.59, "resnet50": 2.64, "mobilenet_v2": 18.62, "bert": 7.49, "vit": 3.52}
PUBLISHED_GEOMEAN = 3.04  # over their ten models
TORCHBENCH_NAME = {"bert": "BERT_pytorch", "vit": "timm_vision_transformer"}
# model: (batch, image, sequence, make_model's transformer sizes); torchbench's defaults
SIZES = {
    "resnet18": (8, 224, 0, {}),
    "resnet50": (32, 224, 0, {}),
    "mobilenet_v2": (16, 224, 0, {}),
    "bert": (16, 0, 128, dict(width=768, layers=12, heads=12, vocab=20005)),
    "vit": (32, 224, 0, dict(width=384, layers=12, heads=6)),
}
SMOKE_SIZES = {
    "resnet18": (8, 32, 0, dict(width_mult=0.125)),
    "resnet50": (8, 32, 0, dict(width_mult=0.125)),
    "mobilenet_v2": (8, 32, 0, dict(width_mult=0.25)),
    "bert": (8, 0, 16, dict(width=64, layers=2, heads=2, vocab=1000)),
    "vit": (8, 32, 0, dict(width=64, layers=2, heads=2)),
}
TARGETS = {"st.compile/JAX": 1.05, "torch.compile/st.compile": 1.05, "lazy/st.compile": 1.3}
# the largest "check" (max |diff| / max |reference|) each run may show: float32 products throughout, or
# products with one bf16 pass (float32 at 'medium' on a TPU, XLA's Precision.DEFAULT) or bf16 weights
TOLERANCE = {"float32": 1e-3, "bf16": 5e-2}
RESULT_TAG = "@@dynamo-table "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--modes", nargs="+", default=list(MODES) + ["jax"], choices=list(MODES) + ["jax"])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on 8 simulated CPU devices (checks the bench)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights and inputs")
    p.add_argument(
        "--precision",
        choices=("highest", "high", "medium"),
        default="medium",
        help="torch.set_float32_matmul_precision (JAX at the matching Precision); default medium: XLA's default",
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 5; 3 with --cpu-smoke)")
    p.add_argument("--calls", type=int, default=None, help="calls per timed repetition (default 20; 2 smoke)")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions, the fastest kept (default 3; 2 smoke)")
    p.add_argument("--save-outputs", metavar="PATH", help="torch.save each mode's last output and eager torch's")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    p.add_argument(
        "--deadline",
        type=float,
        default=420,
        help="seconds from the start after which no further model starts: one is skipped when the longest "
        "model so far would end past it (default 420: the table prints within a device call's 10 minutes; "
        "0: no deadline)",
    )
    args = p.parse_args(argv)
    smoke = args.cpu_smoke
    args.warmup = args.warmup if args.warmup is not None else (3 if smoke else 5)
    args.calls = args.calls if args.calls is not None else (2 if smoke else 20)
    args.repeats = args.repeats if args.repeats is not None else (2 if smoke else 3)
    args.sizes = SMOKE_SIZES if smoke else SIZES
    args.start = time.perf_counter()  # (main restarts it)
    return args


# ----------------------------------------------------------------------------- timing


def timed(call, read, args):
    """(seconds per call, host seconds per call, the last output read) of the fastest of
    ``args.repeats`` runs of ``args.calls`` calls ending with one ``read``, after ``args.warmup`` calls."""
    out = None
    for _ in range(args.warmup):
        out = call()
    value = read(out)
    best = best_host = math.inf
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            out = call()
        t1 = time.perf_counter()
        value = read(out)
        seconds = time.perf_counter() - t0
        if seconds < best:
            best, best_host = seconds, t1 - t0
    return best / args.calls, best_host / args.calls, value


def tolerance(args) -> float:
    """The largest relative difference from eager float32 torch a mode's output may show in this run.

    Example: ``tolerance(parse_args(["--precision", "highest"])) == TOLERANCE["float32"]``.
    """
    exact = args.dtype == "float32" and args.precision == "highest"
    return TOLERANCE["float32" if exact else "bf16"]


def _relative_diff(got, want) -> float:
    import torch

    got, want = torch.as_tensor(got).float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- one model


def torch_modes(name, model, x, forward, mesh, args, log):
    """Time each of ``args.modes``' torch modes on ``model`` (moved to the device); rows and outputs."""
    import torch

    import shardtensor as st

    dtype = getattr(torch, args.dtype)
    dev_model = model.to(dtype).to(st.device()) if dtype != torch.float32 else model.to(st.device())
    x = x.to(dtype) if x.is_floating_point() else x
    xs = st.shard(x, mesh, ("d",) + (None,) * (x.dim() - 1))

    def fwd(x):
        with torch.no_grad():
            return forward(dev_model, x)

    def lazy_call():
        out = fwd(xs)
        st.sync()
        return out

    rows, outputs = {}, {}
    for mode in MODES:
        if mode not in args.modes:
            continue
        compiles = st.counter_value("UncachedCompile") or 0
        try:
            if mode == "lazy":
                call = lazy_call
            elif mode == "st.compile":
                compiled = st.compile(fwd, name=f"{name}_forward")
                call = lambda compiled=compiled: compiled(xs)  # noqa: E731
            else:
                torch._dynamo.reset()  # a new closure per model: Dynamo's cache starts afresh
                dynamo = torch.compile(fwd, backend="shardtensor")
                call = lambda dynamo=dynamo: dynamo(xs)  # noqa: E731
            warm = {}

            def read(out, warm=warm, compiles=compiles):
                warm.setdefault("compiles", (st.counter_value("UncachedCompile") or 0) - compiles)
                return out.cpu()

            secs, host, value = timed(call, read, args)
            timed_compiles = (st.counter_value("UncachedCompile") or 0) - compiles - warm["compiles"]
            rows[mode] = dict(
                ms=1e3 * secs, host_ms=1e3 * host, compiles=warm["compiles"], timed_compiles=timed_compiles
            )
            outputs[mode] = value
            log(
                f"{name:13s} {mode:14s} {1e3 * secs:9.2f} ms/call  host {1e3 * host:8.2f} ms ",
                f"programs {warm['compiles']}",
            )
        except Exception as e:  # one failing mode must not end the table: its cell shows it
            rows[mode] = dict(error=inference._short(e))
            log(f"{name:13s} {mode:14s} FAILED {rows[mode]['error']}")
    return rows, outputs


def jax_modes(model, x, n_devices, args, log):
    """Time ResNet-50 in plain JAX (bench/jax_resnet.py) in each layout on the same weights."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_resnet

    precision = {"highest": lax.Precision.HIGHEST, "high": lax.Precision.HIGH, "medium": lax.Precision.DEFAULT}
    jdtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    mesh = Mesh(np.array(jax.devices()[:n_devices]), ("d",))
    rows, outputs = {}, {}
    for layout in JAX_LAYOUTS:
        mode = f"JAX {layout}"
        try:
            params = jax.device_put(jax_resnet.params_from_torch(model, layout, jdtype), NamedSharding(mesh, P()))
            xj = (x.permute(0, 2, 3, 1) if layout == "NHWC" else x).contiguous().numpy().astype(jdtype)
            xj = jax.device_put(xj, NamedSharding(mesh, P("d")))
            fn = jax.jit(jax_resnet.make_forward(model, layout, precision[args.precision]))
            secs, host, value = timed(lambda fn=fn, params=params, xj=xj: fn(params, xj), np.asarray, args)
            rows[mode] = dict(ms=1e3 * secs, host_ms=1e3 * host, compiles=1, timed_compiles=0)
            outputs[mode] = value.astype(np.float32)
            log(f"{'resnet50':13s} {mode:14s} {1e3 * secs:9.2f} ms/call  host {1e3 * host:8.2f} ms")
        except Exception as e:  # the table shows it
            rows[mode] = dict(error=inference._short(e))
            log(f"{'resnet50':13s} {mode:14s} FAILED {rows[mode]['error']}")
    return rows, outputs


def bench_model(name, mesh, n_devices, args, log):
    import torch

    batch, image, seq, sizes = args.sizes[name]
    model, x, forward = inference.make_model(name, batch, image, seq, **sizes)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # (torch's CPU convolutions honour "medium" too)
    try:
        with torch.no_grad():
            reference = forward(model, x)  # eager torch on the CPU, float32 throughout
    finally:
        torch.set_float32_matmul_precision(before)
    rows, outputs = {}, {}
    if name in JAX_MODELS and "jax" in args.modes:  # (before the model moves to the device)
        rows, outputs = jax_modes(model, x, n_devices, args, log)
    torch_rows, torch_outputs = torch_modes(name, model, x, forward, mesh, args, log)
    rows.update(torch_rows)
    outputs.update(torch_outputs)
    for mode, value in outputs.items():
        rows[mode]["diff"] = _relative_diff(value, reference)
    outputs["eager"] = reference
    return dict(batch=batch, image=image, seq=seq, rows=rows), outputs


# ----------------------------------------------------------------------------- the table


def _ratio(rows, a, b):
    ms_a, ms_b = rows.get(a, {}).get("ms"), rows.get(b, {}).get("ms")
    return ms_a / ms_b if ms_a and ms_b else None


def _cell_ratio(r, target=None):
    if r is None:
        return "-"
    return f"{r:.2f}" + ("" if target is None else (" ✓" if r <= target else " ✗"))


def jax_anchor(rows):
    """(mode name, ms) of the faster JAX layout, or None."""
    timed_ = [(m, rows[m]["ms"]) for m in (f"JAX {lay}" for lay in JAX_LAYOUTS) if "ms" in rows.get(m, {})]
    return min(timed_, key=lambda t: t[1]) if timed_ else None


def _bad(row, args) -> bool:
    return "diff" in row and not row["diff"] <= tolerance(args)  # (a NaN is bad)


def _check_cell(row, args) -> str:
    if "diff" not in row:
        return f"{'':>13s}"
    return f"{row['diff']:11.1e} " + ("✗" if _bad(row, args) else "✓")


def print_table(results, args):
    n = results["devices"]
    print(
        f"\nDynamo table: {results['device_kind']} x{n}, {args.dtype} at set_float32_matmul_precision"
        f"('{args.precision}'), torchbench's {'sizes' if not args.cpu_smoke else 'models at tiny sizes'}; "
        f"ms per batch: fastest of {args.repeats} runs of {args.calls} calls + one read, after {args.warmup} "
        "warm-up calls. host: ms per call until the calls returned. check: max |diff| from eager torch "
        f"(CPU, float32) / its max |value|, within {tolerance(args):.0e}."
    )
    columns = list(MODES) + [f"JAX {lay}" for lay in JAX_LAYOUTS]
    print(f"{'model':13s} {'input':>14s}  " + "  ".join(f"{c:>13s}" for c in columns))
    failures = []
    for name, res in results["models"].items():
        rows = res["rows"]
        shape = f"{res['batch']}x{res['seq']}" if res["seq"] else f"{res['batch']}x{res['image']}²"
        cells = []
        for c in columns:
            row = rows.get(c)
            if row is None:
                cells.append(f"{'-':>13s}")
            elif "error" in row:
                failures.append((name, c, row["error"]))
                cells.append(f"{'FAILED':>13s}")
            else:
                cells.append(f"{row['ms']:10.2f} ms")
        print(f"{name:13s} {shape:>14s}  " + "  ".join(cells))
        hosts = "  ".join(
            f"{row['host_ms']:10.2f} ms" if "host_ms" in (row := rows.get(c, {})) else f"{'':>13s}" for c in columns
        )
        print(f"{'  host':13s} {'':>14s}  " + hosts)
        checks = "  ".join(_check_cell(rows.get(c, {}), args) for c in columns)
        print(f"{'  check':13s} {'':>14s}  " + checks)
        failures += [
            (name, c, f"output differs: {rows[c]['diff']:.1e} > {tolerance(args):.0e}")
            for c in columns
            if _bad(rows.get(c, {}), args)
        ]
        recompiled = [c for c in columns if rows.get(c, {}).get("timed_compiles")]
        if recompiled:
            print(f"  (compiled during the timed calls: {', '.join(recompiled)})")
    print(
        "\nRatios of time per batch (targets: st.compile <= 1.05x JAX on ResNet-50; torch.compile <= 1.05x "
        "st.compile; lazy <= 1.3x st.compile), and Dynamo over lazy (lazy / torch.compile) beside PyTorch/XLA's "
        "on a TPU v4-8:"
    )
    print(
        f"{'model':13s} {'st.compile/JAX':>15s} {'torch.compile/st':>17s} {'lazy/st.compile':>16s} "
        f"{'Dynamo/lazy: ours':>18s} {'PyTorch/XLA':>12s}"
    )
    ours, theirs = [], []
    for name, res in results["models"].items():
        rows = res["rows"]
        anchor = jax_anchor(rows)
        vs_jax = rows["st.compile"]["ms"] / anchor[1] if anchor and "ms" in rows.get("st.compile", {}) else None
        speedup = _ratio(rows, "lazy", "torch.compile")
        if speedup:
            ours.append(speedup)
            theirs.append(PUBLISHED[name])
        print(
            f"{name:13s} {_cell_ratio(vs_jax, TARGETS['st.compile/JAX']):>15s} "
            f"{_cell_ratio(_ratio(rows, 'torch.compile', 'st.compile'), TARGETS['torch.compile/st.compile']):>17s} "
            f"{_cell_ratio(_ratio(rows, 'lazy', 'st.compile'), TARGETS['lazy/st.compile']):>16s} "
            f"{_cell_ratio(speedup):>18s} {PUBLISHED[name]:12.2f}" + (f"   (JAX anchor: {anchor[0]})" if anchor else "")
        )
    if ours:
        print(
            f"{'geomean':13s} {'':>15s} {'':>17s} {'':>16s} {_cell_ratio(inference._geomean(ours)):>18s} "
            f"{inference._geomean(theirs):12.2f}   (PyTorch/XLA over its ten models: {PUBLISHED_GEOMEAN})"
        )
    if results.get("skipped"):
        print(f"\nNot run (past --deadline {args.deadline:.0f} s): {', '.join(results['skipped'])}")
    if failures:
        print("\nFailures:")
        for name, mode, err in failures:
            print(f"  {name} / {mode}: {err}")


# ----------------------------------------------------------------------------- main


def run(args):
    import logging

    import jax
    import torch

    import shardtensor as st

    logging.getLogger("shardtensor").setLevel(logging.ERROR)  # the table counts compiles itself
    n = st.global_runtime_device_count()
    mesh = st.Mesh(range(n), (n,), ("d",))
    st.set_global_mesh(mesh)  # the weights live on the batch's mesh: nothing is copied per call

    def log(*parts):
        print(f"[{n} dev]", *parts, file=sys.stderr, flush=True)

    for name in args.models:
        if args.sizes[name][0] % n:
            raise SystemExit(f"{name}: batch {args.sizes[name][0]} is not a multiple of the {n} device(s)")
    results = {"devices": n, "device_kind": jax.devices()[0].device_kind, "models": {}}
    saved = {}
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(args.precision)
    longest = 0.0
    try:
        for name in args.models:
            t0 = time.perf_counter()
            if args.deadline and t0 - args.start + longest > args.deadline:
                results["skipped"] = args.models[args.models.index(name) :]
                log(f"skipped {' '.join(results['skipped'])}: past --deadline {args.deadline:.0f} s")
                break
            results["models"][name], saved[name] = bench_model(name, mesh, n, args, log)
            results["models"][name]["seconds"] = time.perf_counter() - t0
            longest = max(longest, results["models"][name]["seconds"])
            log(f"{name:13s} done in {results['models'][name]['seconds']:.0f} s (compiles included)")
            torch._dynamo.reset()
    finally:
        torch.set_float32_matmul_precision(before)
    if args.save_outputs:
        torch.save(saved, args.save_outputs)
    return results


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.cpu_smoke:
        os.environ["SHARDTENSOR_PLATFORM"] = "cpu"
        _set_device_count(8)
    start = args.start = time.perf_counter()
    import jax
    import torch

    import shardtensor  # noqa: F401  (first: it starts JAX's backend with the device count set above)

    print(
        f"jax {jax.__version__}, torch {torch.__version__}, {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    if jax.default_backend() == "cpu" and not args.cpu_smoke:
        print("note: on a CPU without --cpu-smoke: torchbench's sizes take long here", flush=True)
    results = run(args)
    print_table(results, args)
    if args.json:
        print(RESULT_TAG + json.dumps(results), flush=True)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
