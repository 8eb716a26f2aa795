"""PyTorch/XLA's FSDPv2 example, unmodified under shardtensor's torch_xla face, against the same model
written with shardtensor's own API (issue 49's chip row): step times and their ratio, in one process.

The example (``examples/fsdp/train_decoder_only_fsdp_v2.py`` of github.com/pytorch/xla, with
``decoder_only_model.py`` and ``train_decoder_only_base.py`` one folder up) is not part of this
repository: give its path. It runs as ``python`` would run it, with ``torch_xla`` resolving to the face
(``shardtensor.xla.install()``): its own mesh ``(n, 1)`` ``('fsdp', 'model')``, ``MpDeviceLoader`` with
``ShardingSpec(mesh, ('fsdp', None))``, ``FSDPv2`` wrapping each ``DecoderLayer``, Adam, and
``torch_xla.compile(step_fn, full_graph=True)``; its step reads nothing but the loss every 10 steps
(``xm.add_step_closure``). Then the same model class (imported from the example's folder), data,
batch, optimizer and loss run with ``shardtensor.fsdp.FSDPv2``, ``st.MpDeviceLoader`` and
``st.compile``, written as shardtensor's docs write a step (``zero_grad(set_to_none=True)`` after
``step()``, the loss returned detached), reading the loss every 10 steps too.

Step time: from the call of step ``--warmup`` to the end of the last step (the example ends with
``xm.wait_device_ops()``; the shardtensor loop with ``st.sync(wait=True)``), over the steps between.
``--tiny`` shrinks the example's model and batch (its defaults: d=1024, 32768-wide MLP, 2 layers, 16
x 512 tokens per device, 200 steps) by setting the defaults of ``DecoderOnlyConfig``,
``TrainDecoderOnlyBase`` (its ``num_steps``) and its batch size and sequence length before the example
reads them: for a CPU check of this script (the files stay unmodified; the numbers mean nothing).

Example::

    python bench/tpu_xla_example.py /path/to/xla/examples/fsdp/train_decoder_only_fsdp_v2.py        # on the chip
    SHARDTENSOR_CPU_DEVICES=8 python bench/tpu_xla_example.py .../train_decoder_only_fsdp_v2.py --tiny --steps 12
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import runpy
import sys
import time

import torch

TINY_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}
TINY_BATCH, TINY_SEQ = 2, 64  # per device, as the example's 16 x 512


def examples_folder(example: str) -> str:
    """The folder with ``decoder_only_model.py`` and ``train_decoder_only_base.py`` (the example's
    parent's parent, as the example itself computes it)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(example)))


def shrink_example_defaults(folder: str, steps: int | None, tiny: bool) -> None:
    """Before the example imports them: ``num_steps`` (the base class's default) = ``steps``, and with
    ``tiny`` the model config's defaults and the base's batch size and sequence length made small."""
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import decoder_only_model
    import train_decoder_only_base as base

    original_init = base.TrainDecoderOnlyBase.__init__
    defaults = list(original_init.__defaults__)  # (decoder_cls, num_steps, config)
    if steps is not None:
        defaults[1] = steps
    original_init.__defaults__ = tuple(defaults)
    if not tiny:
        return
    config = defaults[2]
    for name, value in TINY_CONFIG.items():
        setattr(config, name, value)
    fields = [f.name for f in dataclasses.fields(decoder_only_model.DecoderOnlyConfig)]
    init = decoder_only_model.DecoderOnlyConfig.__init__
    init.__defaults__ = tuple(TINY_CONFIG.get(f, d) for f, d in zip(fields, init.__defaults__))

    @functools.wraps(original_init)
    def small_batches(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.batch_size, self.seq_len = TINY_BATCH, TINY_SEQ  # (subclasses build their loaders after)

    base.TrainDecoderOnlyBase.__init__ = small_batches


def example_steps() -> int:
    """The number of steps the example will run (its base class's default, after shrinking)."""
    import train_decoder_only_base as base

    init = base.TrainDecoderOnlyBase.__init__
    return getattr(init, "__wrapped__", init).__defaults__[1]


def run_example(example: str, warmup: int) -> dict:
    """Run the example's ``__main__`` under the face, timing each call of its compiled step."""
    import torch_xla

    calls: list[float] = []
    original_compile = torch_xla.compile

    def timed_compile(f=None, *args, **kwargs):
        compiled = original_compile(f, *args, **kwargs)
        if f is None:
            return compiled

        def step(*a, **k):
            calls.append(time.perf_counter())
            return compiled(*a, **k)

        return step

    torch_xla.compile = timed_compile
    torch.manual_seed(42)  # (the example does not seed; the shardtensor run does the same: equal losses)
    argv = sys.argv
    sys.argv = [os.path.abspath(example)]
    try:
        runpy.run_path(os.path.abspath(example), run_name="__main__")
    finally:
        sys.argv, torch_xla.compile = argv, original_compile
    end = time.perf_counter()
    return _summary("torch_xla example under the face", calls, end, warmup)


def run_shardtensor(folder: str, steps: int, warmup: int, tiny: bool, zero_grad_first: bool = False) -> dict:
    """The same model, data, batch, optimizer and loss with shardtensor's API."""
    import numpy as np

    import shardtensor as st
    from shardtensor.fsdp import FSDPv2, transformer_auto_wrap_policy

    sys.path.insert(0, folder)
    import decoder_only_model

    torch.manual_seed(42)
    config = decoder_only_model.DecoderOnlyConfig()
    n = st.global_runtime_device_count()
    batch, seq = (TINY_BATCH, TINY_SEQ) if tiny else (16, 512)
    mesh = st.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    st.set_global_mesh(mesh)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={decoder_only_model.DecoderLayer})
    model = FSDPv2(decoder_only_model.DecoderOnlyModel(config), auto_wrap_policy=policy)
    opt = torch.optim.Adam(model.parameters(), lr=0.0001)
    loss_fn = torch.nn.CrossEntropyLoss()
    data = torch.zeros(batch * n, seq, dtype=torch.int64)
    batches = [(data, data)] * steps
    loader = st.MpDeviceLoader(batches, st.device(), input_sharding=st.ShardingSpec(mesh, ("fsdp", None)))

    @st.compile(full_graph=True)
    def step_fn(x, y):
        if zero_grad_first:  # (the example's order: then st.compile re-runs the step's Python each call)
            opt.zero_grad()
        logits = model(x)
        loss = loss_fn(logits.view(-1, config.vocab_size), y.view(-1))
        loss.backward()
        opt.step()
        if not zero_grad_first:
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    calls: list[float] = []
    to_print = None
    model.train()
    for i, (x, y) in enumerate(loader):
        if to_print is not None:
            print(f"shardtensor step: {to_print[0]}, loss: {to_print[1].item()}", flush=True)
            to_print = None
        calls.append(time.perf_counter())
        loss = step_fn(x, y)
        if i % 10 == 0:
            to_print = (i, loss)
    st.sync(wait=True)
    end = time.perf_counter()
    return _summary("the same model with shardtensor's API", calls, end, warmup)


def _summary(what: str, calls: list[float], end: float, warmup: int) -> dict:
    if len(calls) <= warmup:
        raise SystemExit(f"{what}: {len(calls)} steps ran, fewer than --warmup {warmup} + 1")
    timed = len(calls) - warmup
    return {"what": what, "steps": len(calls), "timed_steps": timed, "step_ms": (end - calls[warmup]) / timed * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("example", help="path to examples/fsdp/train_decoder_only_fsdp_v2.py of pytorch/xla")
    p.add_argument("--steps", type=int, default=None, help="steps of both runs (default: the example's, 200)")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the timing (compiles)")
    p.add_argument("--tiny", action="store_true", help="small model and batch, for a CPU check")
    p.add_argument(
        "--zero-grad-first",
        action="store_true",
        help="the shardtensor step zeroes the gradients first, as the example does "
        "(st.compile then re-runs its Python each step)",
    )
    args = p.parse_args()
    folder = examples_folder(args.example)
    import shardtensor.xla

    shardtensor.xla.install()  # (the example's base module imports torch_xla)
    shrink_example_defaults(folder, args.steps, args.tiny)
    steps = example_steps()
    face = run_example(args.example, args.warmup)
    own = run_shardtensor(folder, steps, args.warmup, args.tiny, args.zero_grad_first)
    import shardtensor as st

    platform = st.global_runtime_device_attributes()[0]["device_kind"]
    devices = st.global_runtime_device_count()
    print(f"\n{devices} x {platform}, {steps} steps, timed after {args.warmup}{' (--tiny)' if args.tiny else ''}")
    for row in (face, own):
        print(f"  {row['what']:<40} {row['step_ms']:10.2f} ms/step")
    ratio = face["step_ms"] / own["step_ms"]
    print(f"  ratio (face / shardtensor's API)        {ratio:10.3f}")
    print(json.dumps({"face": face, "shardtensor": own, "ratio": ratio, "device": platform, "devices": devices}))


if __name__ == "__main__":
    main()
