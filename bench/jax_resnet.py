"""bench/vision_models.py's ResNets in plain ``jax.numpy``/``lax``, on the torch model's weights.

The JAX anchor of bench/tpu_dynamo_table.py: the same layers (bias-free convolutions, inference
BatchNorm from the running statistics, ReLU, the 3x3/2 max-pool, global average pool, the linear
head) written the way a JAX user writes them, fed the torch model's parameters and buffers.

Layouts: ``"NHWC"`` (activations) with HWIO kernels, the convention of JAX's libraries (Flax, and
the TPU's native one: channels in the minor dimension, the 128-wide lane axis), or ``"NCHW"`` with
OIHW kernels, torch's. The layout is the program's logical layout; XLA on a TPU assigns the
physical ones, so the difference is mostly where the transposes go (the NHWC program takes its
input already NHWC: a JAX user's input pipeline delivers it so). The table times both.

Example::

    model = vision_models.resnet50().eval()
    params = params_from_torch(model, "NHWC")
    logits = jax.jit(make_forward(model, "NHWC"))(params, jnp.asarray(x.permute(0, 2, 3, 1).numpy()))
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

LAYOUTS = ("NHWC", "NCHW")
_BN_EPS = 1e-5  # nn.BatchNorm2d's default, which vision_models keeps


def params_from_torch(model, layout: str = "NHWC", dtype=jnp.float32) -> dict[str, np.ndarray]:
    """The model's state dict as numpy arrays of ``dtype``: 4-D kernels as HWIO for NHWC (OIHW kept
    for NCHW), everything else as torch stores it (the head's weight stays (out, in)).

    Example: ``params_from_torch(resnet18())["stem.0.weight"].shape == (7, 7, 3, 64)``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    out = {}
    for name, value in model.state_dict().items():
        if name.endswith("num_batches_tracked"):
            continue
        a = value.detach().float().cpu().numpy()
        if a.ndim == 4 and layout == "NHWC":
            a = a.transpose(2, 3, 1, 0)
        out[name] = a.astype(dtype)
    return out


def block_plan(model) -> tuple[tuple[str, str, int, bool], ...]:
    """The static shape of ``model.stages``: (prefix, "basic" or "bottleneck", stride, has a shortcut
    projection) per block, read from the torch modules.

    Example: ``block_plan(resnet18())[2] == ("stages.2.", "basic", 2, True)``.
    """
    plan = []
    for i, block in enumerate(model.stages):
        kind = "bottleneck" if hasattr(block, "c") else "basic"
        strided = block.b if kind == "bottleneck" else block.a
        plan.append((f"stages.{i}.", kind, strided[0].stride[0], block.down is not None))
    return tuple(plan)


def make_forward(model, layout: str = "NHWC", precision=lax.Precision.DEFAULT):
    """``forward(params, x) -> logits`` for ``model``'s block plan, in ``layout``, products at
    ``precision``; jit it.

    Example: ``jax.jit(make_forward(model))(params_from_torch(model), x_nhwc)``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return functools.partial(forward, plan=block_plan(model), layout=layout, precision=precision)


def forward(params, x, *, plan, layout, precision):
    """ResNet inference: stem, max-pool, the blocks of ``plan``, global average pool, head."""
    conv_bn = functools.partial(_conv_bn, params, layout=layout, precision=precision)
    x = jax.nn.relu(conv_bn("stem.", x, 2))
    x = _max_pool_3x3_s2(x, layout)
    for prefix, kind, stride, has_down in plan:
        shortcut = conv_bn(prefix + "down.", x, stride) if has_down else x
        if kind == "bottleneck":
            h = jax.nn.relu(conv_bn(prefix + "a.", x, 1))
            h = jax.nn.relu(conv_bn(prefix + "b.", h, stride))
            h = conv_bn(prefix + "c.", h, 1)
        else:
            h = jax.nn.relu(conv_bn(prefix + "a.", x, stride))
            h = conv_bn(prefix + "b.", h, 1)
        x = jax.nn.relu(h + shortcut)
    pooled = x.mean(axis=(1, 2) if layout == "NHWC" else (2, 3))
    return jnp.matmul(pooled, params["fc.weight"].T, precision=precision) + params["fc.bias"]


def _conv_bn(params, prefix, x, stride, *, layout, precision):
    """vision_models._conv_bn: a bias-free convolution with 'same' padding, then BatchNorm (eval)."""
    w = params[prefix + "0.weight"]
    k = w.shape[0] if layout == "NHWC" else w.shape[2]
    numbers = ("NHWC", "HWIO", "NHWC") if layout == "NHWC" else ("NCHW", "OIHW", "NCHW")
    pad = (k - 1) // 2
    y = lax.conv_general_dilated(
        x, w, (stride, stride), [(pad, pad)] * 2, dimension_numbers=numbers, precision=precision
    )
    channels = (1, 1, 1, -1) if layout == "NHWC" else (1, -1, 1, 1)
    bn = prefix + "1."
    scale = params[bn + "weight"] * lax.rsqrt(params[bn + "running_var"] + _BN_EPS)
    return (y - params[bn + "running_mean"].reshape(channels)) * scale.reshape(channels) + params[bn + "bias"].reshape(
        channels
    )


def _max_pool_3x3_s2(x, layout):
    """F.max_pool2d(x, 3, 2, 1): padding never wins the max."""
    window = (1, 3, 3, 1) if layout == "NHWC" else (1, 1, 3, 3)
    strides = (1, 2, 2, 1) if layout == "NHWC" else (1, 1, 2, 2)
    pads = [(0, 0), (1, 1), (1, 1), (0, 0)] if layout == "NHWC" else [(0, 0), (0, 0), (1, 1), (1, 1)]
    return lax.reduce_window(x, jnp.array(-jnp.inf, x.dtype), lax.max, window, strides, pads)
