"""Flash attention as Pallas kernels, forward and backward, at the JAX level.

Shapes are ``(batch, heads, seq, head_dim)``, as ``F.scaled_dot_product_attention``. The forward
walks the keys block by block with an online softmax (running max ``m``, running sum ``l``, output
accumulator), so the ``seq_q x seq_k`` score matrix is never stored; it saves the log-sum-exp of
each query row. The backward recomputes the probabilities of each block from that log-sum-exp:
one kernel per key block accumulates ``dk`` and ``dv`` over the query blocks, one per query block
accumulates ``dq`` over the key blocks (no atomics, no cross-step reduction). ``jax.custom_vjp``
ties them together, so ``jax.grad``/``jax.vjp`` run these kernels.

Causal masking is ``F.scaled_dot_product_attention``'s ``is_causal=True``: query ``i`` sees keys
``j <= i`` (the top-left aligned lower triangle, also when ``seq_q != seq_k``); key blocks entirely
above the diagonal are skipped, not just masked.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from shardtensor.kernels.mode import (
    accumulation_dtype,
    check_floating,
    compiler_params,
    mosaic_types,
    resolve_interpret,
)

# Default block sizes: 128 suits the TPU's lanes and GPU tensor cores; short sequences use one
# block of their length rounded up to a power of two (at least 16: Triton's smallest dot).
DEFAULT_BLOCK = 128
MIN_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one attention call (hashable: a custom_vjp non-differentiable argument)."""

    causal: bool
    scale: float
    block_q: int
    block_k: int
    kv_len: int  # the real number of keys; keys at or beyond it are padding and masked out
    interpret: bool


def _masked_scores(s, q_start, k_start, cfg: _Config):
    """The scores ``s`` (block_q x block_k) with causal and key-padding positions set very negative.

    A finite value rather than -inf: exp(mask - max) is then exactly 0 without producing NaN."""
    if not cfg.causal and cfg.kv_len % cfg.block_k == 0:
        return s
    rows = q_start + lax.broadcasted_iota(jnp.int32, s.shape, 0)
    cols = k_start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    keep = cols < cfg.kv_len
    if cfg.causal:
        keep = keep & (cols <= rows)
    return jnp.where(keep, s, jnp.asarray(-0.7 * jnp.finfo(s.dtype).max, s.dtype))


def _dot_nt(a, b, acc):
    """a @ b.T in the accumulation dtype."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=acc)


def _dot_tn(a, b, acc):
    """a.T @ b in the accumulation dtype."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=acc)


def _dot(a, b, acc):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=acc)


