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
    want = [a.float() @ b.float(), (a.float() @ b.float())[None], bias + 2 * (a.float() @ b.float()),
            0.5 * bias + a.float() @ b.float()]

    def all_four(a, b, bias):
        return [lower(aten.mm.dtype)(a, b, f32), lower(aten.bmm.dtype)(a[None], b[None], f32),
                lower(aten.addmm.dtype)(bias, a, b, f32, alpha=2),
                lower(aten.baddbmm.dtype)(bias, a[None], b[None], f32, beta=0.5)[0]]

    assert_same(run(all_four, to_jax([a, b, bias]), {}), want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- torch's CPU rounding and scalars
def test_integer_beta_alpha_are_truncated():
    """int64 addmm & co: torch casts float beta/alpha to the integer dtype first (0.6 -> 0)."""
    i64 = torch.int64
    for beta, alpha in [(0.2, 0.6), (1.5, 2.7), (-1.5, -2.7)]:
        check(aten.addmv.default, r(3, dtype=i64), r(3, 4, dtype=i64), r(4, dtype=i64), beta=beta, alpha=alpha)
        check(aten.addmm.default, r(3, 5, dtype=i64), r(3, 4, dtype=i64), r(4, 5, dtype=i64), beta=beta, alpha=alpha)
        check(aten.baddbmm.default, r(2, 3, 5, dtype=i64), r(2, 3, 4, dtype=i64), r(2, 4, 5, dtype=i64),
              beta=beta, alpha=alpha)
        check(aten.addbmm.default, r(3, 5, dtype=i64), r(2, 3, 4, dtype=i64), r(2, 4, 5, dtype=i64),
              beta=beta, alpha=alpha)


def test_integer_products_are_exact():
    big = 2 ** 40  # products overflow int64: torch wraps around, so must we (no float detour)
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
        check(aten.addmm.default, r(6, 7, dtype=bf), r(6, 50, dtype=bf), r(50, 7, dtype=bf), beta=beta, alpha=alpha,
              rtol=0, atol=0)
        check(aten.baddbmm.default, r(3, 6, 7, dtype=bf), r(3, 6, 50, dtype=bf), r(3, 50, 7, dtype=bf), beta=beta,
              alpha=alpha, rtol=0, atol=0)
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


@pytest.mark.parametrize("transposed", [False, True])
def test_sharded_conv_with_spatially_sharded_kernel(transposed):
    """XLA's windowed partitioning of a convolution whose kernel is sharded over a spatial dim as
    well as the input (uneven, or dilated) gives wrong sums: the kernel is kept spatially whole."""
    st, mesh = _mesh()
    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    for size, k, dilation in [(5, 3, 2), (5, 3, 1), (8, 4, 2)]:
        x = torch.randn(1, 2, size, 5, 5, generator=g)
        w = torch.randn(2, 2, k, 3, 3, generator=g)
        sx, sw = st.shard(x, mesh, (None, None, "x", None, None)), st.shard(w, mesh, (None, None, "x", None, None))
        if transposed:
            want, got = F.conv_transpose3d(x, w, stride=2, dilation=dilation), F.conv_transpose3d(sx, sw, stride=2, dilation=dilation)
        else:
            want, got = F.conv3d(x, w, dilation=dilation), F.conv3d(sx, sw, dilation=dilation)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def _bf16_ulp(t):
    """The spacing of bfloat16 numbers at each element of ``t`` (8 significant bits)."""
    return torch.ldexp(torch.ones_like(t, dtype=torch.float64),
                       torch.frexp(t.double().abs().clamp_min(2.0 ** -126))[1] - 8)


def test_bfloat16_conv_bias_rounds_once():
    """The promise: a bf16 convolution accumulates in float32 and adds the bias before its one
    rounding to bf16. The reference is the exact (float64) result rounded once, which no CPU's
    kernels change; torch's own bf16 kernel rounds differently per instruction set (oneDNN on AVX2
    rounds before the bias), so it is compared at bf16's precision scaled by the sums' magnitudes."""
    st, mesh = _mesh()
    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 6, 8, 8, 8, generator=g) * 3).bfloat16()
    w, b = torch.randn(6, 4, 3, 3, 3, generator=g).bfloat16(), (torch.randn(4, generator=g) * 10).bfloat16()
    sx, sw, sb = (st.shard(t, mesh, ("x",) + (None,) * (t.dim() - 1)) for t in (x, w, b))
    for fn, kw in [(F.conv_transpose3d, dict(stride=2, padding=1)), (F.conv3d, dict(padding=1))]:
        ww, sww = (w, sw) if fn is F.conv_transpose3d else (w.transpose(0, 1).contiguous(), sw.transpose(0, 1))
        got = fn(sx, sww, sb, **kw).cpu()
        exact = fn(x.double(), ww.double(), b.double(), **kw)
        once = exact.bfloat16()
        twice = (fn(x.double(), ww.double(), None, **kw).bfloat16().double()
                 + b.double().view(-1, *[1] * (x.dim() - 2))).bfloat16()
        assert got.dtype == torch.bfloat16
        off = (got.double() - once.double()).abs() / _bf16_ulp(once)
        # float32 accumulation may land across a rounding midpoint on a rare element: one ulp, rarely
        assert off.max() <= 1 and (off > 0).double().mean() < 0.005, (
            f"{fn.__name__}: {(off > 0).double().mean():.2%} of elements differ from the once-rounded "
            f"exact result (up to {off.max():.0f} ulp)")
        # ... which rounding twice cannot meet: the test tells the two apart
        assert ((twice.double() - once.double()).abs() > 0).double().mean() > 0.05
        # torch's kernel: within two bf16 roundings of the sums' magnitudes, whatever the CPU
        scale = fn(x.double().abs(), ww.double().abs(), b.double().abs(), **kw)
        err = (got.double() - fn(x, ww, b, **kw).double()).abs()
        assert (err <= 2.0 ** -7 * scale).all(), f"{fn.__name__}: {err.max():.3g} from torch's kernel"


