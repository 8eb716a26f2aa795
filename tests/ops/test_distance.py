"""cdist / pdist lowerings (shardtensor/ops/distance.py) against eager torch on CPU, forward and backward
ops."""

import functools
import itertools
import math

import pytest
import torch

from _lowering_harness import TIGHT, aten, check, deferred_checks, randn  # noqa: F401  (the deferred_checks fixture)

F64 = torch.float64


r = functools.partial(randn, dtype=F64)


# ---------------------------------------------------------------------------------------- distances


P_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf")]


@pytest.mark.parametrize(
    "shapes", [((5, 4), (6, 4)), ((2, 3, 5, 4), (3, 6, 4)), ((1, 30, 3), (2, 7, 3)), ((0, 4, 5), (3, 5))]
)
def test_cdist(shapes):
    s1, s2 = shapes
    x1, x2 = r(*s1, seed=16), r(*s2)
    if s1[:-2] == s2[:-2] and x1.numel():
        x2[..., 0, :] = x1[..., 0, :]  # zero distance: zero gradient
        x2[..., 1, 0] = x1[..., 0, 0]  # a zero coordinate difference
    for p, mode in itertools.product(P_VALUES, (None, 1, 2)):
        out = check(aten._cdist_forward.default, x1, x2, p, mode, rtol=1e-7, atol=1e-7)
        mm = p == 2 and (mode == 1 or (mode is None and max(s1[-2], s2[-2]) > 25))
        if not mm:  # (the mm form differentiates through _euclidean_dist instead)
            check(aten._cdist_backward.default, torch.randn_like(out), x1, x2, p, out, rtol=1e-7, atol=1e-7)
    # _euclidean_dist is sqrt(|a|^2 + |b|^2 - 2 a.b): at a zero distance the float32 cancellation
    # leaves up to ~eps * (|a|^2 + |b|^2), whose square root is what any CPU's kernel may return
    a, b = x1.float(), x2.float()
    norms = a.pow(2).sum(-1).amax() + b.pow(2).sum(-1).amax() if a.numel() and b.numel() else torch.tensor(0.0)
    cancel = math.sqrt(4 * a.shape[-1] * torch.finfo(torch.float32).eps * float(norms))
    check(aten._euclidean_dist.default, a, b, rtol=1e-5, atol=max(1e-5, cancel))


def test_pdist():
    x = r(6, 4, seed=17)
    x[3] = x[1]
    x[4, 0] = x[2, 0]
    for p in P_VALUES:
        out = check(aten._pdist_forward.default, x, p, **TIGHT)
        check(aten._pdist_backward.default, torch.randn_like(out), x, p, out, **TIGHT)
    check(aten._pdist_forward.default, x[:1], 2.0)