def _key_blocks_for(q_start, n_key_blocks: int, cfg: _Config):
    """How many key blocks a query block starting at ``q_start`` needs (causal: up to its diagonal)."""
    if not cfg.causal:
        return n_key_blocks
    # (plain // rather than pl.cdiv: lax.div refuses int32 with the int64 constants of JAX's 64-bit mode)
    return jnp.minimum(n_key_blocks, (q_start + cfg.block_q + cfg.block_k - 1) // cfg.block_k)


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg: _Config):
    acc = accumulation_dtype(q_ref.dtype)
    q_start = pl.program_id(2) * cfg.block_q
    q = q_ref[...].astype(acc) * cfg.scale
    n_key_blocks = k_ref.shape[0] // cfg.block_k

    # the per-row statistics are (block_q, 1) columns: Mosaic lays out 2-D values, not 1-D ones
    def step(j, carry):
        row_max, row_sum, out = carry
        k_start = pl.multiple_of(j * cfg.block_k, cfg.block_k)  # an alignment hint for Mosaic/Triton
        k = k_ref[pl.ds(k_start, cfg.block_k), :].astype(acc)
        v = v_ref[pl.ds(k_start, cfg.block_k), :].astype(acc)
        s = _masked_scores(_dot_nt(q, k, acc), q_start, k_start, cfg)
        new_max = jnp.maximum(row_max, s.max(axis=1, keepdims=True))
        rescale = jnp.exp(row_max - new_max)  # the old terms, relative to the new max
        p = jnp.exp(s - new_max)
        return new_max, rescale * row_sum + p.sum(axis=1, keepdims=True), rescale * out + _dot(p, v, acc)

    init = (
        jnp.full((cfg.block_q, 1), -jnp.inf, acc),
        jnp.zeros((cfg.block_q, 1), acc),
        jnp.zeros((cfg.block_q, v_ref.shape[1]), acc),
    )
    # Key 0 is visible to every row (causal is top-left aligned), so after the first block the max is finite.
    row_max, row_sum, out = lax.fori_loop(0, _key_blocks_for(q_start, n_key_blocks, cfg), step, init)
    o_ref[...] = (out / row_sum).astype(o_ref.dtype)
    lse_ref[...] = row_max + jnp.log(row_sum)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, cfg: _Config):
    acc = accumulation_dtype(q_ref.dtype)
    k_start = pl.program_id(2) * cfg.block_k
    k = k_ref[...].astype(acc)
    v = v_ref[...].astype(acc)
    n_query_blocks = q_ref.shape[0] // cfg.block_q
    # Causal: query blocks wholly before this key block see none of it.
    first = k_start // cfg.block_q if cfg.causal else 0

    def step(i, carry):
        dk, dv = carry
        q_start = pl.multiple_of(i * cfg.block_q, cfg.block_q)
        rows = pl.ds(q_start, cfg.block_q)
        q = q_ref[rows, :].astype(acc) * cfg.scale
        do = do_ref[rows, :].astype(acc)
        s = _masked_scores(_dot_nt(q, k, acc), q_start, k_start, cfg)
        p = jnp.exp(s - lse_ref[rows, :])
        dp = _dot_nt(do, v, acc)
        ds = p * (dp - delta_ref[rows, :])
        return dk + _dot_tn(ds, q, acc), dv + _dot_tn(p, do, acc)

    init = (jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc))
    dk, dv = lax.fori_loop(first, n_query_blocks, step, init)
    dk_ref[...] = dk.astype(dk_ref.dtype)  # q was scaled, so this is already scale * ds^T q
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, cfg: _Config):
    acc = accumulation_dtype(q_ref.dtype)
    q_start = pl.program_id(2) * cfg.block_q
    q = q_ref[...].astype(acc) * cfg.scale
    do = do_ref[...].astype(acc)
    lse = lse_ref[...]
    delta = delta_ref[...]
    n_key_blocks = k_ref.shape[0] // cfg.block_k

    def step(j, dq):
        k_start = pl.multiple_of(j * cfg.block_k, cfg.block_k)  # an alignment hint for Mosaic/Triton
        k = k_ref[pl.ds(k_start, cfg.block_k), :].astype(acc)
        v = v_ref[pl.ds(k_start, cfg.block_k), :].astype(acc)
        s = _masked_scores(_dot_nt(q, k, acc), q_start, k_start, cfg)
        p = jnp.exp(s - lse)
        ds = p * (_dot_nt(do, v, acc) - delta)
        return dq + _dot(ds, k, acc)

    dq = lax.fori_loop(0, _key_blocks_for(q_start, n_key_blocks, cfg), step, jnp.zeros(q.shape, acc))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _block(size: int, dims: int):
    """A BlockSpec over (batch, heads, seq, dims): one batch element and head per grid step, the
    ``size`` sequence rows at the step's block index. Per-row statistics (log-sum-exp, delta) are
    stored as (batch, heads, seq, 1): TPU blocks need their last two dimensions whole or tiled by
    (8, 128), which a trailing 1 (the whole dimension) satisfies."""
    return pl.BlockSpec((None, None, size, dims), lambda b, h, i: (b, h, i, 0))


def _whole(seq: int, dims: int):
    return pl.BlockSpec((None, None, seq, dims), lambda b, h, i: (b, h, 0, 0))


def _forward(q, k, v, cfg: _Config):
    batch, heads, seq_q, d = q.shape
    seq_k, dv = k.shape[2], v.shape[3]
    acc = accumulation_dtype(q.dtype)
    call = pl.pallas_call(
        functools.partial(_forward_kernel, cfg=cfg),
        out_shape=(
            jax.ShapeDtypeStruct((batch, heads, seq_q, dv), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, seq_q, 1), acc),
        ),
        grid=(batch, heads, seq_q // cfg.block_q),
        in_specs=[_block(cfg.block_q, d), _whole(seq_k, d), _whole(seq_k, dv)],
        out_specs=(_block(cfg.block_q, dv), _block(cfg.block_q, 1)),
        interpret=cfg.interpret,
        compiler_params=compiler_params(cfg.interpret),
        name="flash_attention_forward",
    )
    with mosaic_types(q.dtype):
        return call(q, k, v)


