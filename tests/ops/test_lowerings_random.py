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
F32, F64, BF16, I64, I32, BOOL, U8 = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32,
                                      torch.bool, torch.uint8)
KEY = jax.random.key(0)
RANDOM_FROM = getattr(aten.random, "from")  # (a Python keyword)
N = 20000


def draw(op, *args, key=KEY, **kwargs):
    """Run the random lowering jitted (scalars as weak tracers) and return torch tensors; also check
    the shape and dtype against eager torch's."""
    low = lookup(op)
    assert low is not None and low.random, op
    jargs = [to_jax(a) if isinstance(a, torch.Tensor) else a for a in args]
    out = jax.jit(lambda k: low.fn(k, *jargs, **kwargs))(key)
    want = op(*args, **kwargs)
    outs, wants = (out, want) if isinstance(want, tuple) else ((out,), (want,))
    res = []
    for o, w in zip(outs, wants):
        assert tuple(o.shape) == tuple(w.shape), (op, o.shape, w.shape)
        assert dtypes.to_torch(o.dtype) == w.dtype, (op, o.dtype, w.dtype)
        res.append(to_torch(o))
    return tuple(res) if isinstance(want, tuple) else res[0]


def _moments(t, mean, std, tol=0.05):
    t = t.double()
    assert abs(t.mean().item() - mean) < tol * max(1.0, abs(std)), (t.mean(), mean)
    assert abs(t.std().item() - std) < tol * max(1.0, abs(std)), (t.std(), std)


@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_uniform_normal(dtype):
    x = torch.empty(N, dtype=dtype)
    u = draw(aten.uniform.default, x, -2.0, 3.0)
    assert u.min() >= -2 and u.max() <= 3
    _moments(u, 0.5, 5 / 12**0.5)
    _moments(draw(aten.normal_functional.default, x, 1.5, 0.5), 1.5, 0.5)
    _moments(draw(aten.normal.float_float, 2.0, 3.0, [N], dtype=dtype), 2.0, 3.0)
    mean = torch.full((N,), -1.0, dtype=dtype)
    _moments(draw(aten.normal.Tensor_float, mean, 2.0), -1.0, 2.0)
    _moments(draw(aten.normal.float_Tensor, 3.0, torch.full((N,), 0.5, dtype=dtype)), 3.0, 0.5)
    _moments(draw(aten.normal.Tensor_Tensor, mean, torch.full((N,), 0.5, dtype=dtype)), -1.0, 0.5)
    r = draw(aten.rand.default, [N], dtype=dtype)
    assert r.min() >= 0 and r.max() < 1
    _moments(r, 0.5, 1 / 12**0.5)
    _moments(draw(aten.randn.default, [N], dtype=dtype), 0.0, 1.0)
    _moments(draw(aten.rand_like.default, x), 0.5, 1 / 12**0.5)
    _moments(draw(aten.randn_like.default, x), 0.0, 1.0)


def test_default_dtypes_and_generator_overloads():
    g = torch.Generator()
    for op, args in ((aten.rand.default, ([3, 4],)), (aten.randn.default, ([2],)), (aten.randint.default, (5, [3])),
                     (aten.randint.low, (-2, 5, [3])), (aten.randperm.default, (7,)),
                     (aten.normal.float_float, (0.0, 1.0, [4]))):
        draw(op, *args)
    draw(aten.rand.generator, [3], generator=g)
    draw(aten.randn.generator, [3], generator=g)
    draw(aten.randint.generator, 5, [3], generator=g)
    draw(aten.randint.low_generator, 1, 5, [3], generator=g)
    draw(aten.randperm.generator, 4, generator=g)
    draw(aten.rand_like.default, make((3,), BF16), dtype=F64)


@pytest.mark.parametrize("dtype", [I64, I32, U8, F32, BF16])
def test_integers(dtype):
    x = torch.empty(N, dtype=dtype)
    r = draw(RANDOM_FROM, x, 3, 10)
    assert r.min() == 3 and r.max() == 9
    r = draw(aten.random.to, x, 7)
    assert r.min() == 0 and r.max() == 6
    r = draw(aten.random.default, x)
    assert r.min() >= 0
    if dtype == F32:
        assert r.max() <= 2**24
    r = draw(RANDOM_FROM, x, 5, None)
    assert r.min() >= 5
    r = draw(aten.randint.low, -3, 4, [N], dtype=dtype if dtype != U8 else I64)
    assert r.min() == -3 and r.max() == 3
    r = draw(aten.randint_like.default, x, 6)
    assert r.min() == 0 and r.max() == 5
    r = draw(aten.randint_like.low_dtype, x, 2, 6)
    assert r.min() == 2 and r.max() == 5


def test_randint_like_tensor_high_and_bool_random():
    x = torch.empty(1000, dtype=I64)
    r = draw(aten.randint_like.Tensor, x, torch.tensor(4))
    assert r.min() == 0 and r.max() == 3
    b = draw(aten.random.default, torch.empty(1000, dtype=BOOL))
    assert 300 < int(b.sum()) < 700


def test_randperm():
    for dtype in (I64, I32, F32):
        p = draw(aten.randperm.default, 50, dtype=dtype)
        assert sorted(p.tolist()) == list(range(50))


