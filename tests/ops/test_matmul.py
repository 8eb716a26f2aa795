"""Matrix-product lowerings (shardtensor/ops/matmul.py) against eager torch on CPU."""

import pytest
import torch

from _lowering_harness import aten, check, deferred_checks  # noqa: F401  (the deferred_checks fixture)

torch.manual_seed(0)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]


def r(*shape, dtype=torch.float32):
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(*shape, dtype=torch.float32 if dtype == torch.bfloat16 else dtype).to(dtype)
    return torch.randint(-9, 9, shape, dtype=dtype)


def tol(dtype):
    return {"rtol": 1.6e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}


@pytest.mark.parametrize("dtype", DTYPES)
def test_mm_bmm_mv_dot(dtype):
    check(aten.mm.default, r(3, 7, dtype=dtype), r(7, 5, dtype=dtype), **tol(dtype))
    check(aten.bmm.default, r(2, 3, 7, dtype=dtype), r(2, 7, 1, dtype=dtype), **tol(dtype))
    check(aten.mv.default, r(3, 7, dtype=dtype), r(7, dtype=dtype), **tol(dtype))
    check(aten.dot.default, r(7, dtype=dtype), r(7, dtype=dtype), **tol(dtype))


def test_empty_and_complex():
    check(aten.mm.default, r(3, 0), r(0, 4))
    check(aten.bmm.default, r(0, 2, 3), r(0, 3, 4))
    z = torch.randn(5, dtype=torch.complex128)
    check(aten.vdot.default, z, torch.randn(5, dtype=torch.complex128))
    check(aten.mm.default, torch.randn(2, 3, dtype=torch.complex64), torch.randn(3, 2, dtype=torch.complex64))


def test_float32_precision_is_full():
    # large contraction: at default (bf16-pass) precision XLA would be off by ~1e-2
    a, b = torch.randn(16, 512), torch.randn(512, 16)
    check(aten.mm.default, a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2), (0, 1), (2, 0)])
def test_addmm_family(dtype, beta, alpha):
    if dtype == torch.int64:
        beta, alpha = int(beta * 2), int(alpha)
    kw = dict(beta=beta, alpha=alpha, **tol(dtype))
    check(aten.addmm.default, r(5, dtype=dtype), r(3, 4, dtype=dtype), r(4, 5, dtype=dtype), **kw)
    check(aten.addmm.default, r(3, 5, dtype=dtype), r(3, 4, dtype=dtype), r(4, 5, dtype=dtype), **kw)
    check(aten.baddbmm.default, r(2, 3, 5, dtype=dtype), r(2, 3, 4, dtype=dtype), r(2, 4, 5, dtype=dtype), **kw)
    check(aten.baddbmm.default, r(1, 5, dtype=dtype), r(2, 3, 4, dtype=dtype), r(2, 4, 5, dtype=dtype), **kw)
    check(aten.addbmm.default, r(3, 5, dtype=dtype), r(2, 3, 4, dtype=dtype), r(2, 4, 5, dtype=dtype), **kw)
    check(aten.addmv.default, r(3, dtype=dtype), r(3, 4, dtype=dtype), r(4, dtype=dtype), **kw)
    check(aten.addr.default, r(3, 4, dtype=dtype), r(3, dtype=dtype), r(4, dtype=dtype), **kw)


def test_beta_zero_ignores_nan():
    bias = torch.full((3, 5), float("nan"))
    check(aten.addmm.default, bias, r(3, 4), r(4, 5), beta=0, alpha=1)
    check(aten.baddbmm.default, torch.full((2, 3, 5), float("inf")), r(2, 3, 4), r(2, 4, 5), beta=0.0)
    check(aten.addmv.default, torch.full((3,), float("nan")), r(3, 4), r(4), beta=0)


def test_addr_bool_and_addmm_activation():
    check(aten.addr.default, torch.rand(3, 4) > 0.5, torch.rand(3) > 0.5, torch.rand(4) > 0.5, beta=True, alpha=True)
    check(aten.addr.default, torch.rand(3, 4) > 0.5, torch.rand(3) > 0.5, torch.rand(4) > 0.5, beta=False, alpha=True)
    for gelu in (False, True):
        check(aten._addmm_activation.default, r(5), r(3, 4), r(4, 5), beta=0.5, alpha=2, use_gelu=gelu)


def test_dtype_mismatch_raises():
    from _lowering_harness import lower, to_jax

    with pytest.raises(RuntimeError):
        lower(aten.mm.default)(to_jax(r(2, 3)), to_jax(r(3, 2, dtype=torch.float64)))


