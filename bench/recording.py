"""Host overhead of lazy recording (issue 16, section 3), measured against its floor in the same run.

Two parts, on a (4, 2) mesh of simulated CPU devices:

  per op      a chain of elementwise ops (add, mul, tanh, mul by a Python scalar; as bench/overhead.py)
              recorded lazily, beside the floor: the same chain on a trivial tensor subclass whose
              ``__torch_dispatch__`` returns at once. Reported as CPU time (time.process_time), best of
              the repetitions, and as wall time (median); reps of the two are interleaved, so both see
              the same machine. Target: lazy recording <= 8 us per op.
  inference   steady-state time of one forward (``torch.no_grad()``, the result read back) of a
              BERT-base-size encoder (transformers BertModel, random weights; hidden 768, --bert-layers
              layers) and a hand-written ResNet-18, in three modes: lazy (shardtensor's default),
              ``st.compile(model)`` and ``torch.compile(model, backend="shardtensor")``. Target: lazy
              <= 1.1x each compiled mode. The lazy forward's recording time alone and the number of aten
              ops it records (counted on a CPU run) are printed too.

Usage::

    python bench/recording.py                       # both parts
    python bench/recording.py --part op             # per-op only (seconds)
    python bench/recording.py --part inference --bert-layers 4

It uses only shardtensor's public API (and transformers for BERT).
"""

from __future__ import annotations

import os

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")

import argparse  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import shardtensor as st  # noqa: E402
from overhead import _floor_class  # noqa: E402  (bench/overhead.py's floor and program)
from overhead import torch_chain as chain  # noqa: E402

TARGET_US_PER_OP = 8.0
TARGET_INFERENCE_RATIO = 1.1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("op", "inference", "all"), default="all")
    p.add_argument("--ops", type=int, default=200, help="elementwise ops per chain (default 200)")
    p.add_argument("--reps", type=int, default=30, help="repetitions of each chain (default 30)")
    p.add_argument("--bert-layers", type=int, default=12, help="BERT encoder layers (default 12, BERT-base)")
    p.add_argument("--seq", type=int, default=32, help="BERT sequence length, batch 1 (default 32)")
    p.add_argument("--image", type=int, default=64, help="ResNet-18 input size, batch 1 (default 64)")
    p.add_argument("--forwards", type=int, default=10, help="timed forwards per mode (default 10)")
    p.add_argument("--models", default="bert,resnet18", help="comma-separated: bert, resnet18")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- per op