@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_bernoulli(dtype):
    probs = torch.rand(N, dtype=torch.float64).to(dtype)
    b = draw(aten.bernoulli.default, probs)
    assert set(b.unique().tolist()) <= {0.0, 1.0}
    assert abs(b.double().mean() - probs.double().mean()) < 0.02
    b = draw(aten.bernoulli.p, torch.empty(N, dtype=dtype), 0.3)
    assert abs(b.double().mean() - 0.3) < 0.02
    assert draw(aten.bernoulli.p, torch.empty(10, dtype=dtype), 0.0).sum() == 0
    assert draw(aten.bernoulli.p, torch.empty(10, dtype=dtype), 1.0).sum() == 10
    b = draw(aten.bernoulli.Tensor, torch.empty(4, N // 4, dtype=dtype), torch.tensor([[0.0], [0.2], [0.8], [1.0]]))
    assert torch.allclose(b.double().mean(1), torch.tensor([0.0, 0.2, 0.8, 1.0], dtype=torch.float64), atol=0.04)


@pytest.mark.parametrize("dtype", [F32, BF16, F64])
def test_native_dropout(dtype):
    x = make((100, 200), dtype, low=1, high=2)
    out, mask = draw(aten.native_dropout.default, x, 0.3, True)
    assert mask.dtype == BOOL and abs(mask.double().mean() - 0.7) < 0.02
    torch.testing.assert_close(out, torch.where(mask, x * (1 / 0.7), torch.zeros_like(x)))
    out, mask = draw(aten.native_dropout.default, x, 0.3, False)
    assert mask.all() and torch.equal(out, x)
    out, mask = draw(aten.native_dropout.default, x, 1.0, True)
    assert not mask.any() and not out.any()
    out, mask = draw(aten.native_dropout.default, x, 0.0, None)
    assert mask.all() and torch.equal(out, x)
    g = make((100, 200), dtype, seed=3)
    check(aten.native_dropout_backward.default, g, mask, 1 / 0.7)
    check(aten.native_dropout_backward.default, g, torch.rand(100, 200) > 0.5, 2.0)


def test_other_distributions():
    x = torch.empty(N)
    _moments(draw(aten.exponential.default, x, 2.0), 0.5, 0.5)
    c = draw(aten.cauchy.default, x, 1.0, 2.0)
    assert abs(c.median() - 1.0) < 0.1
    ln = draw(aten.log_normal.default, x, 0.5, 0.25)
    _moments(ln.log(), 0.5, 0.25)
    geo = draw(aten.geometric.default, x, 0.25)
    assert geo.min() >= 1 and abs(geo.mean() - 4.0) < 0.15
    pois = draw(aten.poisson.default, torch.full((N,), 3.0))
    assert abs(pois.mean() - 3.0) < 0.1 and torch.equal(pois, pois.round())
    gam = draw(aten._standard_gamma.default, torch.full((N,), 2.0))
    _moments(gam, 2.0, 2**0.5)


def test_multinomial():
    w = torch.tensor([0.0, 1.0, 3.0, 0.0, 6.0])
    s = draw(aten.multinomial.default, w, 3)
    assert sorted(s.tolist()) == [1, 2, 4]  # without replacement, zero weights never drawn
    s = draw(aten.multinomial.default, w, 2)
    assert len(set(s.tolist())) == 2 and not set(s.tolist()) & {0, 3}
    s = draw(aten.multinomial.default, w, 5000, True)
    freq = torch.bincount(s, minlength=5).double() / 5000
    assert torch.allclose(freq, w.double() / 10, atol=0.03)
    s2 = draw(aten.multinomial.default, torch.stack([w, w.flip(0)]), 4000, True)
    assert s2.shape == (2, 4000)
    assert torch.allclose(torch.bincount(s2[1], minlength=5).double() / 4000, w.flip(0).double() / 10, atol=0.03)


def test_keys_give_fresh_and_reproducible_values():
    x = torch.empty(64)
    a = draw(aten.uniform.default, x, key=jax.random.key(1))
    b = draw(aten.uniform.default, x, key=jax.random.key(1))
    c = draw(aten.uniform.default, x, key=jax.random.key(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # raw uint32 keys work too
    draw(aten.randn.default, [4], key=jax.random.PRNGKey(3))


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
def test_values_do_not_depend_on_sharding():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    cases = [
        (aten.randn.default, ([16, 8],), {}),
        (aten.rand.default, ([16, 8],), {"dtype": BF16}),
        (aten.randint.low, (0, 100, [16, 8]), {}),
        (aten.native_dropout.default, (jnp.ones((16, 8)), 0.5, True), {}),
        (aten.bernoulli.p, (jnp.ones((16, 8)), 0.5), {}),
        (aten.uniform.default, (jnp.ones((16, 8)), -1.0, 1.0), {}),
    ]
    for op, args, kw in cases:
        fn = lookup(op).fn

        def f(key):
            return fn(key, *args, **kw)

        plain = jax.jit(f)(KEY)
        for spec in (P("a", "b"), P(None, ("a", "b")), P("b", None)):
            sharded = jax.jit(f, out_shardings=NamedSharding(mesh, spec) if not isinstance(plain, tuple)
                              else (NamedSharding(mesh, spec),) * len(plain))(KEY)
            for p_, s_ in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(sharded)):
                np.testing.assert_array_equal(np.asarray(p_.astype(jnp.float32)), np.asarray(s_.astype(jnp.float32)))
