"""Lowering of ``aten._grouped_mm``, the grouped matrix product of mixture-of-experts layers
(transformers' ``experts_implementation="grouped_mm"``, its default), on ``jax.lax.ragged_dot``.

``offs`` holds the cumulative group ends (int32); group ``g`` covers ``[offs[g-1], offs[g])``:
  * 2-D (M, K) x 3-D (G, K, N) -> (M, N): row r of the first operand times matrix ``g(r)``;
  * 3-D (G, M, K) x 2-D (K, N) -> (M, N): column c of the second operand times matrix ``g(c)``;
  * 2-D (M, K) x 2-D (K, N) -> (G, M, N): the groups split the contraction dimension K;
  * 3-D x 3-D without ``offs``: a batched product.
Rows (columns) past ``offs[-1]`` are left unwritten by torch's kernels; here they are 0. Its backward
is torch's own (autograd calls ``_grouped_mm`` again on transposed operands). As torch's CPU kernel:
float32, bfloat16 or float16 operands of one dtype, no bias, ``out_dtype`` only the operands' dtype.
torch's meta kernel checks CUDA's rules (bf16 only), so output shapes come from this lowering.

Example::

    lookup(aten._grouped_mm.default).fn(tokens, expert_weights, offs)   # (S, K) x (E, K, N)
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from shardtensor.ops._promote import acc_dtype
from shardtensor.ops.precision import precision
from shardtensor.ops.registry import register

aten = torch.ops.aten

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check(a, b, offs, bias, out_dtype):
    # torch's CPU messages (aten/src/ATen/native/GroupedMMUtils.h, Blas.cpp)
    if a.dtype not in _FLOATS:
        raise RuntimeError(f"Expected mat_a to be Float32, BFloat16 or Float16 matrix, got {a.dtype}")
    if b.dtype != a.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {a.dtype} != {b.dtype}")
    if a.ndim not in (2, 3) or b.ndim not in (2, 3):
        raise RuntimeError(f"Multiplicands must be 2D or 3D but got mat_a.dim()={a.ndim} and mat_b.dim()={b.ndim}")
    if (offs is None) != (a.ndim == 3 and b.ndim == 3):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None and (offs.ndim != 1 or offs.dtype != jnp.int32):
        raise RuntimeError("Offsets have to be int32" if offs.ndim == 1 else "offs has to be 1D")
    if a.shape[-1] != b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    if a.ndim + b.ndim == 5 and offs.shape[0] != (b if a.ndim == 2 else a).shape[0]:
        raise RuntimeError("matrix batch sizes have to match")
    if a.ndim == 3 and b.ndim == 3 and a.shape[0] != b.shape[0]:
        raise RuntimeError("batched dimension has to match")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    if out_dtype is not None and out_dtype != a.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")


def _ragged(lhs, rhs, sizes, lhs_ragged, rhs_group, contracting):
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(contracting, ((), ())),
        lhs_ragged_dimensions=[lhs_ragged],
        rhs_group_dimensions=[] if rhs_group is None else [rhs_group],
    )
    return lax.ragged_dot_general(
        lhs, rhs, sizes, numbers, precision=precision(), preferred_element_type=acc_dtype(lhs.dtype)
    )


@register(aten._grouped_mm.default, meta_from_lowering=True, products=True)
def grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    _check(a, b, offs, bias, out_dtype)
    if offs is None:  # 3-D x 3-D
        out = jnp.matmul(a, b, precision=precision(), preferred_element_type=acc_dtype(a.dtype))
        return out.astype(a.dtype)
    sizes = jnp.diff(offs, prepend=jnp.zeros((1,), offs.dtype))
    if a.ndim == 2 and b.ndim == 3:  # rows of a grouped
        out = _ragged(a, b, sizes, 0, 0, ((1,), (1,)))
    elif a.ndim == 3:  # columns of b grouped: out.T = b.T (rows grouped) x a^T per group
        out = _ragged(b.T, jnp.swapaxes(a, 1, 2), sizes, 0, 0, ((1,), (1,))).T
    else:  # both 2-D: the contraction dimension grouped, one (M, N) result per group
        out = _ragged(a, b, sizes, 1, None, ((1,), (0,)))
    return out.astype(a.dtype)
