"""Random ops. Each lowering is registered with ``random=True`` and gets a fresh jax PRNG key first.

Values are drawn for the logical shape with jax's (partitionable) threefry, so they do not depend on
the sharding. They cannot equal torch's CPU stream; distributions, ranges and dtypes are torch's.
A ``generator=`` argument is accepted and ignored: the dispatcher owns the key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from shardtensor.ops._promote import (
    BOOL,
    FLOAT32,
    INT64,
    cast,
    default_float,
    dtype_arg,
    dtype_of,
    fresh,
    is_bool,
    is_complex,
    is_float,
    opmath,
    result_type,
    scalar_type_name,
)
from shardtensor.ops.checks import fail_where
from shardtensor.ops.registry import register

aten = torch.ops.aten


def _shape(size) -> tuple[int, ...]:
    return tuple(int(s) for s in size)


def _float_draw_dtype(dt) -> np.dtype:
    """The dtype to draw floats in: float32 for low-precision floats (and non-floats), else ``dt``."""
    ct = opmath(dt)
    return ct if is_float(ct) else FLOAT32


def _uniform(key, shape, dt, low=0.0, high=1.0):
    """Uniform in [low, high), drawn in float32 (or float64) and rounded to ``dt``; a value that the
    rounding takes up to ``high`` is moved to the float just below it, keeping the interval open."""
    ct = _float_draw_dtype(dt)
    u = jax.random.uniform(key, shape, ct, cast(low, ct), cast(high, ct))
    if not is_float(dt) or dt == ct:
        return u
    u, lo, hi = cast(u, dt), cast(low, dt), cast(high, dt)
    return jnp.where(u >= hi, jnp.nextafter(hi, lo), u)


def _normal(key, shape, dt):
    return jax.random.normal(key, shape, _float_draw_dtype(dt))


# ----------------------------------------------------------------------------------------------
# uniform / normal
# ----------------------------------------------------------------------------------------------
def _uniform_range(self, from_=0.0, to=1.0, *, generator=None, **kw):
    """``validate`` of uniform: torch's CPU kernel refuses ``from > to``."""
    from_ = kw.get("from", from_)
    if from_ > to:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={from_:g} > to={to:g}")


@register(aten.uniform.default, random=True, validate=_uniform_range)
def uniform(key, self, from_=0.0, to=1.0, *, generator=None, **kw):
    from_ = kw.pop("from", from_)
    dt = dtype_of(self)
    return cast(_uniform(key, jnp.shape(self), dt, from_, to), dt)


@register(aten.normal_functional.default, random=True)
def normal_functional(key, self, mean=0.0, std=1.0, *, generator=None):
    dt = dtype_of(self)
    ct = _float_draw_dtype(dt)
    return cast(_normal(key, jnp.shape(self), dt) * cast(std, ct) + cast(mean, ct), dt)


@register(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor, random=True)
def normal(key, mean, std=1.0, *, generator=None):
    dt = result_type(*(v for v in (mean, std) if isinstance(v, jax.Array)))
    shape = jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std))
    ct = _float_draw_dtype(dt)
    return cast(_normal(key, shape, dt) * cast(std, ct) + cast(mean, ct), dt)


@register(aten.normal.float_float, random=True)
def normal_float_float(key, mean, std, size, *, generator=None, dtype=None, **_factory):
    dt = dtype_arg(dtype) or default_float()
    ct = _float_draw_dtype(dt)
    return cast(_normal(key, _shape(size), dt) * cast(std, ct) + cast(mean, ct), dt)


@register(aten.rand.default, aten.rand.generator, random=True)
def rand(key, size, *, generator=None, dtype=None, **_factory):
    dt = dtype_arg(dtype) or default_float()
    return cast(_uniform(key, _shape(size), dt), dt)


@register(aten.randn.default, aten.randn.generator, random=True)
def randn(key, size, *, generator=None, dtype=None, **_factory):
    dt = dtype_arg(dtype) or default_float()
    return cast(_normal(key, _shape(size), dt), dt)


@register(aten.rand_like.default, aten.rand_like.generator, random=True)
def rand_like(key, self, *, generator=None, dtype=None, **_factory):
    dt = dtype_arg(dtype) or dtype_of(self)
    return cast(_uniform(key, jnp.shape(self), dt), dt)


@register(aten.randn_like.default, aten.randn_like.generator, random=True)
def randn_like(key, self, *, generator=None, dtype=None, **_factory):
    dt = dtype_arg(dtype) or dtype_of(self)
    return cast(_normal(key, jnp.shape(self), dt), dt)


