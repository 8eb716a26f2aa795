"""Miscellaneous NN lowerings (shardtensor/ops/nn.py: rrelu_with_noise, _trilinear) against eager torch on
CPU."""

import functools

import jax
import numpy as np
import torch

from _lowering_harness import TIGHT, assert_same, aten, check, deferred_checks, lower, randn, to_jax  # noqa: F401  (the deferred_checks fixture)

F64 = torch.float64


r = functools.partial(randn, dtype=F64)


# ------------------------------------------------------------------------------ rrelu, _trilinear


def test_rrelu_with_noise():
    fn = lower(aten.rrelu_with_noise_functional.default)
    x = r(400, seed=14)
    noise = torch.zeros(400, dtype=F64)
    want, _ = aten.rrelu_with_noise_functional.default(x, noise, 0.1, 0.3, False)
    out, noise_out = fn(jax.random.key(0), *to_jax([x, noise]), 0.1, 0.3, False)
    assert_same(out, want, **TIGHT)
    assert_same(noise_out, noise)
    out, noise_out = (torch.from_numpy(np.array(v)) for v in fn(jax.random.key(1), *to_jax([x, noise]), 0.1, 0.3, True))
    neg = x <= 0
    assert torch.all(noise_out[~neg] == 1) and torch.equal(out[~neg], x[~neg])
    slopes = noise_out[neg]
    assert slopes.min() >= 0.1 and slopes.max() < 0.3 and slopes.std() > 0.03
    torch.testing.assert_close(out[neg], x[neg] * slopes, **TIGHT)


def test_trilinear():
    x1, x2, w = r(7, 3, seed=15), r(7, 4), r(5, 3, 4)
    check(aten._trilinear.default, x1, w, x2, [1, 3], [0], [1, 2], [2, 3], **TIGHT)  # as F.bilinear calls it
    check(aten._trilinear.default, x1[:1], w, x2, [1, 3], [0], [1, 2], [2, 3], **TIGHT)  # broadcast batch
    check(aten._trilinear.default, x1[:0], w, x2[:0], [1, 3], [0], [1, 2], [2, 3], **TIGHT)  # empty batch
    check(aten._trilinear.default, x1, w, x2, [1, 3], [0], [1, 2], [], **TIGHT)
