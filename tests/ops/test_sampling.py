"""grid_sampler lowerings (shardtensor/ops/sampling.py) against eager torch on CPU, forward and backward
ops, bfloat16 rounding as torch's CPU kernel."""

import functools
import itertools

import pytest
import torch

from _lowering_harness import TIGHT, aten, check, deferred_checks, randn  # noqa: F401  (the deferred_checks fixture)

F64 = torch.float64


r = functools.partial(randn, dtype=F64)


def _pairwise(modes, pads):
    """(mode, padding, align_corners) covering every pair of the three: each mode with each padding,
    and align_corners both ways for every mode and for every padding (half the full product)."""
    return [(mode, pad, (mode + pad) % 2 == 1) for mode, pad in itertools.product(modes, pads)]


# ------------------------------------------------------------------------------------ grid_sampler


@pytest.mark.parametrize("nsp", [2, 3])
def test_grid_sampler(nsp):
    torch.manual_seed(3)
    x = r(*((2, 3, 5, 7) if nsp == 2 else (2, 3, 4, 5, 3)))
    grid = torch.rand((2, 4, 6) + ((3,) if nsp == 3 else ()) + (nsp,), dtype=F64) * 3 - 1.5
    op = aten.grid_sampler_2d if nsp == 2 else aten.grid_sampler_3d
    bwd = aten.grid_sampler_2d_backward if nsp == 2 else aten.grid_sampler_3d_backward
    for mode, pad, align in _pairwise(range(3 if nsp == 2 else 2), range(3)):
        out = check(op.default, x, grid, mode, pad, align, **TIGHT)
        g = torch.randn_like(out)
        check(bwd.default, g, x, grid, mode, pad, align, [True, True], **TIGHT)
        if mode == 0:
            check(bwd.default, g, x, grid, mode, pad, align, [False, True], **TIGHT)


def test_grid_sampler_bf16_rounds_like_torch():
    """torch's CPU kernel rounds every step of a bfloat16 sample: the lowering follows its order exactly."""
    torch.manual_seed(4)
    x = torch.randn(2, 3, 5, 20).bfloat16()
    grid = (torch.rand(2, 7, 6, 2) * 2.4 - 1.2).bfloat16()
    for mode, pad, align in _pairwise(range(3), range(3)):
        check(aten.grid_sampler_2d.default, x, grid, mode, pad, align, rtol=0, atol=0)
    x3, g3 = torch.randn(1, 2, 4, 5, 6).bfloat16(), (torch.rand(1, 3, 4, 5, 3) * 2.4 - 1.2).bfloat16()
    for mode, pad in itertools.product(range(2), range(3)):
        check(aten.grid_sampler_3d.default, x3, g3, mode, pad, False, rtol=0, atol=0)