# ----------------------------------------------------------------------------------------------
# integers
# ----------------------------------------------------------------------------------------------
def _randint(key, shape, low, high, dt):
    """Integers uniform in [low, high), drawn as int64 and cast to ``dt``."""
    return cast(jax.random.randint(key, shape, cast(low, INT64), cast(high, INT64), dtype=INT64), dt)


@register(aten.randint.default, aten.randint.generator, random=True)
def randint(key, high, size, *, generator=None, dtype=None, **_factory):
    return _randint(key, _shape(size), 0, high, dtype_arg(dtype) or INT64)


@register(aten.randint.low, aten.randint.low_generator, random=True)
def randint_low(key, low, high, size, *, generator=None, dtype=None, **_factory):
    return _randint(key, _shape(size), low, high, dtype_arg(dtype) or INT64)


@register(
    aten.randint_like.default,
    aten.randint_like.generator,
    aten.randint_like.Tensor,
    aten.randint_like.Tensor_generator,
    random=True,
)
def randint_like(key, self, high, *, generator=None, dtype=None, **_factory):
    return _randint(key, jnp.shape(self), 0, high, dtype_arg(dtype) or dtype_of(self))


@register(aten.randint_like.low_dtype, aten.randint_like.low_generator_dtype, random=True)
def randint_like_low(key, self, low, high, *, generator=None, dtype=None, **_factory):
    return _randint(key, jnp.shape(self), low, high, dtype_arg(dtype) or dtype_of(self))


def _default_random_high(dt) -> int:
    """One past the largest value ``random_()`` draws for ``dt`` (torch: 2**mantissa for floats)."""
    if is_bool(dt):
        return 2
    if is_float(dt):
        return 2 ** (jnp.finfo(dt).nmant + 1) + 1  # [0, 2**digits] inclusive
    return int(np.iinfo(dt).max)  # (the top value itself is excluded: a 1-in-2**63 difference)


@register(aten.random.default, random=True)
def random_(key, self, *, generator=None):
    dt = dtype_of(self)
    return _randint(key, jnp.shape(self), 0, _default_random_high(dt), dt)


def _random_range(self, from_=0, to=None, *, generator=None, **kw):
    """``validate`` of random_(from, to) and random_(to): torch's CPU kernel refuses an empty range."""
    from_ = kw.get("from", from_)
    if to is not None and from_ >= to:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={from_} >= to={to}")


def _random_to_range(self, to, *, generator=None):
    _random_range(self, 0, to)


@register(aten.random.to, random=True, validate=_random_to_range)
def random_to(key, self, to, *, generator=None):
    dt = dtype_of(self)
    return _randint(key, jnp.shape(self), 0, to, dt)


@register(getattr(aten.random, "from"), random=True, validate=_random_range)
def random_from(key, self, from_=None, to=None, *, generator=None, **kw):
    from_ = kw.pop("from", from_)
    dt = dtype_of(self)
    high = _default_random_high(dt) if to is None else to
    return _randint(key, jnp.shape(self), from_, high, dt)


@register(aten.randperm.default, aten.randperm.generator, random=True)
def randperm(key, n, *, generator=None, dtype=None, **_factory):
    return cast(jax.random.permutation(key, int(n)), dtype_arg(dtype) or INT64)


# ----------------------------------------------------------------------------------------------
# bernoulli, dropout
# ----------------------------------------------------------------------------------------------
@register(aten.bernoulli.default, random=True)
def bernoulli(key, self, *, generator=None):
    dt = dtype_of(self)
    ct = _float_draw_dtype(dt)
    return cast(jax.random.uniform(key, jnp.shape(self), ct) < cast(self, ct), dt)


@register(aten.bernoulli.p, random=True)
def bernoulli_p(key, self, p=0.5, *, generator=None):
    dt = dtype_of(self)
    ct = _float_draw_dtype(dt)
    return cast(jax.random.uniform(key, jnp.shape(self), ct) < cast(p, ct), dt)


@register(aten.bernoulli.Tensor, random=True)
def bernoulli_tensor(key, self, p, *, generator=None):
    dt = dtype_of(self)
    ct = _float_draw_dtype(dtype_of(p))
    u = jax.random.uniform(key, jnp.shape(self), ct)
    return cast(u < jnp.broadcast_to(cast(p, ct), jnp.shape(self)), dt)


