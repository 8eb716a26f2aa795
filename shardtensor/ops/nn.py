"""Lowerings of neural-network ops. They live in one module per family; importing this module
imports (and so registers) all of them:

* ``conv``      — convolution (1-3d, strided, dilated, grouped, transposed) and its backward;
* ``norm``      — layer/batch/group norm and their backward (see ``norm.batch_norm_update_stats``
  for the in-place running-stat update of ``aten.native_batch_norm``);
* ``pooling``   — max/avg/adaptive/fractional pooling and their backward, im2col/col2im;
* ``resize``    — upsampling (nearest, linear, bicubic, antialiased) and reflection/replication padding,
  with backward;
* ``loss``      — nll_loss (one-hot, no gather), mse, bce (with logits), smooth L1, Huber, soft margin,
  multi(label) margin, CTC, chunked linear cross entropy;
* ``attention`` — the fused CPU scaled-dot-product attention op and its backward;
* ``sampling``  — grid_sampler 2d/3d (``F.grid_sample``) and its backward;
* ``embedding`` — embedding_bag and segment_reduce, with their backward;
* ``distance``  — cdist and pdist, with their backward;
* ``rnn``       — the fused LSTM and GRU cells (``nn.LSTM``/``nn.GRU`` off CPU) and their backward.

Two small ones live here: ``rrelu_with_noise_functional`` (``F.rrelu``) and ``_trilinear``
(``F.bilinear``).

Example::

    import shardtensor.ops.nn
    from shardtensor.ops.norm import batch_norm_update_stats
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp
import torch

from shardtensor.ops import attention, conv, distance, embedding, loss, norm, pooling, resize, rnn, sampling  # noqa: F401
from shardtensor.ops._promote import acc_dtype
from shardtensor.ops.norm import batch_norm_update_stats  # noqa: F401
from shardtensor.ops.precision import precision
from shardtensor.ops.registry import register

aten = torch.ops.aten


@register(aten.rrelu_with_noise_functional.default, random=True)
def rrelu_with_noise(key, x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    """(out, noise): in training each x <= 0 is scaled by a slope drawn uniformly from [lower, upper)
    (kept in ``noise``; 1 elsewhere); in eval the slope is (lower + upper) / 2 and noise is unchanged."""
    acc = acc_dtype(x.dtype)
    xf = x.astype(acc)
    if not training:
        slope = (jnp.asarray(lower, acc) + jnp.asarray(upper, acc)) / 2
        return jnp.where(xf > 0, xf, xf * slope).astype(x.dtype), noise
    r = jax.random.uniform(key, x.shape, acc, jnp.asarray(lower, acc), jnp.asarray(upper, acc))
    r = jnp.where(xf <= 0, r, jnp.ones((), acc))
    return (xf * r).astype(x.dtype), r.astype(noise.dtype)


@register(aten._trilinear.default, products=True)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """sum over ``sumdim`` of i1 * i2 * i3, each unsqueezed at its ``expand`` dims (``F.bilinear``)."""
    total = i1.ndim + len(expand1)
    letters = string.ascii_letters[:total]
    operands, subs = [], []
    sizes = [1] * total
    for t, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        dims = [d for d in range(total) if d not in set(expand)]
        if len(dims) != t.ndim:
            raise RuntimeError(f"_trilinear: expand dims {list(expand)} do not fit a {t.ndim}-d input in {total} dims")
        for d, n in zip(dims, t.shape):
            sizes[d] = n if sizes[d] == 1 else sizes[d]
        operands.append((t, dims))
    for _, dims in operands:  # size-1 dims broadcast against the others
        subs.append("".join(letters[d] for d in dims))
    out = "".join(letters[d] for d in range(total) if d not in set(sumdim))
    arrays = [jnp.broadcast_to(t, tuple(sizes[d] for d in dims)) for t, dims in operands]
    res = jnp.einsum(
        f"{','.join(subs)}->{out}",
        *arrays,
        precision=precision(),
        preferred_element_type=acc_dtype(i1.dtype),
    )
    return res.astype(i1.dtype)
