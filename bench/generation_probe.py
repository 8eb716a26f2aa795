"""Where ``st.generate``'s time goes, per token: counters, a profile of one call, and the frozen decode
step called alone. For the TPU (``python3 bench/generation_probe.py``, after ``source
bench/tpu_setup.sh`` with ``TPU_SETUP_HF=1``) and the CPU (``--tiny``).

Printed: for one steady ``st.generate`` (batch 1, 64 new tokens, the bench/tpu_llama.py model) with the
device loop and with transformers' loop, the wall time per token and the counters that moved (traces,
frozen replays, program runs, transfers, compiles); the functions where the device loop's call
spends its time (cProfile, by own time); and the decode step's own cost: 20 calls back to back, then
one read, per call.

It uses shardtensor's public API, plus ``decode_loop``'s kept loop for the last part.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import shardtensor as st  # noqa: E402
from tpu_llama import FULL, TINY, _model  # noqa: E402

COUNTERS = (
    "CompileTrace",
    "CompileFrozen",
    "CompileReplay",
    "ExecuteReplicated",
    "TransferToDevice",
    "TransferFromDevice",
    "UncachedCompile",
    "CachedCompile",
    "MarkStep",
)


def counters() -> dict:
    return {name: st.counter_value(name) or 0 for name in COUNTERS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    c = TINY if args.tiny else FULL
    model, _ = _model(c)
    model = model.to(st.device())
    st.sync()
    prompt = torch.randint(0, c["vocab"], (1, c["prompt"]), generator=torch.Generator().manual_seed(5))
    kwargs = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    for loop in (True, False):
        for _ in range(2):
            st.generate(model, prompt, device_loop=loop, **kwargs)
        before = counters()
        t0 = time.perf_counter()
        st.generate(model, prompt, device_loop=loop, **kwargs)
        seconds = time.perf_counter() - t0
        moved = {k: v - before[k] for k, v in counters().items() if v != before[k]}
        print(f"device_loop={loop}: {1e3 * seconds / args.new:.2f} ms per token; counters: {moved}")

    profile = cProfile.Profile()
    profile.enable()
    st.generate(model, prompt, **kwargs)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])

    from shardtensor import decode_loop

    loops = [loop for kept in decode_loop._LOOPS.values() for loop in kept.values()]
    step = loops[-1].step
    st.generate(model, prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)  # the cache nearly empty
    calls = 20
    with torch.no_grad():  # as generate runs it
        t0 = time.perf_counter()
        for _ in range(calls):
            flag = step()
        queued = time.perf_counter() - t0
        bool(flag)
        total = time.perf_counter() - t0
    per_call, with_read = 1e6 * queued / calls, 1e6 * total / calls
    print(f"decode step alone: {per_call:.0f} us per call to queue, {with_read:.0f} us with a read")


if __name__ == "__main__":
    main()
