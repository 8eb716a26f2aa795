"""``_foreach_*`` lowerings against eager torch on CPU (the ops torch.optim's foreach paths use)."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _lowering_harness import Batch, make  # noqa: E402

aten = torch.ops.aten
F32, F64, BF16, I64 = torch.float32, torch.float64, torch.bfloat16, torch.int64


def _tensors(seed=0, dtypes=(F32, F32, BF16, F64), low=-3, high=3):
    shapes = [(3, 4), (5,), (2, 2, 2), ()]
    return [make(s, d, seed=seed + i, low=low, high=high) for i, (s, d) in enumerate(zip(shapes, dtypes))]


def test_unary():
    # the single-tensor lowerings are tested elsewhere: here, the plumbing over mixed-dtype lists
    xs, pos = _tensors()[1:3], _tensors(low=0.5, high=3)[1:3]
    with Batch() as b:
        for name in (
            "abs",
            "ceil",
            "cos",
            "cosh",
            "erf",
            "erfc",
            "exp",
            "expm1",
            "floor",
            "frac",
            "neg",
            "round",
            "sigmoid",
            "sign",
            "sin",
            "sinh",
            "tan",
            "tanh",
            "trunc",
            "atan",
            "lgamma",
            "zero",
        ):
            b.check(getattr(aten, f"_foreach_{name}").default, xs)
        for name in ("sqrt", "rsqrt", "log", "log10", "log1p", "log2", "reciprocal", "acos", "asin"):
            b.check(getattr(aten, f"_foreach_{name}").default, [x / 3 for x in pos])
        b.check(aten._foreach_clone.default, xs)
        b.check(aten._foreach_max.default, _tensors()[:3])
        b.check(aten._foreach_neg.default, [make((3,), I64)])


def test_binary():
    xs, ys = _tensors(0), _tensors(10)
    nz = [y.abs() + 0.5 for y in ys]
    scalars = [2.5, -1, 0.5, 3]
    with Batch() as b:
        for name in ("add", "sub"):
            op = getattr(aten, f"_foreach_{name}")
            b.check(op.List, xs, ys)
            b.check(op.List, xs, ys, alpha=-0.5)
            b.check(op.Scalar, xs, 2.5)
            b.check(op.ScalarList, xs, scalars)
        b.check(aten._foreach_add.Tensor, xs, torch.tensor(0.3))
        b.check(aten._foreach_add.Tensor, xs, torch.tensor(0.3, dtype=F64), alpha=2)
        for name in ("mul", "div"):
            op = getattr(aten, f"_foreach_{name}")
            b.check(op.List, xs, nz)
            b.check(op.Scalar, xs, 0.1)
            b.check(op.ScalarList, xs, scalars)
            b.check(op.Tensor, xs, torch.tensor(1.7))
        for name in ("maximum", "minimum", "clamp_min", "clamp_max"):
            op = getattr(aten, f"_foreach_{name}")
            b.check(op.List, xs, ys)
            b.check(op.Scalar, xs, 0.5)
            b.check(op.ScalarList, xs, scalars)
        b.check(aten._foreach_pow.List, nz, ys)
        b.check(aten._foreach_pow.Scalar, xs, 2)
        b.check(aten._foreach_pow.Scalar, nz, 0.5)
        b.check(aten._foreach_pow.ScalarList, nz, scalars)
        b.check(aten._foreach_pow.ScalarAndTensor, 0.9, ys)
        b.check(aten._foreach_copy.default, xs, ys)


def test_promotion():
    ints = [make((4,), I64, seed=1), make((2, 3), I64, seed=2)]
    with Batch() as b:
        b.check(aten._foreach_add.Scalar, ints, 2.5)  # int + float scalar -> float32
        b.check(aten._foreach_add.Scalar, ints, 2)
        b.check(aten._foreach_mul.ScalarList, ints, [2, 0.5])
        b.check(aten._foreach_div.Scalar, ints, 2)


def test_pointwise():
    xs, t1, t2 = _tensors(0), _tensors(10), [t.abs() + 0.5 for t in _tensors(20)]
    scalars = [0.5, -2, 1, 0.001]
    with Batch() as b:
        for name in ("addcmul", "addcdiv"):
            op = getattr(aten, f"_foreach_{name}")
            b.check(op.Scalar, xs, t1, t2)
            b.check(op.Scalar, xs, t1, t2, -0.3)
            b.check(op.ScalarList, xs, t1, t2, scalars)
            b.check(op.Tensor, xs, t1, t2, torch.tensor(scalars))
            b.check(op.Tensor, xs, t1, t2, torch.tensor(scalars, dtype=F64))
        b.check(aten._foreach_lerp.Scalar, xs, t1, 0.1)
        b.check(aten._foreach_lerp.Scalar, xs, t1, 0.9)
        b.check(aten._foreach_lerp.ScalarList, xs, t1, [0.1, 0.6, 1.0, -0.5])
        b.check(aten._foreach_lerp.List, xs, t1, [torch.full_like(x, 0.3) for x in xs])


def test_norms_and_mm():
    xs = _tensors(0)
    with Batch() as b:
        for ord in (2, 1, float("inf"), 3):
            b.check(aten._foreach_norm.Scalar, xs, ord)
        b.check(aten._foreach_norm.Scalar, xs, 2, F64)
        b.check(aten._foreach_powsum.Scalar, xs, 2)
        b.check(aten._foreach_powsum.Scalar, xs, 3)
        b.check(
            aten._foreach_mm.default,
            [make((2, 3), F32), make((4, 2), F64)],
            [make((3, 5), F32, seed=1), make((2, 2), F64, seed=1)],
        )
        b.check(aten._foreach_mm.default, [make((2, 3), BF16)], [make((3, 5), BF16, seed=1)])


def test_adam_step_matches_torch():
    """torch.optim.Adam(foreach=True)'s step, lowered op by op, against torch's own step."""
    torch.manual_seed(0)
    params = [torch.randn(4, 3), torch.randn(5)]
    grads = [torch.randn_like(p) for p in params]
    exp_avg, exp_avg_sq = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    lr, b1, b2, eps, step = 1e-2, 0.9, 0.999, 1e-8, 1
    with Batch() as b:
        b.check(aten._foreach_lerp.Scalar, exp_avg, grads, 1 - b1)
        b.check(aten._foreach_mul.Scalar, exp_avg_sq, b2)
        b.check(aten._foreach_addcmul.Scalar, exp_avg_sq, grads, grads, 1 - b2)
        denom = torch._foreach_sqrt(exp_avg_sq)
        b.check(aten._foreach_sqrt.default, exp_avg_sq)
        b.check(aten._foreach_div.Scalar, denom, (1 - b2**step) ** 0.5)
        b.check(aten._foreach_add.Scalar, denom, eps)
        b.check(aten._foreach_addcdiv.ScalarList, params, exp_avg, [d + 1 for d in denom], [-lr / (1 - b1**step)] * 2)
