"""Random lowerings: torch's shapes, dtypes, ranges and moments; determinism per key; values that do
not depend on the sharding. (Values cannot equal torch's CPU generator's.)"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _lowering_harness import check, dtypes, lookup, make, to_jax, to_torch  # noqa: E402

aten = torch.ops.aten
F32, F64, BF16, I64, I32, BOOL, U8 = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
)
KEY = jax.random.key(0)
RANDOM_FROM = getattr(aten.random, "from")  # (a Python keyword)
N = 20000


def draws(*calls, key=KEY):
    """Run random lowerings in one jit (each call gets its own key; scalars stay static Python values
    as the dispatcher passes ``float`` args), check each output's shape and dtype against eager torch,
    and return them as torch tensors. A call is ``(op, *args)`` or ``(op, *args, {kwargs})``."""
    norm = []
    for c in calls:
        op, *args = c
        kwargs = args.pop() if args and isinstance(args[-1], dict) else {}
        low = lookup(op)
        assert low is not None and low.random, op
        norm.append((op, low, args, kwargs))

    def f(key):
        keys = jax.random.split(key, len(norm))
        return [
            low.fn(keys[i], *[to_jax(a) if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
            for i, (op, low, args, kwargs) in enumerate(norm)
        ]

    outs = jax.jit(f)(key)
    results = []
    for (op, _low, args, kwargs), out in zip(norm, outs):
        want = op(*args, **kwargs)
        pairs = zip(out, want) if isinstance(want, tuple) else [(out, want)]
        res = []
        for o, w in pairs:
            assert tuple(o.shape) == tuple(w.shape), (op, o.shape, w.shape)
            assert dtypes.to_torch(o.dtype) == w.dtype, (op, o.dtype, w.dtype)
            res.append(to_torch(o))
        results.append(tuple(res) if isinstance(want, tuple) else res[0])
    return results


def draw(op, *args, key=KEY, **kwargs):
    """One random lowering (see ``draws``)."""
    return draws((op, *args, kwargs), key=key)[0]


def _moments(t, mean, std, tol=0.05):
    t = t.double()
    assert abs(t.mean().item() - mean) < tol * max(1.0, abs(std)), (t.mean(), mean)
    assert abs(t.std().item() - std) < tol * max(1.0, abs(std)), (t.std(), std)


@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_uniform_normal(dtype):
    x = torch.empty(N, dtype=dtype)
    mean, half = torch.full((N,), -1.0, dtype=dtype), torch.full((N,), 0.5, dtype=dtype)
    u, u01, n1, n2, n3, n4, n5, r, rn, rl, rnl = draws(
        (aten.uniform.default, x, -2.0, 3.0),
        (aten.uniform.default, x),
        (aten.normal_functional.default, x, 1.5, 0.5),
        (aten.normal.float_float, 2.0, 3.0, [N], {"dtype": dtype}),
        (aten.normal.Tensor_float, mean, 2.0),
        (aten.normal.float_Tensor, 3.0, half),
        (aten.normal.Tensor_Tensor, mean, half),
        (aten.rand.default, [N], {"dtype": dtype}),
        (aten.randn.default, [N], {"dtype": dtype}),
        (aten.rand_like.default, x),
        (aten.randn_like.default, x),
    )
    assert u.min() >= -2 and u.max() < 3
    _moments(u, 0.5, 5 / 12**0.5)
    for t in (u01, r, rl):
        assert t.min() >= 0 and t.max() < 1
        _moments(t, 0.5, 1 / 12**0.5)
    _moments(n1, 1.5, 0.5)
    _moments(n2, 2.0, 3.0)
    _moments(n3, -1.0, 2.0)
    _moments(n4, 3.0, 0.5)
    _moments(n5, -1.0, 0.5)
    _moments(rn, 0.0, 1.0)
    _moments(rnl, 0.0, 1.0)


def test_default_dtypes_and_generator_overloads():
    g = torch.Generator()
    draws(
        (aten.rand.default, [3, 4]),
        (aten.randn.default, [2]),
        (aten.randint.default, 5, [3]),
        (aten.randint.low, -2, 5, [3]),
        (aten.randperm.default, 7),
        (aten.normal.float_float, 0.0, 1.0, [4]),
        (aten.rand.generator, [3], {"generator": g}),
        (aten.randn.generator, [3], {"generator": g}),
        (aten.randint.generator, 5, [3], {"generator": g}),
        (aten.randint.low_generator, 1, 5, [3], {"generator": g}),
        (aten.randperm.generator, 4, {"generator": g}),
        (aten.rand_like.default, make((3,), BF16), {"dtype": F64}),
    )


def test_integers():
    calls = []
    kinds = (I64, U8, F32)
    for dtype in kinds:
        x = torch.empty(2000, dtype=dtype)
        calls += [
            (RANDOM_FROM, x, 3, 10),
            (aten.random.to, x, 7),
            (aten.random.default, x),
            (RANDOM_FROM, x, 5, None),
            (aten.randint.low, -3, 4, [2000], {"dtype": dtype if dtype != U8 else I64}),
            (aten.randint_like.default, x, 6),
            (aten.randint_like.low_dtype, x, 2, 6),
        ]
    outs = iter(draws(*calls))
    for dtype in kinds:
        r_from, r_to, r_def, r_open, r_int, r_like, r_like_low = (next(outs) for _ in range(7))
        assert r_from.min() == 3 and r_from.max() == 9
        assert r_to.min() == 0 and r_to.max() == 6
        assert r_def.min() >= 0
        if dtype == F32:
            assert r_def.max() <= 2**24
        assert r_open.min() >= 5
        assert r_int.min() == -3 and r_int.max() == 3
        assert r_like.min() == 0 and r_like.max() == 5
        assert r_like_low.min() == 2 and r_like_low.max() == 5


def test_randint_like_tensor_high_bool_random_randperm():
    r, b, *perms = draws(
        (aten.randint_like.Tensor, torch.empty(1000, dtype=I64), torch.tensor(4)),
        (aten.random.default, torch.empty(1000, dtype=BOOL)),
        *[(aten.randperm.default, 50, {"dtype": dtype}) for dtype in (I64, I32, F32)],
    )
    assert r.min() == 0 and r.max() == 3
    assert 300 < int(b.sum()) < 700
    for p in perms:
        assert sorted(p.tolist()) == list(range(50))


@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_bernoulli(dtype):
    probs = torch.rand(N, dtype=torch.float64).to(dtype)
    b0, b1, b2, b3, b4 = draws(
        (aten.bernoulli.default, probs),
        (aten.bernoulli.p, torch.empty(N, dtype=dtype), 0.3),
        (aten.bernoulli.p, torch.empty(10, dtype=dtype), 0.0),
        (aten.bernoulli.p, torch.empty(10, dtype=dtype), 1.0),
        (aten.bernoulli.Tensor, torch.empty(4, N // 4, dtype=dtype), torch.tensor([[0.0], [0.2], [0.8], [1.0]])),
    )
    assert set(b0.unique().tolist()) <= {0.0, 1.0}
    assert abs(b0.double().mean() - probs.double().mean()) < 0.02
    assert abs(b1.double().mean() - 0.3) < 0.02
    assert b2.sum() == 0 and b3.sum() == 10
    assert torch.allclose(b4.double().mean(1), torch.tensor([0.0, 0.2, 0.8, 1.0], dtype=torch.float64), atol=0.04)


@pytest.mark.parametrize("dtype", [F32, BF16, F64])
def test_native_dropout(dtype):
    x = make((100, 200), dtype, low=1, high=2)
    (out, mask), (out_eval, mask_eval), (out_all, mask_all), (out_none, mask_none) = draws(
        (aten.native_dropout.default, x, 0.3, True),
        (aten.native_dropout.default, x, 0.3, False),
        (aten.native_dropout.default, x, 1.0, True),
        (aten.native_dropout.default, x, 0.0, None),
    )
    assert mask.dtype == BOOL and abs(mask.double().mean() - 0.7) < 0.02
    torch.testing.assert_close(out, torch.where(mask, x * (1 / 0.7), torch.zeros_like(x)))
    assert mask_eval.all() and torch.equal(out_eval, x)
    assert not mask_all.any() and not out_all.any()
    assert mask_none.all() and torch.equal(out_none, x)
    g = make((100, 200), dtype, seed=3)
    check(aten.native_dropout_backward.default, g, mask, 1 / 0.7)


def test_other_distributions():
    x = torch.empty(N)
    e, c, ln, geo, pois, gam = draws(
        (aten.exponential.default, x, 2.0),
        (aten.cauchy.default, x, 1.0, 2.0),
        (aten.log_normal.default, x, 0.5, 0.25),
        (aten.geometric.default, x, 0.25),
        (aten.poisson.default, torch.full((N,), 3.0)),
        (aten._standard_gamma.default, torch.full((N,), 2.0)),
    )
    _moments(e, 0.5, 0.5)
    assert abs(c.median() - 1.0) < 0.1
    _moments(ln.log(), 0.5, 0.25)
    assert geo.min() >= 1 and abs(geo.mean() - 4.0) < 0.15
    assert abs(pois.mean() - 3.0) < 0.1 and torch.equal(pois, pois.round())
    _moments(gam, 2.0, 2**0.5)


def test_multinomial():
    w = torch.tensor([0.0, 1.0, 3.0, 0.0, 6.0])
    s3, s2, s_rep, s_2d = draws(
        (aten.multinomial.default, w, 3),
        (aten.multinomial.default, w, 2),
        (aten.multinomial.default, w, 5000, True),
        (aten.multinomial.default, torch.stack([w, w.flip(0)]), 4000, True),
    )
    assert sorted(s3.tolist()) == [1, 2, 4]  # without replacement, zero weights never drawn
    assert len(set(s2.tolist())) == 2 and not set(s2.tolist()) & {0, 3}
    freq = torch.bincount(s_rep, minlength=5).double() / 5000
    assert torch.allclose(freq, w.double() / 10, atol=0.03)
    assert s_2d.shape == (2, 4000)
    assert torch.allclose(torch.bincount(s_2d[1], minlength=5).double() / 4000, w.flip(0).double() / 10, atol=0.03)


def test_keys_give_fresh_and_reproducible_values():
    fn = lookup(aten.uniform.default).fn
    f = jax.jit(lambda k: fn(k, jnp.zeros(64)))
    a, b, c = f(jax.random.key(1)), f(jax.random.key(1)), f(jax.random.key(2))
    assert (a == b).all() and not (a == c).all()
    assert lookup(aten.randn.default).fn(jax.random.PRNGKey(3), [4]).shape == (4,)  # raw uint32 keys work too


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
def test_values_do_not_depend_on_sharding():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    ones = jnp.ones((16, 8))
    cases = [
        (aten.randn.default, ([16, 8],), {}),
        (aten.rand.default, ([16, 8],), {"dtype": BF16}),
        (aten.randint.low, (0, 100, [16, 8]), {}),
        (aten.native_dropout.default, (ones, 0.5, True), {}),
        (aten.normal_functional.default, (ones, 0.0, 1.0), {}),
    ]

    def f(key):
        keys = jax.random.split(key, len(cases))
        outs = [lookup(op).fn(keys[i], *args, **kw) for i, (op, args, kw) in enumerate(cases)]
        return jax.tree_util.tree_leaves(outs)

    plain = jax.jit(f)(KEY)
    for spec in (P("a", "b"), P(None, ("a", "b"))):
        sharding = NamedSharding(mesh, spec)
        sharded = jax.jit(f, out_shardings=[sharding] * len(plain))(KEY)
        for p_, s_ in zip(plain, sharded):
            assert s_.sharding.is_equivalent_to(sharding, 2)
            np.testing.assert_array_equal(np.asarray(p_.astype(jnp.float32)), np.asarray(s_.astype(jnp.float32)))
