"""Lowerings of convolution (1-3 spatial dims, strided, padded, dilated, grouped, transposed with
output_padding) and convolution_backward, on ``lax.conv_general_dilated`` at full float32 precision.

convolution_backward returns None for the outputs its ``output_mask`` does not ask for (as torch does).
Its input and weight gradients are the transposes of the (linear) forward, so no forward is recomputed.

Example::

    lookup(aten.convolution.default).fn(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from shardtensor.ops._layout import FREE, MESH, constrain
from shardtensor.ops._promote import acc_dtype
from shardtensor.ops.pooling import expand_param
from shardtensor.ops.precision import precision
from shardtensor.ops.registry import register

aten = torch.ops.aten


def _dimension_numbers(nsp):
    sp = "DHW"[3 - nsp :] if nsp <= 3 else None
    if sp is None:
        raise NotImplementedError(f"convolution with {nsp} spatial dims")
    return ("NC" + sp, "OI" + sp, "NC" + sp)


# XLA's SPMD partitioner (jax 0.10.2) computes wrong values, raises, or aborts the process (a failed
# CHECK in convolution_handler.cc, or heap corruption) for convolutions whose channels or kernel are
# sharded (a transposed kernel is regrouped across its sharded dim); and it computes wrong kernel
# gradients when the input is sharded over a spatial dim while the output gradient is sharded over the
# batch, or, for groups > 1 (a conv with batch_group_count), when the batch is sharded over part of
# the mesh only and replicated over the rest (batch over 'x' of a (4, 2) mesh).
# A transposed convolution over a spatially sharded input (its lax form: a base-dilated convolution
# with a reversed kernel) is worse: wrong values even at stride 1, a partitioner error, or an abort
# (Check failed: ShapeUtil::Compatible(shard_shape, sharded_conv->shape())) with stride, dilation and
# output_padding together.
# tests/ops/test_conv_partitioning.py sweeps these. It is right when only the batch and spatial dims
# of a (not transposed) convolution's activations are sharded and the kernel is whole, forward and
# input gradient, whatever the stride, dilation, padding and groups; for a transposed one when only
# the batch is; and for the kernel gradient when only the batch is, split over the whole mesh if
# groups > 1: convolutions get that layout (a sharded kernel is gathered, as FSDP does anyway;
# sharded channels are gathered; spatially sharded activations are gathered for a transposed
# convolution and for the kernel gradient).
_ACTIVATION = (FREE, None, FREE)  # batch and spatial dims left to XLA, channels whole
_TRANSPOSED_ACTIVATION = (FREE, None)  # batch left to XLA, channels and spatial dims whole


def _kernel_grad_layout(groups):
    """The layout of the input and output gradient in the kernel gradient's convolution."""
    return (MESH if groups > 1 else FREE, None)


def conv(x, w, stride, padding, dilation, transposed, output_padding, groups, layout=None):
    """torch's convolution without bias, on batched input (N, C, *spatial); ``layout`` is the one
    the input and result are constrained to (see ``ops/_layout.constrain``; by default the one that
    is safe for the kind of convolution)."""
    if layout is None:
        layout = _TRANSPOSED_ACTIVATION if transposed else _ACTIVATION
    nsp = x.ndim - 2
    stride, padding, dilation = (expand_param(v, nsp) for v in (stride, padding, dilation))
    output_padding = expand_param(output_padding, nsp, 0)
    dn = _dimension_numbers(nsp)
    out_dtype = x.dtype
    if not transposed:
        if x.shape[1] != w.shape[1] * groups:
            raise RuntimeError(
                f"Given groups={groups}, weight of size {list(w.shape)}, expected input{list(x.shape)} "
                f"to have {w.shape[1] * groups} channels, but got {x.shape[1]} channels instead"
            )
        x, w = constrain(x, layout), constrain(w, (None,))
        y = lax.conv_general_dilated(
            x,
            w,
            window_strides=stride,
            padding=[(p, p) for p in padding],
            rhs_dilation=dilation,
            dimension_numbers=dn,
            feature_group_count=groups,
            precision=precision(),
            preferred_element_type=out_dtype,
        )
        return constrain(y, layout).astype(out_dtype)
    # transposed: weight is (C_in, C_out / groups, *k); run the adjoint as a dilated conv
    x, w = constrain(x, layout), constrain(w, (None,))
    cin, cout_g, k = w.shape[0], w.shape[1], w.shape[2:]
    wt = w.reshape((groups, cin // groups, cout_g) + k)
    wt = jnp.swapaxes(wt, 1, 2).reshape((groups * cout_g, cin // groups) + k)
    wt = jnp.flip(wt, axis=tuple(range(2, 2 + nsp)))
    pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op) for kk, d, p, op in zip(k, dilation, padding, output_padding)]
    y = lax.conv_general_dilated(
        x,
        wt,
        window_strides=(1,) * nsp,
        padding=pads,
        lhs_dilation=stride,
        rhs_dilation=dilation,
        dimension_numbers=dn,
        feature_group_count=groups,
        precision=precision(),
        preferred_element_type=out_dtype,
    )
    return constrain(y, layout).astype(out_dtype)


def _bias_shape(nsp):
    return (1, -1) + (1,) * nsp


def _conv_params(x, w, bias, stride, padding, dilation, *args):
    """``validate`` of convolution: torch's CPU checks of its parameters (the meta kernel has none)."""
    if any(p < 0 for p in padding):
        raise RuntimeError("negative padding is not supported")
    if any(s <= 0 for s in stride):
        raise RuntimeError("non-positive stride is not supported")
    if any(d <= 0 for d in dilation):
        raise RuntimeError(f"dilation should be greater than zero, but got {list(dilation)}")


@register(aten.convolution.default, aten._convolution.default, products=True, validate=_conv_params)
def convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups, *_flags):
    if x.ndim != w.ndim:
        raise RuntimeError(
            f"Expected {w.ndim}-dimensional input for {w.ndim}-dimensional weight {list(w.shape)}, "
            f"but got {x.ndim}-dimensional input of size {list(x.shape)} instead"
        )
    # torch's CPU kernels accumulate bf16/f16 in float32 and add the bias before the one rounding.
    # (The operands are widened too: XLA's partitioner pads a bf16 operand of a float32-result
    # convolution with a float32 constant and fails its own HLO verifier, jax 0.10.2.)
    acc = acc_dtype(x.dtype)
    y = conv(x.astype(acc), w.astype(acc), stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        y = y + bias.astype(acc).reshape(_bias_shape(x.ndim - 2))
    return y.astype(x.dtype)


@register(aten.convolution_backward.default, products=True)
def convolution_backward(
    grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    args = (stride, padding, dilation, transposed, output_padding, groups)
    gx = gw = gb = None
    if output_mask[0]:
        (gx,) = jax.linear_transpose(lambda v: conv(v, w, *args), jax.ShapeDtypeStruct(x.shape, x.dtype))(grad)
    if output_mask[1]:
        layout = _kernel_grad_layout(groups)
        x, grad = constrain(x, layout), constrain(grad, layout)
        (gw,) = jax.linear_transpose(lambda v: conv(x, v, *args, layout), jax.ShapeDtypeStruct(w.shape, w.dtype))(grad)
    if output_mask[2]:
        axes = (0,) + tuple(range(2, grad.ndim))
        gb = jnp.sum(grad, axis=axes, dtype=acc_dtype(grad.dtype)).astype(grad.dtype)
    return gx, gw, gb
