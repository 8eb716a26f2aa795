"""Elementwise lowerings against eager torch on CPU: values, shapes and exact dtypes, including
torch's type promotion with Python scalars, NaN propagation and integer division signs.

Checks are batched (``Batch``): one jit compile per test, scalars as weakly typed tracers."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _lowering_harness import Batch, call, check, dtypes, make, to_jax, to_torch  # noqa: E402

aten = torch.ops.aten
F32, F64, BF16, F16, I64, I32, BOOL = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.bool,
)
U8, I8 = torch.uint8, torch.int8


# ----------------------------------------------------------------------------------------------
# unary
# ----------------------------------------------------------------------------------------------
UNARY_FLOAT = {
    "exp": (-3, 3),
    "exp2": (-3, 3),
    "expm1": (-3, 3),
    "log": (0.1, 5),
    "log2": (0.1, 5),
    "log10": (0.1, 5),
    "log1p": (-0.5, 5),
    "sqrt": (0, 5),
    "rsqrt": (0.1, 5),
    "sin": (-3, 3),
    "cos": (-3, 3),
    "tan": (-1.2, 1.2),
    "tanh": (-3, 3),
    "asin": (-0.9, 0.9),
    "acos": (-0.9, 0.9),
    "atan": (-3, 3),
    "sinh": (-3, 3),
    "cosh": (-3, 3),
    "asinh": (-3, 3),
    "acosh": (1, 5),
    "atanh": (-0.9, 0.9),
    "sigmoid": (-5, 5),
    "erf": (-3, 3),
    "erfc": (-3, 3),
    "erfinv": (-0.9, 0.9),
    "lgamma": (-3.5, 5),
    "digamma": (0.1, 5),
    "i0": (-3, 3),
    "reciprocal": (0.5, 3),
    "deg2rad": (-3, 3),
    "rad2deg": (-3, 3),
    "sinc": (-3, 3),
    "angle": (-3, 3),
}


@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_unary_float(dtype):
    with Batch() as b:
        for name, (lo, hi) in sorted(UNARY_FLOAT.items()):
            b.check(getattr(aten, name).default, make((3, 4), dtype, low=lo, high=hi))


def test_unary_float_from_int_and_bool():
    # integer and bool inputs give the default float dtype
    with Batch() as b:
        for dtype in (I64, I32, BOOL, U8):
            for name in ("exp", "sqrt", "sin", "sigmoid", "reciprocal", "log1p", "erf", "angle", "rsqrt"):
                b.check(getattr(aten, name).default, make((5,), dtype, low=1, high=4))


def test_unary_special_values():
    x = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), -2.0, -1.0, 1.0])
    with Batch() as b:
        for name in (
            "digamma",
            "lgamma",
            "erfinv",
            "log",
            "sqrt",
            "rsqrt",
            "reciprocal",
            "sinc",
            "sigmoid",
            "angle",
            "exp",
            "tanh",
            "erf",
            "log1p",
            "expm1",
        ):
            b.check(getattr(aten, name).default, x)


@pytest.mark.parametrize("dtype", [F32, F64, BF16, I64, I32, I8])
def test_unary_same_dtype(dtype):
    x = make((4, 3), dtype, low=-5, high=5)
    if dtype.is_floating_point:
        x[0, :3] = torch.tensor([float("nan"), -0.0, 2.5])  # round half to even, sign of nan and -0
        x[1, :2] = torch.tensor([-2.5, 0.5])
    with Batch() as b:
        for name in ("abs", "neg", "sign", "sgn", "floor", "ceil", "round", "trunc", "frac", "conj_physical"):
            if name == "frac" and not dtype.is_floating_point:
                continue  # torch: float only
            b.check(getattr(aten, name).default, x)


def test_unary_bool():
    with Batch() as b:
        for name in ("sign", "sgn", "floor", "ceil", "round", "trunc", "bitwise_not", "logical_not", "abs", "neg"):
            b.check_or_skip(getattr(aten, name).default, torch.tensor([True, False]))


def test_round_decimals_nan_to_num_logit():
    nonfinite = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.5])
    with Batch() as b:
        for dtype in (F32, F64):
            x = make((20,), dtype, low=-500, high=500)
            for decimals in (-2, -1, 0, 1, 3):
                b.check(aten.round.decimals, x, decimals=decimals)
        for dtype in (F32, F64, BF16):
            b.check(aten.nan_to_num.default, nonfinite.to(dtype))
            b.check(aten.nan_to_num.default, nonfinite.to(dtype), 1.0, 2.0, -3.0)
        b.check(aten.nan_to_num.default, torch.tensor([1, 2]))
        p = torch.tensor([0.0, 0.05, 0.3, 0.7, 1.0, 1.2, -0.1])
        b.check(aten.logit.default, p)
        b.check(aten.logit.default, p, 0.1)
        b.check(aten.logit.default, p.to(BF16), 0.1)


def test_predicates():
    x = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), -2.0, 1.0])
    with Batch() as b:
        for name in ("isnan", "isinf", "isposinf", "isneginf", "isfinite", "signbit"):
            op = getattr(aten, name).default
            b.check(op, x)
            b.check(op, x.to(BF16))
            b.check(op, torch.tensor([-1, 0, 3]))
            b.check(op, torch.tensor([True, False]))


# ----------------------------------------------------------------------------------------------
# promotion
# ----------------------------------------------------------------------------------------------
def _operand(kind, seed, shape=(3, 4)):
    """Test operands: tensors with dimensions, 0-dim tensors, and Python scalars."""
    table = {
        "f32": lambda: make(shape, F32, seed=seed),
        "f64": lambda: make(shape, F64, seed=seed),
        "bf16": lambda: make(shape, BF16, seed=seed),
        "f16": lambda: make((3, 4), F16, seed=seed),
        "i64": lambda: make(shape, I64, low=1, high=6, seed=seed),
        "i64neg": lambda: make(shape, I64, low=-6, high=-1, seed=seed),
        "i32": lambda: make((3, 4), I32, low=1, high=6, seed=seed),
        "u8": lambda: make((3, 4), U8, low=1, high=6, seed=seed),
        "i8": lambda: make((3, 4), I8, low=-5, high=-1, seed=seed),
        "bool": lambda: make(shape, BOOL, seed=seed),
        "f32_row": lambda: make(shape[-1:], F32, seed=seed),
        "f64_0d": lambda: torch.tensor(1.75, dtype=F64),
        "i64_0d": lambda: torch.tensor(3),
        "f32_0d": lambda: torch.tensor(-1.25),
        "bf16_0d": lambda: torch.tensor(0.5, dtype=BF16),
        "u8_0d": lambda: torch.tensor(7, dtype=U8),
        "bool_0d": lambda: torch.tensor(True),
        "py_float": lambda: 2.5,
        "py_negfloat": lambda: -1.5,
        "py_int": lambda: 3,
        "py_negint": lambda: -2,
        "py_bool": lambda: True,
    }
    return table[kind]()


KINDS = [
    "f32",
    "f64",
    "bf16",
    "f16",
    "i64",
    "i32",
    "u8",
    "i8",
    "bool",
    "f64_0d",
    "i64_0d",
    "f32_0d",
    "bf16_0d",
    "u8_0d",
    "bool_0d",
    "py_float",
    "py_int",
    "py_bool",
]


def _torch_result_type(vals):
    if len(vals) == 2:
        a, b = vals
        if not isinstance(a, torch.Tensor):
            a, b = b, a
        return torch.result_type(a, b)
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    return elementwise_dtypes(*vals, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]


def test_result_type_matches_torch():
    """The promotion helper against torch.result_type (no XLA involved): every pair and triple."""
    from shardtensor.ops._promote import result_type

    for ka in KINDS:
        for kb in KINDS:
            for kc in (None, "py_float", "i64_0d", "bf16", "py_bool"):
                vals = [_operand(k, 0) for k in (ka, kb, kc) if k is not None]
                if not any(isinstance(v, torch.Tensor) for v in vals):
                    continue
                want = _torch_result_type(vals)
                got = result_type(*[to_jax(v) if isinstance(v, torch.Tensor) else v for v in vals])
                assert dtypes.to_torch(got) == want, (ka, kb, kc, got, want)


PAIRS = [
    ("f32", "f32_row"),
    ("i64", "i64neg"),
    ("i32", "py_float"),
    ("bf16", "py_float"),
    ("bool", "bool"),
    ("f64_0d", "i64"),
    ("bf16", "f32_0d"),
    ("f16", "bf16"),
    ("u8", "i8"),
    ("i64", "py_int"),
    ("bool", "py_int"),
]
BINARY = {
    "add": aten.add.Tensor,
    "sub": aten.sub.Tensor,
    "mul": aten.mul.Tensor,
    "div": aten.div.Tensor,
    "remainder": aten.remainder.Tensor,
    "fmod": aten.fmod.Tensor,
    "atan2": aten.atan2.default,
    "maximum": aten.maximum.default,
    "minimum": aten.minimum.default,
    "fmax": aten.fmax.default,
    "fmin": aten.fmin.default,
    "eq": aten.eq.Tensor,
    "ne": aten.ne.Tensor,
    "lt": aten.lt.Tensor,
    "le": aten.le.Tensor,
    "gt": aten.gt.Tensor,
    "ge": aten.ge.Tensor,
    "copysign": aten.copysign.Tensor,
    "hypot": aten.hypot.default,
    "logaddexp": aten.logaddexp.default,
    "logaddexp2": aten.logaddexp2.default,
    "xlogy": aten.xlogy.Tensor,
    "xlog1py": aten.special_xlog1py.default,
    "floor_divide": aten.floor_divide.default,
    "bitwise_and": aten.bitwise_and.Tensor,
    "bitwise_or": aten.bitwise_or.Tensor,
    "bitwise_xor": aten.bitwise_xor.Tensor,
    "logical_and": aten.logical_and.default,
    "logical_or": aten.logical_or.default,
    "logical_xor": aten.logical_xor.default,
    "rsub": aten.rsub.Tensor,
    "nextafter": aten.nextafter.default,
    "heaviside": aten.heaviside.default,
    "pow": aten.pow.Tensor_Tensor,
}


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_binary_ops(pair):
    a, b_ = _operand(pair[0], 1), _operand(pair[1], 2)
    if not isinstance(a, torch.Tensor):
        a, b_ = b_, a
    if pair[1] == "i64neg":
        a = a.abs()  # pow with negative exponents is tested separately
    with Batch() as b:
        for name, op in sorted(BINARY.items()):
            if name == "pow" and pair[1] == "i64neg":
                continue
            b.check_or_skip(op, a, b_)


SCALAR_OVERLOADS = [
    aten.add.Scalar,
    aten.sub.Scalar,
    aten.mul.Scalar,
    aten.div.Scalar,
    aten.remainder.Scalar,
    aten.fmod.Scalar,
    aten.eq.Scalar,
    aten.ne.Scalar,
    aten.lt.Scalar,
    aten.le.Scalar,
    aten.gt.Scalar,
    aten.ge.Scalar,
    aten.rsub.Scalar,
    aten.copysign.Scalar,
    aten.xlogy.Scalar_Other,
    aten.special_xlog1py.other_scalar,
    aten.floor_divide.Scalar,
    aten.pow.Tensor_Scalar,
    aten.bitwise_and.Scalar,
    aten.bitwise_xor.Scalar,
]
# the .Tensor overloads with a Python scalar: what ``x + 2.5`` dispatches
TENSOR_WITH_SCALAR = [
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.remainder.Tensor,
    aten.maximum.default,
    aten.bitwise_or.Tensor,
]


@pytest.mark.parametrize("kind", ["f32", "i64", "bf16", "bool", "u8"])
def test_scalar_overloads(kind):
    x = _operand(kind, 3)
    with Batch() as b:
        for scalar in (2.5, -2, True, 0.7123):
            for op in SCALAR_OVERLOADS:
                b.check_or_skip(op, x, scalar)
            for op in TENSOR_WITH_SCALAR:
                b.check_or_skip(op, x, scalar)


def test_scalar_first_overloads():
    with Batch() as b:
        for kind in ("f32", "i64", "bf16"):
            x = _operand(kind, 4)
            for scalar in (2.5, 3, 1):
                for op in (
                    aten.remainder.Scalar_Tensor,
                    aten.pow.Scalar,
                    aten.xlogy.Scalar_Self,
                    aten.bitwise_or.Scalar_Tensor,
                    aten.special_xlog1py.self_scalar,
                    aten.bitwise_left_shift.Scalar_Tensor,
                ):
                    b.check_or_skip(op, scalar, x)


def test_add_sub_alpha():
    pairs = [
        ("f32", "f32"),
        ("i64", "i64neg"),
        ("bf16", "py_float"),
        ("i64", "py_int"),
        ("f64", "f32_row"),
        ("bool", "bool"),
        ("bf16", "bf16"),
    ]
    with Batch() as b:
        for pa, pb in pairs:
            # (4, 8): torch's scalar (non-vectorised) CPU loop for tiny bfloat16 tensors rounds alpha * y
            # to bfloat16 before adding; its vectorised loop, like us, does not
            x, y = _operand(pa, 5, (4, 8)), _operand(pb, 6, (4, 8))
            for alpha in (1, 2, -0.5, 0.7123):
                for op, scalar_op in (
                    (aten.add.Tensor, aten.add.Scalar),
                    (aten.sub.Tensor, aten.sub.Scalar),
                    (aten.rsub.Tensor, aten.rsub.Scalar),
                ):
                    b.check_or_skip(op, x, y, alpha=alpha, **_bf16_reference(op, x, y, alpha=alpha))
                    if not isinstance(y, torch.Tensor):
                        b.check_or_skip(scalar_op, x, y, alpha, **_bf16_reference(scalar_op, x, y, alpha))


def _bf16_reference(op, x, y, alpha):
    """For a bfloat16 result: torch's rule (alpha rounded to bfloat16 first) computed in float64 and
    rounded to bfloat16, within one bfloat16 ulp (2^-7 relative). torch's own bf16 kernels differ by
    CPU (the unvectorised loop also rounds ``alpha * y`` to bf16 before adding)."""
    if not any(isinstance(a, torch.Tensor) and a.dtype == BF16 for a in (x, y)):
        return {}
    x, y = (a.double() if isinstance(a, torch.Tensor) else a for a in (x, y))
    alpha = torch.tensor(alpha, dtype=BF16).item()
    try:
        return {"expected": op(x, y, alpha=alpha).to(BF16), "rtol": 2**-7, "atol": 0}
    except RuntimeError:  # torch rejects the call itself (check_or_skip then skips it)
        return {}


def test_promotion_examples():
    # the cases jax gets wrong by itself under x64
    i = torch.arange(6).reshape(2, 3)
    cases = [
        (aten.div.Tensor, (i, torch.tensor([2, 3, 4])), F32),
        (aten.mul.Tensor, (i.int(), 2.5), F32),
        (aten.add.Tensor, (torch.ones(3, dtype=BF16), 1.1), BF16),
        (aten.add.Tensor, (torch.ones(3, dtype=F16), torch.tensor(1.1, dtype=F64)), F16),
        (aten.add.Tensor, (torch.tensor([True, False]), torch.tensor([True, True])), BOOL),
        (aten.mul.Tensor, (torch.tensor([True, False]), 2), I64),
        (aten.lt.Scalar, (i, 2.5), BOOL),
        (aten.eq.Scalar, (torch.tensor([1, 2], dtype=U8), -255), BOOL),
        (aten.add.Tensor, (torch.tensor([1, 2], dtype=U8), -1), U8),
    ]
    with Batch() as b:
        for op, args, want in cases:
            assert op(*args).dtype == want
            b.check(op, *args)


# ----------------------------------------------------------------------------------------------
# division, remainder and power: torch's signs and rules
# ----------------------------------------------------------------------------------------------
def test_integer_division_signs():
    with Batch() as b:
        for dtype in (I64, I32, I8):
            x = torch.tensor([-7, 7, -7, 7, 0, 5, -5, 9, -1, 6], dtype=dtype)
            y = torch.tensor([2, -2, -2, 2, 3, 5, 3, -4, 7, -6], dtype=dtype)
            for mode in ("floor", "trunc", None):
                b.check(aten.div.Tensor_mode, x, y, rounding_mode=mode)
                b.check(aten.div.Scalar_mode, x, -3, rounding_mode=mode)
            b.check(aten.div.Tensor, x, y)
            b.check(aten.floor_divide.default, x, y)
            b.check(aten.remainder.Tensor, x, y)
            b.check(aten.fmod.Tensor, x, y)
            b.check(aten.remainder.Scalar, x, -3)
            b.check(aten.fmod.Scalar, x, -3)
            b.check(aten.floor_divide.Scalar, x, 4)


def test_float_division_signs():
    x = torch.tensor([-7.5, 7.5, -7.0, 7.0, 0.0, 5.0, -5.0, 1.0, -1.0, 0.3, float("nan"), float("inf")])
    y = torch.tensor([2.0, -2.0, -2.0, 2.0, 3.0, 0.0, 0.0, float("inf"), -float("inf"), 0.1, 1.0, 2.0])
    with Batch() as b:
        for dtype in (F32, F64, BF16):
            xd, yd = x.to(dtype), y.to(dtype)
            for mode in ("floor", "trunc", None):
                b.check(aten.div.Tensor_mode, xd, yd, rounding_mode=mode)
                b.check(aten.div.Scalar_mode, xd, -0.7, rounding_mode=mode)
            b.check(aten.remainder.Tensor, xd, yd)
            b.check(aten.fmod.Tensor, xd, yd)
            b.check(aten.floor_divide.default, xd, yd)
            b.check(aten.remainder.Scalar, xd, -0.7)
            b.check(aten.fmod.Scalar, xd, 0.7)


def test_integer_pow():
    with Batch() as b:
        for dtype in (I64, I32, U8):
            low = 0 if dtype == U8 else -3
            base = make((12,), dtype, low=low, high=4, seed=7)
            exp = make((12,), dtype, low=0, high=6, seed=8)
            b.check(aten.pow.Tensor_Tensor, base, exp)
            for e in (0, 1, 2, 3, 5, 2.5):
                b.check(aten.pow.Tensor_Scalar, base, e)  # a float exponent gives the default float
            b.check(aten.pow.Scalar, 2, exp)
            b.check(aten.pow.Scalar, 1.5, exp)
        # negative exponents: 1 -> 1, -1 -> +-1, others -> 0; and an exponent past 63 bits of squaring
        b.check(
            aten.pow.Tensor_Tensor,
            torch.tensor([-3, -2, -1, -1, 0, 1, 1, 2, 3, 2, -1, 3]),
            torch.tensor([-1, -2, -1, -2, 3, -5, 4, -1, 2, 40, 101, 70]),
        )


@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_float_pow(dtype):
    x = make((10,), dtype, low=-3, high=3)
    with Batch() as b:
        for e in (2, 3, 0.5, -0.5, -1, -2, 1, 0, 1.7, -2.3):
            b.check(aten.pow.Tensor_Scalar, x, e)
            b.check(aten.pow.Scalar, e, x)
        b.check(aten.pow.Tensor_Tensor, x.abs(), make((10,), dtype, low=-2, high=2, seed=3))
        b.check(
            aten.pow.Tensor_Tensor, x, torch.tensor([2.0, 3.0, 0.5, -1.0, 0.0, 1.0, 2.0, 3.0, -2.0, 4.0], dtype=dtype)
        )


def test_jit_and_eager_agree():
    x = make((5,), F32)
    for op, args in ((aten.pow.Tensor_Scalar, (x, 2.0)), (aten.add.Tensor, (x, 2.5)), (aten.clamp.default, (x, 0))):
        a = to_torch(call(op, *args, jit=True))
        e = to_torch(call(op, *args, jit=False))
        torch.testing.assert_close(a, e)


# ----------------------------------------------------------------------------------------------
# NaN propagation
# ----------------------------------------------------------------------------------------------
def test_nan_propagation():
    nan = float("nan")
    with Batch() as b:
        for dtype in (F32, F64, BF16):
            x = torch.tensor([nan, 1.0, nan, -0.0, 2.0], dtype=dtype)
            y = torch.tensor([1.0, nan, nan, 0.0, -1.0], dtype=dtype)
            for op in (aten.maximum.default, aten.minimum.default, aten.fmax.default, aten.fmin.default):
                b.check(op, x, y)
            b.check(aten.clamp.default, x, 0.5, 1.5)
            b.check(aten.clamp.default, x, nan)
            b.check(aten.clamp.Tensor, x, y, None)
            b.check(aten.clamp_min.default, x, 0.5)
            b.check(aten.clamp_max.default, x, 0.5)
        for dtype in (I64, BOOL):
            x, y = make((6,), dtype, seed=1), make((6,), dtype, seed=2)
            b.check(aten.maximum.default, x, y)
            b.check(aten.minimum.default, x, y)


# ----------------------------------------------------------------------------------------------
# bitwise, logical
# ----------------------------------------------------------------------------------------------
def test_bitwise_and_shifts():
    with Batch() as b:
        for dtype in (I64, I32, U8, I8, BOOL):
            x, y = make((8,), dtype, low=-100, high=100, seed=1), make((8,), dtype, low=-100, high=100, seed=2)
            if dtype == U8:
                x, y = x.abs(), y.abs()
            b.check(aten.bitwise_not.default, x)
            for name in ("bitwise_and", "bitwise_or", "bitwise_xor"):
                b.check(getattr(aten, name).Tensor, x, y)
            b.check(aten.logical_not.default, x)
            b.check(aten.logical_and.default, x, y)
            if dtype == BOOL:
                continue
            s = torch.tensor([0, 1, 3, 7, 2, 5, 6, 4], dtype=dtype)
            b.check(aten.bitwise_left_shift.Tensor, x, s)
            b.check(aten.bitwise_right_shift.Tensor, x, s)
            b.check(aten.bitwise_left_shift.Tensor_Scalar, x, 2)
            b.check(aten.bitwise_right_shift.Tensor_Scalar, x, 3)
        fx, iy = torch.tensor([0.0, 1.5, float("nan"), -0.0]), torch.tensor([2, 0, 0, 1])
        b.check(aten.logical_not.default, fx)
        b.check(aten.logical_or.default, fx, iy)
        b.check(aten.logical_xor.default, fx, iy)


# ----------------------------------------------------------------------------------------------
# where, clamp, lerp, addcmul, addcdiv, masked_fill
# ----------------------------------------------------------------------------------------------
def test_where():
    c = make((3, 4), BOOL)
    with Batch() as b:
        b.check(aten.where.self, c, make((3, 4), F32), make((4,), F32, seed=1))
        b.check(aten.where.self, c, make((3, 4), I64), make((3, 4), F32))
        b.check(aten.where.self, c, make((3, 4), BF16), torch.tensor(0.0))
        b.check(aten.where.self, c, make((3, 4), I32), torch.tensor(5))
        b.check(aten.where.self, c, make((3, 1), F64), make((1, 4), F32))


def test_clamp():
    with Batch() as b:
        for dtype in (F32, F64, BF16, I64, I32):
            x = make((3, 5), dtype, low=-6, high=6)
            b.check(aten.clamp.default, x, -2, 3)
            b.check(aten.clamp.default, x, None, 1)
            b.check(aten.clamp.default, x, -1.5, 2.5)  # promotes integer tensors to float
            b.check(aten.clamp.default, x, 3, -2)  # min > max gives max
            b.check(aten.clamp_min.default, x, 0)
            b.check(aten.clamp_max.default, x, 0.5)
            lo, hi = make((5,), dtype, low=-6, high=0, seed=4), make((3, 1), dtype, low=0, high=6, seed=5)
            b.check(aten.clamp.Tensor, x, lo, hi)
            b.check(aten.clamp.Tensor, x, None, hi)
            b.check(aten.clamp_min.Tensor, x, lo)
            b.check(aten.clamp_max.Tensor, x, hi)


def test_lerp_addcmul_addcdiv():
    with Batch() as b:
        for dtype in (F32, F64, BF16):
            x, y = make((3, 4), dtype, seed=1), make((3, 4), dtype, seed=2)
            for w in (0.0, 0.25, 0.5, 0.9, 1.0, -0.3, 1.7, 0.7123):
                b.check(aten.lerp.Scalar, x, y, w)
            b.check(aten.lerp.Tensor, x, y, make((3, 4), dtype, low=-0.5, high=1.5, seed=3))
            b.check(aten.lerp.Tensor, x, y, torch.tensor(0.7, dtype=dtype))
            t2 = make((4,), dtype, low=0.5, high=2, seed=3)
            for value in (1, 0.5, -2, 0.7123):
                b.check(aten.addcmul.default, x, y, t2, value=value)
                b.check(aten.addcdiv.default, x, y, t2, value=value)
        b.check(aten.addcmul.default, make((4,), I64), make((4,), I64, seed=1), make((4,), I64, seed=2), value=3)
        b.check(aten.addcmul.default, make((4,), F32), make((4,), F64, seed=1), make((4,), F32, seed=2), value=0.1)


def test_masked_fill():
    with Batch() as b:
        for dtype in (F32, BF16, I64, BOOL):
            x = make((3, 4), dtype)
            mask = make((4,), BOOL, seed=9)
            b.check(aten.masked_fill.Scalar, x, mask, 1)
            b.check(aten.masked_fill.Scalar, x, mask, 0)
            if dtype.is_floating_point:
                b.check(aten.masked_fill.Scalar, x, mask, float("-inf"))
                b.check(aten.masked_fill.Scalar, x, mask, 2.7)
            b.check(aten.masked_fill.Tensor, x, mask, torch.tensor(1, dtype=dtype))


# ----------------------------------------------------------------------------------------------
# conversions, copies, fills
# ----------------------------------------------------------------------------------------------
def test_to_copy():
    all_dtypes = (F32, F64, BF16, F16, I64, I32, I8, U8, BOOL)
    with Batch() as b:
        for src in all_dtypes:
            x = make((3, 4), src, low=0, high=20) if src.is_floating_point else make((3, 4), src, low=0, high=100)
            for dst in all_dtypes:
                b.check(aten._to_copy.default, x, dtype=dst)
        x = torch.tensor([-2.7, -0.5, 0.5, 2.7, 0.0])
        b.check(aten._to_copy.default, x, dtype=I64)  # truncation toward zero
        b.check(aten._to_copy.default, x, dtype=BOOL)
        b.check(aten._to_copy.default, x)
        b.check(aten._to_copy.default, x, dtype=F32, device=torch.device("cpu"))


def test_clone_copy_fill_zero():
    x = make((3, 4), F32)
    with Batch() as b:
        b.check(aten.clone.default, x)
        b.check(aten.copy.default, x, make((4,), F64, seed=1))
        b.check(aten.copy.default, x, make((3, 4), I64, seed=1))
        b.check(aten.copy.default, make((2, 3), I32), make((1, 3), F32, seed=1))
        b.check(aten.copy.default, make((2, 3), BOOL), make((2, 3), F32, seed=1))
        for dtype in (F32, BF16, I64, BOOL):
            y = make((2, 3), dtype)
            b.check(aten.fill.Scalar, y, 3)
            b.check(aten.fill.Scalar, y, 2.5)
            b.check(aten.fill.Tensor, y, torch.tensor(7))
            b.check(aten.zero.default, y)


def test_special_binary_values():
    x = torch.tensor([0.0, 0.0, 1.0, -1.0, float("nan"), 2.0])
    y = torch.tensor([0.0, float("nan"), 0.0, 2.0, 1.0, -1.0])
    with Batch() as b:
        b.check(aten.xlogy.Tensor, x, y)
        b.check(aten.special_xlog1py.default, x, y)
        b.check(aten.heaviside.default, x, y)
        b.check(
            aten.logaddexp.default,
            torch.tensor([float("inf"), -float("inf"), 1.0]),
            torch.tensor([float("inf"), -float("inf"), float("nan")]),
        )


def test_single_check_helper():
    check(aten.neg.default, make((3,), F32))


def test_outputs_are_fresh_buffers():
    """A lowering that computes nothing still returns a buffer of its own (an input's buffer may be
    donated later)."""
    import jax
    import jax.numpy as jnp

    from _lowering_harness import lookup

    f, i = jnp.arange(6.0).reshape(2, 3), jnp.arange(6).reshape(2, 3)
    cases = [
        (aten.clone.default, (f,), {}),
        (aten._to_copy.default, (f,), {}),
        (aten._to_copy.default, (f,), {"dtype": F32}),
        (aten.copy.default, (f, f), {}),
        (aten.floor.default, (i,), {}),
        (aten.round.decimals, (i,), {"decimals": 1}),
        (aten.conj_physical.default, (f,), {}),
        (aten.clamp.default, (f,), {}),
        (aten.nan_to_num.default, (i,), {}),
        (aten.relu.default, (jnp.array([True]),), {}),
        (aten.sign.default, (jnp.array([True]),), {}),
        (aten.cumsum.default, (jnp.float32(1.0), 0), {}),
        (aten.max.dim, (jnp.float32(1.0), 0), {}),
        (aten.sort.default, (jnp.float32(1.0),), {}),
        (aten._foreach_clone.default, ([f, i],), {}),
    ]
    for op, args, kw in cases:
        out = lookup(op).fn(*args, **kw)
        for o in jax.tree_util.tree_leaves(out):
            for a in jax.tree_util.tree_leaves(args):
                if isinstance(a, jax.Array) and o.shape == a.shape and o.dtype == a.dtype:
                    assert o is not a and o.unsafe_buffer_pointer() != a.unsafe_buffer_pointer(), op
