"""Pallas kernels that compile on a TPU (issue 36 §4).

Mosaic, the TPU's kernel compiler, takes only 32-bit grid indices, index maps and loop counters, and
shardtensor traces with JAX's 64-bit types on (torch's int64): the shipped kernels and a user's
``pallas_call`` given to ``st.call_jax`` are traced with them off. On the CPU (interpret mode) the
tests check that property in the traced kernels; the tests marked ``tpu`` run the kernels on the chip
and compare with eager torch (skipped without a TPU: ``SHARDTENSOR_PLATFORM=tpu pytest -m tpu``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.experimental import pallas as pl

import shardtensor as st
from _training_helpers import reset_state
from shardtensor import runtime as rt
from shardtensor.kernels import flash_attention_jax, resolve_interpret

_64_BIT = {np.dtype(d) for d in ("int64", "uint64", "float64", "complex128")}


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    yield
    reset_state()


def _pallas_calls(jaxpr):
    """Every pallas_call equation in ``jaxpr`` and the jaxprs nested in its equations."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _pallas_calls(inner)


def _dtypes(jaxpr) -> set:
    """The dtypes of every value (and literal) in ``jaxpr``, nested jaxprs included."""
    found = {np.dtype(v.aval.dtype) for v in list(jaxpr.invars) + list(jaxpr.outvars) if hasattr(v.aval, "dtype")}
    for eqn in jaxpr.eqns:
        for v in list(eqn.invars) + list(eqn.outvars):
            if hasattr(v, "aval") and hasattr(v.aval, "dtype"):
                found.add(np.dtype(v.aval.dtype))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found |= _dtypes(inner)
    return found


def _kernel_types(jaxpr) -> tuple[int, set]:
    """(number of pallas_calls, the dtypes of their index maps' results and kernel bodies)."""
    calls = list(_pallas_calls(jaxpr))
    found: set = set()
    for eqn in calls:
        for block in eqn.params["grid_mapping"].block_mappings:
            found |= {np.dtype(v.aval.dtype) for v in block.index_map_jaxpr.jaxpr.outvars}
        found |= _dtypes(eqn.params["jaxpr"])
    return len(calls), found


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_kernels_trace_32_bit_indices_under_shardtensors_x64(causal):
    q = jax.ShapeDtypeStruct((1, 2, 32, 16), jnp.float32)
    attention = functools.partial(flash_attention_jax, causal=causal, block_q=16, block_k=16)

    def forward_and_backward(q, k, v):
        out, pull = jax.vjp(attention, q, k, v)
        return pull(out)

    with rt.x64_scope():  # as shardtensor traces its programs
        jaxpr = jax.make_jaxpr(forward_and_backward)(q, q, q)
        assert jnp.asarray(0).dtype == jnp.int64  # the scope is on around the kernels
    n, found = _kernel_types(jaxpr.jaxpr)
    assert n == 3  # forward, dk/dv and dq kernels
    assert not found & _64_BIT, found


def _add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]


SEEN_INDEX_TYPES: list = []


def _index_map(i):
    SEEN_INDEX_TYPES.append(jnp.asarray(0).dtype)  # the type the literal 0 below gets
    return i, 0


def user_pallas_add(x, y, interpret=None):
    """A user's own Pallas kernel: an elementwise add over blocks of 128 whole rows."""
    spec = pl.BlockSpec((128, x.shape[1]), _index_map)
    return pl.pallas_call(
        _add_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // 128,),
        in_specs=[spec, spec],
        out_specs=spec,
        interpret=resolve_interpret(interpret),
    )(x, y)


def test_a_users_pallas_call_through_call_jax_is_traced_32_bit():
    x, y = torch.randn(256, 128), torch.randn(256, 128)
    SEEN_INDEX_TYPES.clear()
    got = st.call_jax(user_pallas_add, x.to(st.device()), y.to(st.device()))
    torch.testing.assert_close(got.cpu(), x + y)
    # the last trace is the program's (its 2 input and 1 output block specs); a first one, with 64-bit
    # types on, only looked for a pallas_call in the function
    assert len(SEEN_INDEX_TYPES) >= 6
    assert set(SEEN_INDEX_TYPES[-3:]) == {jnp.dtype(jnp.int32)}, SEEN_INDEX_TYPES


def test_a_function_without_a_kernel_keeps_64_bit_types():
    """Only functions that hold a Pallas kernel change: elsewhere int64 and float64 stay 64-bit."""
    x = torch.arange(6)
    got = st.call_jax(lambda a: a + jnp.arange(6), x.to(st.device()))
    assert got.dtype == torch.int64
    torch.testing.assert_close(got.cpu(), x + torch.arange(6))
    big = torch.tensor([2**40])
    torch.testing.assert_close(st.call_jax(lambda a: a * 2, big.to(st.device())).cpu(), big * 2)


# --------------------------------------------------------------------------- on the chip


def _on_tpu() -> bool:
    return rt.platform() == "tpu"


tpu_only = pytest.mark.skipif(
    "not _on_tpu()", reason="needs a TPU chip: run SHARDTENSOR_PLATFORM=tpu pytest -m tpu on a TPU machine"
)


@pytest.mark.tpu
@tpu_only
def test_users_pallas_call_compiles_on_the_tpu():
    x, y = torch.randn(512, 256), torch.randn(512, 256)
    got = st.call_jax(user_pallas_add, x.to(st.device()), y.to(st.device()))
    torch.testing.assert_close(got.cpu(), x + y)


@pytest.mark.tpu
@tpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attention_forward_and_backward_on_the_tpu(dtype):
    torch.set_float32_matmul_precision("highest")
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(2, 4, 512, 64, generator=g).to(dtype) for _ in range(4))
    leaves = [t.to(st.device()).requires_grad_() for t in (q, k, v)]
    out = st.kernels.flash_attention(*leaves, causal=True)
    (out.float() * w.to(st.device()).float()).sum().backward()
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*refs, is_causal=True)
    (ref.float() * w.float()).sum().backward()
    # the kernel's products run on the MXU at JAX's default precision (one bf16 pass): errors are
    # bf16's relative to the largest value of each result
    got, want = [out] + [t.grad for t in leaves], [ref] + [t.grad for t in refs]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        b = b.float()
        atol = 2e-2 * b.abs().max().item()
        torch.testing.assert_close(a.cpu().float(), b, atol=atol, rtol=2e-2, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.tpu
@tpu_only
def test_causal_sdpa_runs_through_the_splash_kernel_on_the_tpu(monkeypatch):
    """bf16 causal SDPA at T=1024 takes JAX's splash kernel (issue 36 §6) and matches eager torch."""
    from shardtensor.ops import tpu_attention

    calls = []
    attend = tpu_attention._attend
    monkeypatch.setattr(tpu_attention, "_attend", lambda *a: calls.append(a[0].shape) or attend(*a))
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(2, 4, 1024, 64, generator=g).bfloat16() for _ in range(4))
    leaves = [t.to(st.device()).requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    (out.float() * w.to(st.device()).float()).sum().backward()
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*refs, is_causal=True)
    (ref.float() * w.float()).sum().backward()
    assert len(calls) >= 2, calls  # forward and backward
    for name, a, b in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in leaves], [ref] + [t.grad for t in refs]):
        b = b.float()
        atol = 2e-2 * b.abs().max().item()
        torch.testing.assert_close(a.cpu().float(), b, atol=atol, rtol=2e-2, msg=lambda m, name=name: f"{name}: {m}")
