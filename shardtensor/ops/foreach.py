"""``_foreach_*`` ops (torch.optim's foreach paths, clip_grad_norm_): each is the single-tensor lowering
applied to every element of the list, with the same promotion. They return a list of jax values.

Overloads: ``.List`` (pairs tensors), ``.Scalar`` (one Scalar for all), ``.ScalarList`` (one Scalar per
tensor), ``.Tensor`` (one tensor for all; for addcmul/addcdiv a 1-d tensor holding one value per tensor).
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from shardtensor.ops import elementwise as ew
from shardtensor.ops import power
from shardtensor.ops import reduction as red
from shardtensor.ops._promote import cast, opmath, result_type
from shardtensor.ops.registry import lookup, register

aten = torch.ops.aten


def _fn(op):
    low = lookup(op)
    assert low is not None, f"foreach needs the lowering of {op}"
    return low.fn


# ----------------------------------------------------------------------------------------------
# unary
# ----------------------------------------------------------------------------------------------
_UNARY_NAMES = (
    "abs acos asin atan ceil cos cosh erf erfc exp expm1 floor frac lgamma log log10 log1p log2 "
    "neg reciprocal round rsqrt sigmoid sign sin sinh sqrt tan tanh trunc"
)
_UNARY = _UNARY_NAMES.split()


def _unary(fn):
    def lowering(self):
        return [fn(x) for x in self]

    return lowering


for _name in _UNARY:
    register(getattr(aten, f"_foreach_{_name}").default)(_unary(_fn(getattr(aten, _name).default)))

register(aten._foreach_zero.default)(_unary(ew.zero))
register(aten._foreach_clone.default)(lambda self, *, memory_format=None: [ew.clone(x) for x in self])
register(aten._foreach_max.default)(_unary(red.max_))


@register(aten._foreach_copy.default)
def _foreach_copy(self, src, non_blocking=False):
    return [ew.copy(x, s) for x, s in zip(self, src)]


# ----------------------------------------------------------------------------------------------
# binary: List / Scalar / ScalarList / Tensor
# ----------------------------------------------------------------------------------------------
def _list(fn):
    def lowering(self, other, **kw):
        _check_len(self, other)
        return [fn(x, y, **kw) for x, y in zip(self, other)]

    return lowering


def _scalar(fn):
    def lowering(self, scalar, **kw):
        return [fn(x, scalar, **kw) for x in self]

    return lowering


def _scalar_list(fn):
    def lowering(self, scalars, **kw):
        _check_len(self, scalars)
        return [fn(x, s, **kw) for x, s in zip(self, scalars)]

    return lowering


def _check_len(a, b):
    if len(a) != len(b):
        raise ValueError(f"foreach: lists of different lengths ({len(a)} and {len(b)})")


def _register_binary(name, fn, overloads, *, scalar_fn=None):
    packet = getattr(aten, f"_foreach_{name}")
    makers = {
        "List": _list(fn),
        "Scalar": _scalar(scalar_fn or fn),
        "ScalarList": _scalar_list(scalar_fn or fn),
        "Tensor": _scalar(fn),
    }
    for ov in overloads:
        register(getattr(packet, ov))(makers[ov])


def _add(x, y, alpha=1):
    return ew.add(x, y, alpha)


def _sub(x, y, alpha=1):
    return ew.sub(x, y, alpha)


_register_binary("add", _add, ("List", "Scalar", "ScalarList", "Tensor"))
_register_binary("sub", _sub, ("List", "Scalar", "ScalarList"))
_register_binary("mul", ew.mul, ("List", "Scalar", "ScalarList", "Tensor"))
_register_binary("div", ew.div, ("List", "Scalar", "ScalarList", "Tensor"))
_register_binary("maximum", ew.maximum, ("List", "Scalar", "ScalarList"), scalar_fn=ew.clamp_min)
_register_binary("minimum", ew.minimum, ("List", "Scalar", "ScalarList"), scalar_fn=ew.clamp_max)
_register_binary("clamp_min", ew.clamp_min, ("List", "Scalar", "ScalarList"))
_register_binary("clamp_max", ew.clamp_max, ("List", "Scalar", "ScalarList"))
_register_binary("pow", power.pow_, ("List", "Scalar", "ScalarList"))


@register(aten._foreach_pow.ScalarAndTensor)
def _foreach_pow_scalar_and_tensor(self, exponent):
    return [power.pow_scalar(self, e) for e in exponent]


# ----------------------------------------------------------------------------------------------
# ternary: addcmul, addcdiv, lerp
# ----------------------------------------------------------------------------------------------
def _register_pointwise(name, fn):
    packet = getattr(aten, f"_foreach_{name}")

    @register(packet.Scalar)
    def scalar(self, tensor1, tensor2, value=1):
        return [fn(x, a, b, value=value) for x, a, b in zip(self, tensor1, tensor2)]

    @register(packet.ScalarList)
    def scalar_list(self, tensor1, tensor2, scalars):
        _check_len(self, scalars)
        return [fn(x, a, b, value=s) for x, a, b, s in zip(self, tensor1, tensor2, scalars)]

    @register(packet.Tensor)
    def tensor(self, tensor1, tensor2, scalars):
        # torch reads one value per tensor out of the 1-d ``scalars`` (as Python scalars)
        return [fn(x, a, b, value=scalars[i]) for i, (x, a, b) in enumerate(zip(self, tensor1, tensor2))]


_register_pointwise("addcmul", ew.addcmul)
_register_pointwise("addcdiv", ew.addcdiv)


@register(aten._foreach_lerp.List)
def _foreach_lerp_list(self, tensors1, weights):
    return [ew.lerp(x, e, w) for x, e, w in zip(self, tensors1, weights)]


@register(aten._foreach_lerp.Scalar)
def _foreach_lerp_scalar(self, tensors1, weight):
    return [ew.lerp(x, e, weight) for x, e in zip(self, tensors1)]


@register(aten._foreach_lerp.ScalarList)
def _foreach_lerp_scalar_list(self, tensors1, weight):
    return [ew.lerp(x, e, w) for x, e, w in zip(self, tensors1, weight)]


# ----------------------------------------------------------------------------------------------
# norms, mm
# ----------------------------------------------------------------------------------------------
@register(aten._foreach_norm.Scalar, static_scalars=True)
def _foreach_norm(self, ord=2, dtype=None):
    return [red.vector_norm(x, ord, None, False, dtype) for x in self]


@register(aten._foreach_powsum.Scalar, static_scalars=True)
def _foreach_powsum(self, ord=2, dtype=None):
    """sum(|x| ** ord) per tensor: the norm without its root."""
    return [red.vector_norm(x, ord, None, False, dtype, root=False) for x in self]


@register(aten._foreach_mm.default)
def _foreach_mm(self, mat2):
    out = []
    for a, b in zip(self, mat2):
        rt = result_type(a, b)
        acc = opmath(rt)
        out.append(cast(jnp.matmul(a, b, preferred_element_type=acc), rt))
    return out
