"""The program shardtensor builds for a bf16 GPT against the one ``jax.jit`` builds for the same model
written in ``jax.numpy``: op counts by kind, side by side, in the StableHLO and in the HLO XLA's CPU
compiler optimized, for the forward pass, forward + backward, and the whole training step with
``AdamW(capturable=True)`` (issue 36, item 2). Costs no accelerator: the StableHLO is the same on every
platform, and the optimized CPU HLO is a proxy for a TPU's (copies, fusions, exponentials).

The torch model is bench/gpt_model.py's GPT (tanh GELU, ``F.scaled_dot_product_attention(is_causal=True)``,
bf16 parameters); the JAX model and AdamW are bench/train_vs_jax.py's. One CPU device, no sharding.
shardtensor's programs are built as a run builds them (``graph.capture`` + ``graph.lower``, buffers
donated); ``--checks`` keeps the on-device value checks in (st.compile's default; off by default here,
since JAX's program has none).

Example::

    .venv/bin/python bench/hlo_compare.py                       # d=256, T=128, 2 layers
    .venv/bin/python bench/hlo_compare.py --d 128 --seq 64 --dump /tmp/hlo
    # bench/tpu.py --f32's model against its JAX (2 of its 6 layers), bytes moved by kind of work:
    .venv/bin/python bench/hlo_compare.py --dtype f32 --jax-model tpu --precision medium --parts step \
        --d 768 --heads 12 --layers 2 --seq 512 --batch 8 --vocab 32768 --breakdown
    SHARDTENSOR_PLATFORM=tpu python bench/hlo_compare.py      # on a TPU machine: the TPU's optimized HLO
"""

from __future__ import annotations

import argparse
import collections
import os
import re

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "1")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=1").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import shardtensor as st  # noqa: E402
from gpt_model import GPT  # noqa: E402
from shardtensor.graph.capture import capture, lower  # noqa: E402  (white box: the program a run builds)
from shardtensor.runtime import x64_scope  # noqa: E402
from train_vs_jax import BETAS, EPS, LR, WD, jax_adamw, jax_cross_entropy, jax_gpt  # noqa: E402

STABLEHLO_KINDS = (
    "convert",
    "reshape",
    "transpose",
    "broadcast_in_dim",
    "exponential",
    "tanh",
    "dot_general",
    "reduce",
    "select",
    "compare",
    "slice",
    "concatenate",
    "gather",
    "iota",
    "custom_call",
    "call",
)
HLO_KINDS = ("copy", "fusion", "exponential", "tanh", "convert", "transpose", "dot", "custom-call", "reduce", "while")


def stablehlo_counts(text: str) -> collections.Counter:
    """How many of each op the StableHLO text has (``stablehlo.X`` and ``func.call``, by X)."""
    counts: collections.Counter = collections.Counter()
    for m in re.finditer(r"=\s*(?:\"?)(stablehlo|func|chlo|sdy)\.([a-z_]+)", text):
        counts[m.group(2)] += 1
    return counts


def hlo_counts(text: str) -> collections.Counter:
    """How many of each instruction the optimized HLO text has (fused computations' bodies included:
    a copy there is a transpose in a fusion, not a pass over memory; ``copies`` counts those that are)."""
    counts: collections.Counter = collections.Counter()
    for m in re.finditer(r"=\s*[^=]*?\s([a-z][a-z0-9\-]*)\(", text):
        counts[m.group(1)] += 1
    return counts


_SIZES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s64": 8, "f64": 8, "pred": 1, "s8": 1, "u8": 1}


def _unfused(text: str) -> str:
    """The optimized HLO without its fused computations' bodies (a copy inside a fusion moves nothing)."""
    kept, inside_fused = [], False
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):  # a computation's header
            inside_fused = "fused" in line.split("(")[0] or "fusion" in line.split("(")[0]
        if not inside_fused:
            kept.append(line)
    return "\n".join(kept)


def copies(text: str) -> tuple[int, int]:
    """(count, bytes of the results) of the ``copy`` instructions outside fusions."""
    count = total = 0
    for m in re.finditer(r"=\s*([a-z0-9]+)\[([0-9,]*)\]\{[^}]*\}\s+copy\(", _unfused(text)):
        n = 1
        for d in filter(None, m.group(2).split(",")):
            n *= int(d)
        count, total = count + 1, total + n * _SIZES.get(m.group(1), 4)
    return count, total


