"""Causal attention forward + backward on a TPU at T=2048: XLA's (``jax.nn.dot_product_attention``)
against JAX's own Pallas TPU kernels (``jax.experimental.pallas.ops.tpu``: flash attention and splash
attention), in plain JAX, at a few block sizes (issue 36 §6: is there a kernel to route causal SDPA
through that beats XLA's attention?).

Example::

    source bench/tpu_setup.sh && python3 bench/tpu_attention_kernels.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from shardtensor.ops import tpu_attention


def timed(fn, *args, runs=20):
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(runs):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / runs


def main():
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    b, h, t, d = 4, 16, 2048, 64
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kk, (b, h, t, d), jnp.bfloat16) for kk in keys[:3])
    dout = jax.random.normal(keys[3], (b, h, t, d), jnp.bfloat16)
    scale = d**-0.5

    def xla(q, k, v):  # JAX's layout is (b, t, h, d)
        tr = lambda z: z.transpose(0, 2, 1, 3)  # noqa: E731
        return tr(jax.nn.dot_product_attention(tr(q), tr(k), tr(v), is_causal=True))

    def flash(block):
        sizes = fa.BlockSizes(
            block_q=block,
            block_k_major=block,
            block_k=block,
            block_b=1,
            block_q_major_dkv=block,
            block_k_major_dkv=block,
            block_k_dkv=block,
            block_q_dkv=block,
            block_k_major_dq=block,
            block_k_dq=block,
            block_q_dq=block,
        )
        return lambda q, k, v: fa.flash_attention(q, k, v, causal=True, sm_scale=scale, block_sizes=sizes)

    def fwd_bwd(attend):
        def f(q, k, v):
            out, vjp = jax.vjp(attend, q, k, v)
            return out, vjp(dout)

        return jax.jit(f)

    ref = fwd_bwd(xla)(q, k, v)
    flops = 4 * b * h * t * t * d * 3 / 2 * 2 / 2  # fwd 2 products + bwd 4: causal half

    def report(name, attend):
        try:
            fn = fwd_bwd(attend)
            out = fn(q, k, v)
            err = max(
                float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32))))
                for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref))
            )
            s = timed(fn, q, k, v)
            print(f"  {name:28s} {s * 1e3:8.2f} ms  {flops / s / 1e12:6.1f} TFLOP/s  max|diff| {err:.3g}", flush=True)
        except Exception as e:  # a block size a kernel refuses: say so and go on
            print(f"  {name:28s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)

    def splash(block):  # shardtensor's SDPA kernel on a TPU (ops/tpu_attention.py) at one block size
        kernel = tpu_attention._kernel(h, t, t, True, False, block=block)
        return lambda q, k, v: kernel(q * scale, k, v)

    print(f"causal attention fwd+bwd bf16 b={b} h={h} T={t} d={d}")
    report("xla", xla)
    for bl in (128, 256, 512, 1024):
        report(f"pallas flash block {bl}", flash(bl))
    for bl in (256, 512, 1024):
        report(f"splash block {bl}", splash(bl))


if __name__ == "__main__":
    main()