@register(aten.native_dropout.default, random=True)
def native_dropout(key, input, p, train):
    if train is not None and not train:
        return fresh(input), jnp.ones(jnp.shape(input), BOOL)
    dt = dtype_of(input)
    p1m = 1.0 - float(p)
    scale = 0.0 if p1m == 0 else 1.0 / p1m
    mask = jax.random.uniform(key, jnp.shape(input), FLOAT32) < jnp.float32(p1m)
    ct = opmath(dt)
    out = cast(input, ct) * mask.astype(ct) * jnp.asarray(scale, ct)
    return cast(out, dt), mask


@register(aten.native_dropout_backward.default)
def native_dropout_backward(grad_output, mask, scale):
    dt = dtype_of(grad_output)
    ct = opmath(dt)
    return cast(cast(grad_output, ct) * cast(mask, ct) * cast(scale, ct), dt)


# ----------------------------------------------------------------------------------------------
# other distributions
# ----------------------------------------------------------------------------------------------
@register(aten.exponential.default, random=True)
def exponential(key, self, lambd=1.0, *, generator=None):
    dt = dtype_of(self)
    ct = _float_draw_dtype(dt)
    return cast(jax.random.exponential(key, jnp.shape(self), ct) / cast(lambd, ct), dt)


@register(aten.cauchy.default, random=True)
def cauchy(key, self, median=0.0, sigma=1.0, *, generator=None):
    dt = dtype_of(self)
    ct = _float_draw_dtype(dt)
    return cast(cast(median, ct) + cast(sigma, ct) * jax.random.cauchy(key, jnp.shape(self), ct), dt)


@register(aten.log_normal.default, random=True)
def log_normal(key, self, mean=1.0, std=2.0, *, generator=None):
    dt = dtype_of(self)
    ct = _float_draw_dtype(dt)
    return cast(jnp.exp(_normal(key, jnp.shape(self), dt) * cast(std, ct) + cast(mean, ct)), dt)


@register(aten.geometric.default, random=True)
def geometric(key, self, p, *, generator=None):
    dt = dtype_of(self)
    u = jax.random.uniform(key, jnp.shape(self), np.float64, minval=np.finfo(np.float64).tiny)
    return cast(jnp.ceil(jnp.log(u) / jnp.log1p(-float(p))), dt)


@register(aten.poisson.default, random=True)
def poisson(key, self, generator=None):
    dt = dtype_of(self)
    return cast(jax.random.poisson(key, cast(self, _float_draw_dtype(dt)), jnp.shape(self), dtype=INT64), dt)


@register(aten._standard_gamma.default, random=True)
def _standard_gamma(key, self, generator=None):
    dt = dtype_of(self)
    ct = _float_draw_dtype(dt)
    return cast(jax.random.gamma(key, cast(self, ct), jnp.shape(self), ct), dt)


def _multinomial_args(self, num_samples, replacement=False, *, generator=None):
    """``validate`` of multinomial: torch's CPU checks of the dtype and the sample count."""
    if not (self.dtype.is_floating_point or self.dtype.is_complex):
        raise RuntimeError(
            f"multinomial only supports floating-point dtypes for input, got: {scalar_type_name(self.dtype)}"
        )
    if not replacement and int(num_samples) > (self.shape[-1] if self.dim() else 1):
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")


@register(aten.multinomial.default, random=True, checked=True, validate=_multinomial_args)
def multinomial(key, self, num_samples, replacement=False, *, generator=None):
    ct = _float_draw_dtype(dtype_of(self)) if not is_complex(dtype_of(self)) else FLOAT32
    w = cast(self, ct)
    fail_where(
        ~jnp.isfinite(w) | (w < 0), RuntimeError, "probability tensor contains either `inf`, `nan` or element < 0"
    )
    fail_where(jnp.sum(w, axis=-1) <= 0, RuntimeError, "invalid multinomial distribution (sum of probabilities <= 0)")
    logits = jnp.log(w)  # zero weight -> -inf: never drawn
    n = int(num_samples)
    if replacement:
        out = jax.random.categorical(key, logits, axis=-1, shape=(n,) + w.shape[:-1])
        out = jnp.moveaxis(out, 0, -1)
    else:
        # Gumbel top-k: sampling without replacement, proportional to the weights
        g = logits + jax.random.gumbel(key, w.shape, ct)
        out = jax.lax.top_k(g, n)[1]
    return out.astype(INT64)