def test_bfloat16_adaptive_avg_pool3d_accumulates_like_torch():
    """torch's CPU kernel sums each window in bf16, rounding after every addition."""
    st, mesh = _mesh()
    x = torch.randn(8, 8, 8, 8, generator=torch.Generator().manual_seed(0)).bfloat16() * 8
    sx = st.shard(x, mesh, ("x", None, None, None))
    for out in [(5, 7, 4), (1, 1, 1), (8, 3, 8)]:
        want = torch.nn.functional.adaptive_avg_pool3d(x, out)
        torch.testing.assert_close(torch.nn.functional.adaptive_avg_pool3d(sx, out).cpu(), want, rtol=0, atol=0)


def test_bfloat16_norm_statistics_have_torch_cpu_dtypes():
    """torch's meta kernels say float32 for bf16 norms' saved statistics; its CPU kernels give bf16
    (float32 only with float32 parameters): shardtensor follows the CPU kernels."""
    st, mesh = _mesh()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, generator=g).bfloat16()
    w, b = torch.randn(3, generator=g).bfloat16(), torch.randn(3, generator=g).bfloat16()
    A = torch.ops.aten
    for params in [(w, b), (w.float(), b.float()), (None, None)]:
        sp = [None if p is None else st.shard(p, mesh, (None,)) for p in params]
        sx = st.shard(x, mesh, ("x", None, None))
        rm, rv = torch.zeros(3, dtype=x.dtype), torch.ones(3, dtype=x.dtype)
        if params[0] is not None and params[0].dtype == torch.float32:
            rm, rv = rm.float(), rv.float()
        srm, srv = st.shard(rm.clone(), mesh, (None,)), st.shard(rv.clone(), mesh, (None,))
        cases = [
            (A.native_layer_norm(sx, [5], None, None, 1e-5), A.native_layer_norm(x, [5], None, None, 1e-5)),
            (A.native_batch_norm(sx, *sp, srm, srv, True, 0.1, 1e-5), A.native_batch_norm(x, *params, rm, rv, True, 0.1, 1e-5)),
            (A._native_batch_norm_legit(sx, *sp, True, 0.1, 1e-5), A._native_batch_norm_legit(x, *params, True, 0.1, 1e-5)),
        ]
        for got, want in cases:
            for gi, wi in zip(got, want):
                assert gi.dtype == wi.dtype, (gi.dtype, wi.dtype)
                torch.testing.assert_close(gi.cpu(), wi, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(srm.cpu(), rm, rtol=1.6e-2, atol=1e-2)


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
        torch.testing.assert_close(torch.linalg.matrix_power(sa, 3).cpu(), torch.linalg.matrix_power(a, 3), rtol=1e-5, atol=1e-5)
        assert torch.isclose(sa, sa).cpu().all()
        torch.testing.assert_close(torch.isclose(sa, sb).cpu(), torch.isclose(a, b))
