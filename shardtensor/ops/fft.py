"""Lowerings of torch's FFT primitives: _fft_r2c, _fft_c2r, _fft_c2c.

All of ``torch.fft`` (fft, ifft, rfft, irfft, hfft, fftn, ...) decomposes into these three. They are
unnormalized transforms scaled by ``normalization``: 0 = none, 1 = 1/sqrt(n), 2 = 1/n, where n is the
product of the signal sizes over ``dim`` (the input's for r2c and c2c, the output's for c2r). Complex
results are complex64 for float32 / complex64 inputs and complex128 for float64 / complex128.

Example::

    lookup(aten._fft_r2c.default).fn(x, [-1], 0, True)   # == torch.fft.rfft(x)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from shardtensor.ops.registry import register

aten = torch.ops.aten

_COMPLEX = {
    jnp.dtype(jnp.float32): jnp.complex64,
    jnp.dtype(jnp.float64): jnp.complex128,
    jnp.dtype(jnp.complex64): jnp.complex64,
    jnp.dtype(jnp.complex128): jnp.complex128,
}
_REAL = {jnp.dtype(jnp.complex64): jnp.float32, jnp.dtype(jnp.complex128): jnp.float64}


def _dims(dim, ndim):
    return [d % ndim for d in dim] if ndim else []


def _scale(out, normalization, sizes):
    n = int(np.prod(sizes)) if sizes else 1
    if normalization == 0 or n == 0:
        return out
    if normalization == 1:
        return out * jnp.asarray(1 / np.sqrt(n), out.real.dtype)
    if normalization == 2:
        return out * jnp.asarray(1 / n, out.real.dtype)
    raise RuntimeError(f"Unsupported normalization type {normalization}")


def _complex_of(x, name):
    ct = _COMPLEX.get(jnp.dtype(x.dtype))
    if ct is None:
        raise RuntimeError(f"{name}: unsupported dtype {x.dtype}")
    return ct


@register(aten._fft_r2c.default)
def fft_r2c(self, dim, normalization, onesided):
    if not jnp.issubdtype(self.dtype, jnp.floating):
        raise RuntimeError(f"_fft_r2c: expected a real floating input, got {self.dtype}")
    ct = _complex_of(self, "_fft_r2c")
    axes = _dims(dim, self.ndim)
    sizes = [self.shape[a] for a in axes]
    if not axes:
        return self.astype(ct)
    if onesided:
        out = jnp.fft.rfftn(self, axes=axes, norm="backward")
    else:
        out = jnp.fft.fftn(self.astype(ct), axes=axes, norm="backward")
    return _scale(out.astype(ct), normalization, sizes).astype(ct)


@register(aten._fft_c2r.default)
def fft_c2r(self, dim, normalization, last_dim_size):
    if not jnp.issubdtype(self.dtype, jnp.complexfloating):
        raise RuntimeError(f"_fft_c2r: expected a complex input, got {self.dtype}")
    rt = _REAL[jnp.dtype(self.dtype)]
    axes = _dims(dim, self.ndim)
    if not axes:
        return self.real.astype(rt)
    s = [self.shape[a] for a in axes[:-1]] + [int(last_dim_size)]
    # norm="forward" leaves the inverse transform unscaled; torch's scaling is applied below
    out = jnp.fft.irfftn(self, s=s, axes=axes, norm="forward")
    return _scale(out.astype(rt), normalization, s).astype(rt)


@register(aten._fft_c2c.default)
def fft_c2c(self, dim, normalization, forward):
    if not jnp.issubdtype(self.dtype, jnp.complexfloating):
        raise RuntimeError(f"_fft_c2c: expected a complex input, got {self.dtype}")
    ct = self.dtype
    axes = _dims(dim, self.ndim)
    sizes = [self.shape[a] for a in axes]
    if not axes:
        return self
    if forward:
        out = jnp.fft.fftn(self, axes=axes, norm="backward")  # unscaled forward
    else:
        out = jnp.fft.ifftn(self, axes=axes, norm="forward")  # unscaled inverse
    return _scale(out.astype(ct), normalization, sizes).astype(ct)