def bench_per_op(args):
    n = st.global_runtime_device_count()
    mesh = st.Mesh(range(n), (n // 2, 2) if n >= 4 else (n, 1), ("x", "y"))
    torch.manual_seed(0)
    ta, tb = torch.randn(64, 64), torch.randn(64, 64)
    a, b = st.shard(ta, mesh, ("x", None)), st.shard(tb, mesh, ("x", None))
    floor = _floor_class()
    fa, fb = floor(ta), floor(tb)
    want = chain(ta, tb, args.ops)
    for _ in range(2):  # warm-up: the graph compiles, the plans are memoised
        y = chain(a, b, args.ops)
        st.sync(wait=True)
    diff = (y.cpu() - want).abs().max().item()
    cpu = {"floor": [], "lazy": []}
    wall = {"floor": [], "lazy": []}
    gc.collect()
    # No gc.collect() per rep, as in a user's loop: a full collection also empties Python's free lists,
    # and the chain that follows pays to refill them (1-2 us per op, the floor's too).
    for _ in range(args.reps):
        for name, x, w in (("floor", fa, fb), ("lazy", a, b)):
            c0, t0 = time.process_time(), time.perf_counter()
            chain(x, w, args.ops)
            c1, t1 = time.process_time(), time.perf_counter()
            cpu[name].append((c1 - c0) / args.ops * 1e6)
            wall[name].append((t1 - t0) / args.ops * 1e6)
            st.sync(wait=True)
    print(f"per op: a chain of {args.ops} elementwise ops on (64, 64) float32 sharded ('x', None), {n} devices")
    print(f"{'':<26}{'cpu best us':>14}{'wall median us':>16}")
    for name, label in (("floor", "dispatch floor"), ("lazy", "lazy record")):
        print(f"{label:<26}{min(cpu[name]):>14.2f}{statistics.median(wall[name]):>16.2f}")
    rec_cpu, floor_cpu = min(cpu["lazy"]), min(cpu["floor"])
    rec_wall, floor_wall = statistics.median(wall["lazy"]), statistics.median(wall["floor"])
    print(f"{'lazy record - floor':<26}{rec_cpu - floor_cpu:>14.2f}{rec_wall - floor_wall:>16.2f}")
    verdict = "ok" if rec_cpu <= TARGET_US_PER_OP else "MISS"
    print(f"target: lazy record <= {TARGET_US_PER_OP:g} us/op (cpu best): {verdict}")
    if not diff <= 1e-3 * (1 + want.abs().max().item()):
        print(f"WARNING: the lazy chain differs from torch (max abs diff {diff:.3g})")
    print()


# ----------------------------------------------------------------------------- inference models


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """torchvision's resnet18 architecture, written out (torchvision's build here needs CUDA)."""

    def __init__(self, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def make_bert(layers):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=768, num_hidden_layers=layers, num_attention_heads=12, intermediate_size=3072, vocab_size=30522
    )
    model = BertModel(config).eval()

    class LastHidden(nn.Module):  # a tensor result, the same for every mode
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, ids):
            return self.bert(input_ids=ids).last_hidden_state

    return LastHidden(model)


def count_aten_ops(model, x):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        model(x)
    return Count.n


def time_forwards(modes, x, forwards):
    """Per mode: (median, best) wall seconds of one forward with its result read back, and the median
    seconds of the call alone. The modes take turns, so that all see the same machine."""
    total = {name: [] for name in modes}
    call = {name: [] for name in modes}
    with torch.no_grad():
        for fn in modes.values():
            for _ in range(3):  # warm-up: compiles; st.compile freezes on its second call
                fn(x).cpu()
        for _ in range(forwards):
            for name, fn in modes.items():
                gc.collect()
                t0 = time.perf_counter()
                y = fn(x)
                t1 = time.perf_counter()
                y.cpu()
                total[name].append(time.perf_counter() - t0)
                call[name].append(t1 - t0)
    return {n: (statistics.median(total[n]), min(total[n]), statistics.median(call[n])) for n in modes}


def bench_inference(args):
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    rows = []
    for name in names:
        if name == "bert":
            model = make_bert(args.bert_layers)
            x_cpu = torch.randint(0, 30522, (1, args.seq))
            label = f"BERT ({args.bert_layers} layers, seq {args.seq})"
        elif name == "resnet18":
            torch.manual_seed(0)
            model = ResNet18().eval()
            x_cpu = torch.randn(1, 3, args.image, args.image)
            label = f"ResNet-18 ({args.image}x{args.image})"
        else:
            sys.exit(f"--models: unknown model {name!r} (bert, resnet18)")
        n_ops = count_aten_ops(model, x_cpu)
        with torch.no_grad():
            want = model(x_cpu)
        model = model.to(st.device())
        x = x_cpu.to(st.device())
        with torch.no_grad():
            got = model(x).cpu()
        modes = {"lazy": model, "st": st.compile(model), "dynamo": torch.compile(model, backend="shardtensor")}
        times = time_forwards(modes, x, args.forwards)
        diff = (got - want).abs().max().item()
        rows.append((label, n_ops, times, diff))
        del model, modes
    print(
        f"inference: ms per forward (torch.no_grad(), result read back), batch 1, median (best) of "
        f"{args.forwards}, modes interleaved"
    )
    h = ("model", "aten ops", "lazy", "st.compile", "torch.compile", "lazy/st", "lazy/dynamo")
    print(f"{h[0]:<30}{h[1]:>10}" + "".join(f"{c:>18}" for c in h[2:]))
    for label, n_ops, t, diff in rows:
        cells = [f"{t[m][0] * 1e3:.1f} ({t[m][1] * 1e3:.1f})" for m in ("lazy", "st", "dynamo")]
        cells += [f"{t['lazy'][i] / t[m][i]:.2f} ({t['lazy'][1] / t[m][1]:.2f})" for m, i in (("st", 0), ("dynamo", 0))]
        print(f"{label:<30}{n_ops:>10}" + "".join(f"{c:>18}" for c in cells))
        rec = t["lazy"][2]
        print(
            f"{'':<30}lazy recording (the call alone): {rec * 1e3:.1f} ms, {rec / n_ops * 1e6:.1f} us per aten op "
            f"(model Python included); max abs diff vs CPU torch {diff:.2g}"
        )
    print(f"target: lazy <= {TARGET_INFERENCE_RATIO:g}x each compiled mode")


def main(argv=None):
    args = parse_args(argv)
    if args.part in ("op", "all"):
        bench_per_op(args)
    if args.part in ("inference", "all"):
        bench_inference(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