def test_out_dtype_overloads():
    """mm/bmm/addmm/baddbmm.dtype (CUDA-only in torch): bf16 operands, float32 accumulation and result."""
    from _lowering_harness import assert_same, lower, run, to_jax

    a, b = r(3, 4, dtype=torch.bfloat16), r(4, 5, dtype=torch.bfloat16)
    bias = r(5)
    f32 = torch.float32
    want = [
        a.float() @ b.float(),
        (a.float() @ b.float())[None],
        bias + 2 * (a.float() @ b.float()),
        0.5 * bias + a.float() @ b.float(),
    ]

    def all_four(a, b, bias):
        return [
            lower(aten.mm.dtype)(a, b, f32),
            lower(aten.bmm.dtype)(a[None], b[None], f32),
            lower(aten.addmm.dtype)(bias, a, b, f32, alpha=2),
            lower(aten.baddbmm.dtype)(bias, a[None], b[None], f32, beta=0.5)[0],
        ]

    assert_same(run(all_four, to_jax([a, b, bias]), {}), want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- torch's CPU rounding and scalars
def test_integer_beta_alpha_are_truncated():
    """int64 addmm & co: torch casts float beta/alpha to the integer dtype first (0.6 -> 0)."""
    i64 = torch.int64
    for beta, alpha in [(0.2, 0.6), (1.5, 2.7), (-1.5, -2.7)]:
        check(aten.addmv.default, r(3, dtype=i64), r(3, 4, dtype=i64), r(4, dtype=i64), beta=beta, alpha=alpha)
        check(aten.addmm.default, r(3, 5, dtype=i64), r(3, 4, dtype=i64), r(4, 5, dtype=i64), beta=beta, alpha=alpha)
        check(
            aten.baddbmm.default,
            r(2, 3, 5, dtype=i64),
            r(2, 3, 4, dtype=i64),
            r(2, 4, 5, dtype=i64),
            beta=beta,
            alpha=alpha,
        )
        check(
            aten.addbmm.default,
            r(3, 5, dtype=i64),
            r(2, 3, 4, dtype=i64),
            r(2, 4, 5, dtype=i64),
            beta=beta,
            alpha=alpha,
        )


def test_integer_products_are_exact():
    big = 2**40  # products overflow int64: torch wraps around, so must we (no float detour)
    a, b = torch.randint(-big, big, (4, 16)), torch.randint(-big, big, (16, 3))
    check(aten.mm.default, a, b)
    check(aten.mv.default, a, b[:, 0])
    check(aten.dot.default, a[0], b[:, 0])
    check(aten.bmm.default, a[None], b[None])


def test_bfloat16_rounds_once():
    """torch's CPU addmm/baddbmm/mm on bf16: float32 accumulation, beta*self + alpha*prod in float32,
    one rounding: exact equality, not a tolerance."""
    bf = torch.bfloat16
    for beta, alpha in [(1, 1), (0.7, 1.3), (0, 2.5)]:
        check(
            aten.addmm.default,
            r(6, 7, dtype=bf),
            r(6, 50, dtype=bf),
            r(50, 7, dtype=bf),
            beta=beta,
            alpha=alpha,
            rtol=0,
            atol=0,
        )
        check(
            aten.baddbmm.default,
            r(3, 6, 7, dtype=bf),
            r(3, 6, 50, dtype=bf),
            r(3, 50, 7, dtype=bf),
            beta=beta,
            alpha=alpha,
            rtol=0,
            atol=0,
        )
    check(aten.mm.default, r(6, 50, dtype=bf), r(50, 7, dtype=bf), rtol=0, atol=0)
    check(aten.bmm.default, r(3, 6, 50, dtype=bf), r(3, 50, 7, dtype=bf), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_linalg_cross(dtype):
    exact = {} if dtype == torch.float32 else {"rtol": 0, "atol": 0}  # (float32: FMA contraction may differ)
    check(aten.linalg_cross.default, r(5, 3, dtype=dtype) * 4, r(5, 3, dtype=dtype) * 4, **exact)
    check(aten.linalg_cross.default, r(5, 3, 5, dtype=dtype) * 4, r(5, 3, 5, dtype=dtype) * 4, dim=1, **exact)
    check(aten.linalg_cross.default, r(3, 1, dtype=dtype), r(3, 4, dtype=dtype), dim=0, **exact)  # broadcast


def test_linalg_cross_errors():
    from _lowering_harness import lower, to_jax

    with pytest.raises(RuntimeError, match="must have length 3"):
        lower(aten.linalg_cross.default)(to_jax(r(4, 2)), to_jax(r(4, 2)))
    with pytest.raises(RuntimeError, match="same number of dimensions"):
        lower(aten.linalg_cross.default)(to_jax(r(3, 3)), to_jax(r(3)))


# -------------------------------------------- through the dispatcher: sharded, uneven, eager, bf16
def _mesh():
    import shardtensor as st

    return st, st.Mesh(range(8), (4, 2), ("x", "y"))


def test_eager_executable_cache_tells_repeated_inputs_apart():
    """Eager mode caches one executable per op signature: mm(a, a) takes one array, mm(a, b) two;
    they must not share an executable (matrix_power ran mm(a, a) then mm(a², a))."""
    st, mesh = _mesh()
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with st.eager_mode(True):
        sa, sb = st.shard(a, mesh, ("x", None)), st.shard(b, mesh, ("x", None))
        torch.testing.assert_close((sa @ sa).cpu(), a @ a)
        torch.testing.assert_close((sa @ sb).cpu(), a @ b)
        torch.testing.assert_close((sb @ sa).cpu(), b @ a)
        torch.testing.assert_close(
            torch.linalg.matrix_power(sa, 3).cpu(), torch.linalg.matrix_power(a, 3), rtol=1e-5, atol=1e-5
        )
        assert torch.isclose(sa, sa).cpu().all()
        torch.testing.assert_close(torch.isclose(sa, sb).cpu(), torch.isclose(a, b))