def _backward(cfg: _Config, residuals, do):
    q, k, v, o, lse = residuals
    batch, heads, seq_q, d = q.shape
    seq_k, dv = k.shape[2], v.shape[3]
    acc = accumulation_dtype(q.dtype)
    # delta_i = sum_j P_ij dP_ij = do_i . o_i: one cheap reduction, shared by both kernels.
    delta = jnp.sum(do.astype(acc) * o.astype(acc), axis=-1, keepdims=True)
    dkdv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg),
        out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        grid=(batch, heads, seq_k // cfg.block_k),
        in_specs=[
            _whole(seq_q, d),
            _block(cfg.block_k, d),
            _block(cfg.block_k, dv),
            _whole(seq_q, dv),
            _whole(seq_q, 1),
            _whole(seq_q, 1),
        ],
        out_specs=(_block(cfg.block_k, d), _block(cfg.block_k, dv)),
        interpret=cfg.interpret,
        compiler_params=compiler_params(cfg.interpret),
        name="flash_attention_dkdv",
    )
    dq_call = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(batch, heads, seq_q // cfg.block_q),
        in_specs=[
            _block(cfg.block_q, d),
            _whole(seq_k, d),
            _whole(seq_k, dv),
            _block(cfg.block_q, dv),
            _block(cfg.block_q, 1),
            _block(cfg.block_q, 1),
        ],
        out_specs=_block(cfg.block_q, d),
        interpret=cfg.interpret,
        compiler_params=compiler_params(cfg.interpret),
        name="flash_attention_dq",
    )
    with mosaic_types(q.dtype):
        dk, dv_ = dkdv(q, k, v, do, lse, delta)
        dq = dq_call(q, k, v, do, lse, delta)
    return dq, dk, dv_


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, cfg: _Config):
    return _forward(q, k, v, cfg)[0]


def _attention_fwd(q, k, v, cfg: _Config):
    o, lse = _forward(q, k, v, cfg)
    return o, (q, k, v, o, lse)


_attention.defvjp(_attention_fwd, _backward)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pick_block(name: str, block: int | None, seq: int) -> int:
    """The block size along a sequence: the given one (which must divide it), or a default."""
    if block is None:
        return min(DEFAULT_BLOCK, max(MIN_BLOCK, _next_power_of_2(seq)))
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"{name} must be a positive int or None (choose), got {block!r}.")
    if seq % block:
        raise ValueError(
            f"{name}={block} does not divide the sequence length {seq}: pass a {name} that divides it "
            f"(e.g. {math.gcd(seq, block)}), or {name}=None to use a default block and pad the sequence."
        )
    return block


def _check_shapes(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_floating(f"flash attention's {name}", x)
        if x.ndim != 4:
            raise ValueError(
                f"flash attention takes (batch, heads, seq, head_dim) arrays; {name} has shape {tuple(x.shape)}."
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}: cast them first.")
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"q, k and v must agree on (batch, heads): got {q.shape[:2]}, {k.shape[:2]}, {v.shape[:2]} "
            "(for grouped-query attention, repeat k and v over heads first)."
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[3]} and {k.shape[3]}.")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same sequence length, got {k.shape[2]} and {v.shape[2]}.")
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError(
            f"flash attention needs at least one query and one key, got seq_q={q.shape[2]}, seq_k={k.shape[2]}."
        )


def _pad_seq(x, to: int):
    return x if x.shape[2] == to else jnp.pad(x, ((0, 0), (0, 0), (0, to - x.shape[2]), (0, 0)))


def flash_attention_jax(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``softmax(scale * q @ k^T [+ causal mask]) @ v`` by Pallas flash-attention kernels, with a backward.

    q: (batch, heads, seq_q, head_dim); k: (batch, heads, seq_k, head_dim); v: (batch, heads, seq_k,
    head_dim_v); returns (batch, heads, seq_q, head_dim_v) in q's dtype. ``scale`` defaults to
    ``1/sqrt(head_dim)`` and ``causal`` is ``is_causal`` of ``F.scaled_dot_product_attention``.
    ``block_q``/``block_k`` are the query and key rows one kernel step holds; a given size must
    divide the sequence length, ``None`` picks min(128, seq rounded up to a power of two, at least 16) and pads
    the sequence (padded keys are masked, padded queries dropped). ``interpret=None`` interprets on
    CPU and compiles the real kernel on GPU/TPU.

    Example::

        q = k = v = jax.random.normal(jax.random.key(0), (2, 4, 64, 32))
        o = flash_attention_jax(q, k, v, causal=True, block_q=32, block_k=32)
        dq = jax.grad(lambda q: flash_attention_jax(q, k, v).sum())(q)
    """
    _check_shapes(q, k, v)
    seq_q, seq_k, d = q.shape[2], k.shape[2], q.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"scale must be a Python number (static), got {type(scale).__name__}.")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}.")
    bq, bk = _pick_block("block_q", block_q, seq_q), _pick_block("block_k", block_k, seq_k)
    padded_q, padded_k = -(-seq_q // bq) * bq, -(-seq_k // bk) * bk
    cfg = _Config(causal, float(scale), bq, bk, seq_k, resolve_interpret(interpret))
    out = _attention(_pad_seq(q, padded_q), _pad_seq(k, padded_k), _pad_seq(v, padded_k), cfg)
    return out[:, :, :seq_q]