def _nbytes(shapes: str) -> int:
    total = 0
    for m in re.finditer(r"([a-z0-9]+)\[([0-9,]*)\]", shapes):
        if m.group(1) in _SIZES:
            n = 1
            for d in filter(None, m.group(2).split(",")):
                n *= int(d)
            total += n * _SIZES[m.group(1)]
    return total


def traffic(text: str) -> int:
    """Bytes the entry computation's instructions read and write (each one's result and operands;
    parameters, tuples, bitcasts and constants move nothing): a rough measure of memory traffic."""
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    shapes: dict[str, str] = {}
    total = 0
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?(%\S+) = (.+?) (\S+?)\((.*)", line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = shape
        if op not in ("parameter", "tuple", "get-tuple-element", "bitcast", "constant"):
            operands = re.findall(r"(%[\w.\-]+)", rest.split("), ")[0])
            total += _nbytes(shape) + sum(_nbytes(shapes.get(o, "")) for o in operands)
    return total


# what a fusion does, by the first of these ops its body has (a dot's fusion is a product, ...)
_CATEGORIES = ("dot", "convolution", "scatter", "sort", "reduce-window", "reduce", "gather", "concatenate")
_CATEGORIES += ("dynamic-update-slice", "transpose", "copy", "rng", "exponential", "tanh", "select")


def _computations(text: str) -> dict:
    """{name: body lines} of the optimized HLO text's computations (the entry's as "ENTRY")."""
    comps: dict = {}
    body: list = []
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            body = []
            comps["ENTRY" if line.startswith("ENTRY") else line.split()[0]] = body
        else:
            body.append(line)
    return comps


def categories(text: str) -> dict:
    """{category: [instructions, bytes read, bytes written]} over the optimized entry computation's
    instructions (fusions by what their body does; a slice of the scalar vector does not count)."""
    comps = _computations(text)
    shapes: dict = {}
    out: dict = collections.defaultdict(lambda: [0, 0, 0])
    for line in comps["ENTRY"]:
        m = re.match(r"\s*(?:ROOT )?(%\S+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)", line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = shape
        if op in ("parameter", "tuple", "get-tuple-element", "bitcast", "constant"):
            continue
        ops = {op}
        if op == "fusion":
            body = comps.get(re.search(r"calls=(%[\w.\-]+)", rest).group(1), [])
            found = (re.match(r"\s*(?:ROOT )?%\S+ = .+? ([a-z][a-z0-9\-]*)\(", x) for x in body)
            ops = {b.group(1) for b in found if b}
        kind = next((k for k in _CATEGORIES if k in ops), "elementwise")
        operands = re.findall(r"(%[\w.\-]+)", rest.split("), ")[0])
        row = out[kind]
        row[0] += 1
        row[1] += sum(_nbytes(shapes.get(o, "")) for o in operands)
        row[2] += _nbytes(shape)
    return dict(out)


_MLIR_SIZES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "i64": 8, "i32": 4, "ui32": 4, "i1": 1, "i8": 1, "ui8": 1}


def stablehlo_bytes(text: str) -> dict:
    """{op: [count, bytes of its results]} of the StableHLO before optimization, and the 64-bit
    integer and float elements it makes (``"(64-bit elements)"``): what a TPU emulates."""
    out: dict = collections.defaultdict(lambda: [0, 0])
    for line in text.splitlines():
        m = re.search(r"=\s*\"?stablehlo\.([a-z_]+)", line)
        if not m:
            continue
        result = line.rsplit("->", 1)[-1] if "->" in line.rsplit(":", 1)[-1] else line.rsplit(":", 1)[-1]
        for t in re.finditer(r"tensor<([0-9x]*?)x?(f32|bf16|f16|f64|i64|i32|ui32|i1|i8|ui8)>", result):
            n = 1
            for d in filter(None, t.group(1).split("x")):
                n *= int(d)
            out[m.group(1)][1] += n * _MLIR_SIZES[t.group(2)]
            if t.group(2) in ("i64", "f64"):
                out["(64-bit elements)"][1] += n
        out[m.group(1)][0] += 1
    return dict(out)


def print_breakdown(part, st_text, st_opt, jx_text, jx_opt):
    """The bytes each kind of work moves, side by side (``--breakdown``)."""
    a, b = categories(st_opt), categories(jx_opt)
    print(f"== {part}: optimized entry by kind   shardtensor: n  MB read  MB written |  jax: n  MB read  MB written")
    for kind in sorted(set(a) | set(b), key=lambda k: -sum(a.get(k, [0, 0, 0])[1:])):
        x, y = a.get(kind, [0, 0, 0]), b.get(kind, [0, 0, 0])
        st_row = f"{x[0]:14d} {x[1] / 1e6:8.1f} {x[2] / 1e6:11.1f}"
        print(f"   {kind:22s} {st_row} | {y[0]:7d} {y[1] / 1e6:8.1f} {y[2] / 1e6:11.1f}")
    a, b = stablehlo_bytes(st_text), stablehlo_bytes(jx_text)
    print(f"== {part}: StableHLO results (MB), dot_general left out       shardtensor        jax")
    wide = a.pop("(64-bit elements)", [0, 0])[1], b.pop("(64-bit elements)", [0, 0])[1]
    for op in sorted(set(a) | set(b), key=lambda k: -max(a.get(k, [0, 0])[1], b.get(k, [0, 0])[1]))[:16]:
        if op != "dot_general":
            x, y = a.get(op, [0, 0]), b.get(op, [0, 0])
            print(f"   {op:30s} {x[0]:5d} {x[1] / 1e6:9.1f} {y[0]:6d} {y[1] / 1e6:9.1f}")
    print(f"   {'64-bit elements made (M)':30s} {'':5s} {wide[0] / 1e6:9.2f} {'':6s} {wide[1] / 1e6:9.2f}")

    def outputs(t):
        signature = t[t.index("\nENTRY") :].split(") -> ", 1)[1].split("{")[0]
        return len(re.findall(r"[a-z0-9]+\[[0-9,]*\]", signature))

    print(f"   {'program outputs':30s} {outputs(st_opt):5d} {'':9s} {outputs(jx_opt):6d}")


def _torch_dtype(args):
    return torch.float32 if args.dtype == "f32" else torch.bfloat16


def gpt_inputs(args):
    """(bf16 state dict, (tokens, targets)) of the seeded GPT and batch both sides run."""
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, seq=args.seq, d=args.d, heads=args.heads, layers=args.layers, gelu="tanh")
    state = {k: v.detach().to(_torch_dtype(args)) for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return state, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def st_lowered(args, part, state, batch, forward_loss=False):
    """shardtensor's program for ``part`` as a run builds it (``graph.lower``, buffers donated), not
    compiled; ``forward_loss``: the forward part ends with the loss."""
    model = GPT(vocab=args.vocab, seq=args.seq, d=args.d, heads=args.heads, layers=args.layers, gelu="tanh")
    model.to(_torch_dtype(args)).load_state_dict(state)
    model = model.to(st.device())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, capturable=True)
    x, y = (t.to(st.device()) for t in batch)

    def loss_of(out):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))

    def step():
        if part == "forward":  # (under no_grad: with autograd on, every saved activation is an output)
            with torch.no_grad():
                return [loss_of(model(x)) if forward_loss else model(x)]
        loss = loss_of(model(x))
        loss.backward()
        if part == "backward":
            return [loss] + [p.grad for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        return [loss]

    from torch.nn.attention import SDPBackend, sdpa_kernel

    # XLA's attention, as bench/tpu.py's rows against jax.jit (a TPU's default is the splash kernel)
    with sdpa_kernel([SDPBackend.OVERRIDEABLE, SDPBackend.MATH]):
        if part == "step":  # one real step first: the state exists, the captured step is a steady one
            step()
            st.sync()
        with capture() as seen:
            results = step()  # (held: a result nothing holds is not computed)
    lowered = lower(seen.pending(), donate=True)
    del results
    return lowered


def torch_side(args, part, state, batch):
    """(StableHLO text, optimized HLO text) of shardtensor's program for ``part``."""
    lowered = st_lowered(args, part, state, batch)
    with x64_scope():
        jl = lowered.jitted().lower(*lowered.abstract_arguments())
        return jl.as_text(), jl.compile().as_text()


def jax_side(args, part, state, batch):
    params = {
        k: jnp.asarray(v.float().numpy(), jnp.float32 if args.dtype == "f32" else jnp.bfloat16)
        for k, v in state.items()
    }
    x, y = (jnp.asarray(t.numpy()) for t in batch)
    kw = dict(heads=args.heads, layers=args.layers)
    adamw = jax_adamw

    def loss_fn(p):
        return jax_cross_entropy(jax_gpt(p, x, gelu="tanh", **kw).astype(jnp.float32), y)

    if args.jax_model == "tpu":  # bench/tpu.py's: jax.nn.dot_product_attention, the chip's anchor
        import tpu

        adamw = tpu.jax_adamw

        def loss_fn(p):
            return tpu.jax_loss(p, x, y, args.heads, args.layers)

    if part == "forward":
        if args.jax_model == "tpu":
            fn = lambda p: tpu.jax_gpt(p, x, args.heads, args.layers)  # noqa: E731
        else:
            fn = lambda p: jax_gpt(p, x, gelu="tanh", **kw)  # noqa: E731
        fargs, donate = (params,), ()
    elif part == "backward":
        fn, fargs, donate = jax.value_and_grad(loss_fn), (params,), ()
    else:
        m = {k: jnp.zeros_like(v) for k, v in params.items()}
        count = jnp.zeros((), jnp.float32)

        def fn(params, m, v, count):
            loss, grads = jax.value_and_grad(loss_fn)(params)
            params, m, v, count = adamw(params, grads, m, v, count)
            return params, m, v, count, loss

        v = {k: jnp.zeros_like(x) for k, x in params.items()}
        fargs, donate = (params, m, v, count), (0, 1, 2, 3)
    with jax.default_matmul_precision({"highest": "highest", "high": "high", "medium": "default"}[args.precision]):
        jl = jax.jit(fn, donate_argnums=donate).lower(*fargs)
        return jl.as_text(), jl.compile().as_text()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--parts", default="forward,backward,step")
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16", help="the parameters' dtype")
    ap.add_argument("--checks", action="store_true", help="keep shardtensor's on-device checks in")
    ap.add_argument(
        "--jax-model",
        choices=["train_vs_jax", "tpu"],
        default="train_vs_jax",
        help="JAX's side: bench/train_vs_jax.py's model (its own softmax, F.cross_entropy's ignore_index) "
        "or bench/tpu.py's, the chip's anchor (jax.nn.dot_product_attention)",
    )
    ap.add_argument(
        "--precision",
        choices=["highest", "high", "medium"],
        default="highest",
        help="torch.set_float32_matmul_precision (and JAX's matching default_matmul_precision)",
    )
    ap.add_argument("--dump", help="a folder to write each program's texts into")
    ap.add_argument(
        "--breakdown", action="store_true", help="bytes read and written by kind of work, and StableHLO result bytes"
    )
    args = ap.parse_args()
    st.set_checks(args.checks)
    torch.set_float32_matmul_precision(args.precision)
    state, batch = gpt_inputs(args)
    print(
        f"{args.dtype} GPT d={args.d} heads={args.heads} layers={args.layers} T={args.seq} batch={args.batch} "
        f"vocab={args.vocab}, tanh GELU, causal SDPA, AdamW(capturable); checks {'on' if args.checks else 'off'}"
    )
    for part in args.parts.split(","):
        st_text, st_opt = torch_side(args, part, state, batch)
        jx_text, jx_opt = jax_side(args, part, state, batch)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            for name, text in (("st", st_text), ("st_opt", st_opt), ("jax", jx_text), ("jax_opt", jx_opt)):
                with open(os.path.join(args.dump, f"{part}_{name}.txt"), "w") as f:
                    f.write(text)
        a, b = stablehlo_counts(st_text), stablehlo_counts(jx_text)
        print(f"\n== {part}: StableHLO ops          shardtensor    jax")
        for kind in STABLEHLO_KINDS:
            print(f"   {kind:30s} {a[kind]:10d} {b[kind]:6d}")
        print(f"   {'(all ops)':30s} {sum(a.values()):10d} {sum(b.values()):6d}")
        a, b = hlo_counts(st_opt), hlo_counts(jx_opt)
        print(f"== {part}: optimized CPU HLO     shardtensor    jax")
        for kind in HLO_KINDS:
            print(f"   {kind:30s} {a[kind]:10d} {b[kind]:6d}")
        (n_st, b_st), (n_jx, b_jx) = copies(st_opt), copies(jx_opt)
        starts_st = sum(n for k, n in a.items() if k.endswith("-start"))
        starts_jx = sum(n for k, n in b.items() if k.endswith("-start"))
        print(f"   {'async *-start (TPU: copies...)':30s} {starts_st:10d} {starts_jx:6d}")
        print(f"   {'copies outside fusions':30s} {n_st:10d} {n_jx:6d}")
        print(f"   {'their bytes':30s} {b_st:10d} {b_jx:6d}")
        print(f"   {'MB read+written (top level)':30s} {traffic(st_opt) / 1e6:10.1f} {traffic(jx_opt) / 1e6:6.1f}")
        if args.breakdown:
            print_breakdown(part, st_text, st_opt, jx_text, jx_opt)


if __name__ == "__main__":
    main()
