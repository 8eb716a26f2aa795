"""The floor under a lazy training step's recording (issue 37 §2): bench/tpu_lazy_probe.py's step (the
bf16 GPT, ``AdamW(capturable=True)``, forward, backward, optimizer) on a tensor subclass whose
``__torch_dispatch__`` does nothing but return result tensors of the right shape (their metadata
memoised per op and argument geometry, as any lazy tracer must at least do). What it costs is torch's
dispatch, autograd, the optimizer's Python and making the result tensors: what any Python
``__torch_dispatch__`` tracer pays before it records anything. Printed per step and per aten op, to
set against the probe's recording time for the same model.

Usage::

    python bench/lazy_floor.py                       # tpu.py's tiny GPT (2 blocks of width 64)
    python bench/lazy_floor.py --layers 8 --width 256
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.optim import optimizer  # noqa: E402
from torch.utils import _foreach_utils  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: E402

import shardtensor as st  # noqa: E402  (the device the optimizer accepts as capturable)
import tpu  # noqa: E402
from gpt_model import GPT  # noqa: E402

_META: dict = {}  # (op, argument template) -> result template


class Null(torch.Tensor):
    """A tensor with a shape and no data; every op on it returns new Null tensors (or its target)."""

    @staticmethod
    def __new__(cls, shape, dtype, strides=None, requires_grad=False):
        if strides is None:
            return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=st.device())
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, strides=strides, device=st.device())

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        flat = [*args, *kwargs.values()] if kwargs else list(args)
        if any(type(a) is list for a in flat):  # foreach ops' lists (one level: all aten takes)
            flat = [b for a in flat for b in (a if type(a) is list else (a,))]
        key = (func, tuple([_sig(a) for a in flat]), tuple(kwargs) if kwargs else ())
        out = _META.get(key)
        if out is None:
            flat, spec = tree_flatten((args, kwargs or {}))
            out = _META[key] = _meta_result(func, flat, spec)
        kind, value = out
        if kind == "arg":
            return flat[value] if not isinstance(value, list) else [flat[i] for i in value]
        leaves, shape = value
        return tree_unflatten([Null(*m) if isinstance(m, tuple) else m for m in leaves], shape)


for _types in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
    _types.append(Null)  # the optimizer's foreach path, as for ShardedTensor


def _sig(a):
    if type(a) is Null:
        return ("T", tuple(a.shape), a.dtype, a.stride())
    if isinstance(a, (int, float, bool, str, torch.dtype, type(None))):
        return a
    return type(a)


def _meta_result(func, flat, spec):
    if any(isinstance(a, torch.Tensor) and type(a) is not Null for a in flat):
        raise TypeError(f"{func}: a tensor that is not Null reached the floor's step")
    meta = [
        torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        if isinstance(a, torch.Tensor)
        else (torch.device("meta") if isinstance(a, torch.device) else a)
        for a in flat
    ]
    args, kwargs = tree_unflatten(meta, spec)
    result = func(*args, **kwargs)
    ids = {id(m): i for i, m in enumerate(meta) if isinstance(m, torch.Tensor)}
    leaves, shape = tree_flatten(result)
    if leaves and all(isinstance(r, torch.Tensor) and id(r) in ids for r in leaves):  # in-place / out=
        picked = [ids[id(r)] for r in leaves]
        return ("arg", picked[0] if not isinstance(result, (list, tuple)) else picked)
    metas = [(tuple(r.shape), r.dtype, r.stride()) if isinstance(r, torch.Tensor) else r for r in leaves]
    return ("new", (metas, shape))


def _to_null(t):
    return Null(tuple(t.shape), t.dtype, t.stride())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    vocab, seq, d, heads, layers, batch, dtype = tpu.TINY["bf16"]
    layers, d = args.layers or layers, args.width or d
    model = GPT(vocab, seq, d, heads, layers, gelu="tanh").to(dtype)
    model._apply(_to_null)
    opt = torch.optim.AdamW(
        model.parameters(), lr=tpu.LR, betas=tpu.BETAS, eps=tpu.EPS, weight_decay=tpu.WD, capturable=True
    )
    for p in model.parameters():  # AdamW's state made here: its own would be st.device() tensors
        opt.state[p] = {
            "step": Null((), torch.float32),
            "exp_avg": Null(tuple(p.shape), p.dtype),
            "exp_avg_sq": Null(tuple(p.shape), p.dtype),
        }
    x, y = Null((batch, seq), torch.int64), Null((batch, seq), torch.int64)
    count = [0]

    def step():
        out = model(x)
        loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    with tpu.xla_attention():
        for _ in range(3):
            step()
        dispatch = Null.__torch_dispatch__.__func__

        def counted(cls, func, types, a=(), k=None):
            count[0] += 1
            return dispatch(cls, func, types, a, k)

        Null.__torch_dispatch__ = classmethod(counted)
        step()
        Null.__torch_dispatch__ = classmethod(dispatch)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    best, mean = min(times), sum(times) / len(times)
    print(
        f"floor, GPT of {layers} blocks of width {d}: {count[0]} aten ops a step; recording {1e3 * mean:.1f} ms "
        f"(best {1e3 * best:.1f}), {1e6 * best / count[0]:.1f} us per op (best step)"
    )


if __name__ == "__main__":
    main()
