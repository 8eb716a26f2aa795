"""Issue 17 §4: ``st.call_jax`` / ``st.jax_op`` — a JAX function as one torch op: on CPU tensors, in
lazy, eager, ``st.compile`` (freezing) and ``torch.compile(backend="shardtensor")``, with gradients
through ``jax.vjp`` (or the function's own ``jax.custom_vjp``), run per shard under ``shard_map``, and
clear errors."""

import jax
import jax.numpy as jnp
import pytest
import torch

import shardtensor as st
from _training_helpers import Traces, mesh_4x2, mesh_8, reset_state


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    st.clear_counters()
    yield
    reset_state()


def n(name):
    return st.counter_value(name) or 0


def sin_times(a, b):
    return jnp.sin(a) * b


def _data(seed, shape=(8, 6)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _reference(x, w):
    """(sin(x) * w, d/dx of its sum, d/dw of its sum) by torch."""
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = torch.sin(xr) * wr
    out.sum().backward()
    return out.detach(), xr.grad, wr.grad


def test_cpu_tensors_forward_and_backward_match_torch():
    x, w = _data(0)
    ref, gx, gw = _reference(x, w)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = st.call_jax(sin_times, xr, wr)
    assert type(out) is torch.Tensor and out.device.type == "cpu"
    out.sum().backward()
    torch.testing.assert_close(out.detach(), ref)
    torch.testing.assert_close(xr.grad, gx)
    torch.testing.assert_close(wr.grad, gw)


@pytest.mark.parametrize("eager", [False, True])
def test_sharded_forward_and_backward_match_torch(eager):
    mesh = mesh_4x2()
    x, w = _data(1)
    ref, gx, gw = _reference(x, w)
    xs = st.shard(x, mesh, ("data", None)).requires_grad_()
    ws = st.shard(w, mesh, (None, "model")).requires_grad_()
    with st.eager_mode(eager):
        out = st.call_jax(sin_times, xs, ws)
        (out * 1).sum().backward()
    torch.testing.assert_close(out.cpu(), ref)
    torch.testing.assert_close(xs.grad.cpu(), gx)
    torch.testing.assert_close(ws.grad.cpu(), gw)


def test_lazy_step_is_one_program():
    mesh = mesh_8()
    x, w = _data(2)
    xs, ws = st.shard(x, mesh, ("d", None)), st.shard(w, mesh, ("d", None))
    before = n("ExecuteReplicated")
    y = torch.relu(st.call_jax(sin_times, xs + 1, ws)) * 2
    st.sync()
    assert n("ExecuteReplicated") - before == 1
    torch.testing.assert_close(y.cpu(), torch.relu(torch.sin(x + 1) * w) * 2)


def test_tuple_results_static_arguments_and_second_order():
    x, _ = _data(3)
    xs = st.shard(x, mesh_8(), ("d", None))
    values, indices = st.call_jax(lambda a, *, k: jax.lax.top_k(a, k), xs, k=2)
    ref = x.topk(2)
    torch.testing.assert_close(values.cpu(), ref.values)
    assert torch.equal(indices.cpu().long(), ref.indices)
    # the gradient of a gradient: the backward is a call_jax op with its own vjp
    xr = xs.detach().requires_grad_()
    (g,) = torch.autograd.grad(st.call_jax(jnp.sin, xr).sum(), xr, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), xr)
    torch.testing.assert_close(gg.cpu(), -torch.sin(x))


def test_custom_vjp_of_the_function_is_used():
    @jax.custom_vjp
    def clip_gradient(a):
        return a

    clip_gradient.defvjp(lambda a: (a, None), lambda _, g: (jnp.clip(g, -0.5, 0.5),))
    x, w = _data(4)
    xs = st.shard(x, mesh_8(), ("d", None)).requires_grad_()
    (st.call_jax(clip_gradient, xs) * st.shard(w, mesh_8(), ("d", None))).sum().backward()
    torch.testing.assert_close(xs.grad.cpu(), w.clamp(-0.5, 0.5))


def test_st_compile_freezes_a_step_with_a_jax_call():
    calls = Traces()
    mesh = mesh_4x2()

    @st.compile
    def step(a, b):
        return st.call_jax(sin_times, a * 2, b) + 1

    for seed in range(4):
        x, w = _data(10 + seed)
        out = step(st.shard(x, mesh, ("data", None)), st.shard(w, mesh, ("data", None)))
        torch.testing.assert_close(out.cpu(), torch.sin(x * 2) * w + 1)
    assert len(calls) == 2 and n("CompileFrozen") == 1


def test_torch_compile_sees_one_op_and_trains():
    import torch._dynamo

    mesh = mesh_8()
    x, w = _data(5)
    _, gx, gw = _reference(x, w)
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("shardtensor")(gm, example_inputs)

    torch._dynamo.reset()
    fn = torch.compile(lambda a, b: st.call_jax(sin_times, a, b).sum(), backend=counting_backend, fullgraph=True)
    xs = st.shard(x, mesh, ("d", None)).requires_grad_()
    ws = st.shard(w, mesh, ("d", None)).requires_grad_()
    loss = fn(xs, ws)
    loss.backward()
    calls = [nd.target for g in graphs for nd in g.graph.nodes if nd.op == "call_function"]
    assert torch.ops.shardtensor.call_jax.default in calls or torch.ops.shardtensor.call_jax in calls
    torch.testing.assert_close(loss.item(), (torch.sin(x) * w).sum().item(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs.grad.cpu(), gx)
    torch.testing.assert_close(ws.grad.cpu(), gw)


def test_jax_op_per_shard_with_shard_map():
    mesh = mesh_4x2()

    @st.jax_op(mesh=mesh, in_specs=(st.P("data", None), st.P()), out_specs=(st.P("data", None), st.P()))
    def per_shard(a, b, *, scale):
        # this device's block of rows, its row block's index, and a sum over the whole of a
        block = a * scale + jax.lax.axis_index("data").astype(a.dtype) * b
        return block, jax.lax.psum(a.sum(), "data")

    x, _ = _data(6, (8, 3))
    b = torch.tensor(10.0).expand(3).contiguous()
    xs = st.shard(x, mesh, ("data", None)).requires_grad_()
    out, total = per_shard(xs, st.shard(b, mesh, (None,)), scale=3.0)
    rows = torch.arange(8).div(2, rounding_mode="floor").float()[:, None]
    torch.testing.assert_close(out.cpu(), x * 3 + rows * 10)
    torch.testing.assert_close(total.cpu(), x.sum(), rtol=1e-5, atol=1e-5)
    (out.sum() + total).backward()  # backward through shard_map (psum's transpose)
    torch.testing.assert_close(xs.grad.cpu(), torch.full_like(x, 4.0))
    # the same op on CPU tensors
    cpu_out, _ = per_shard(x, b, scale=3.0)
    torch.testing.assert_close(cpu_out, x * 3 + rows * 10)


def test_decorator_without_arguments_keeps_the_name():
    @st.jax_op
    def double(a):
        return a * 2

    assert double.__name__ == "double"
    x, _ = _data(7)
    torch.testing.assert_close(double(st.shard(x, mesh_8(), ("d", None))).cpu(), x * 2)


def test_clear_errors():
    x, _ = _data(8)
    xs = st.shard(x, mesh_8(), ("d", None))
    with pytest.raises(TypeError, match="positional argument 1 is a float"):
        st.call_jax(lambda a, s: a * s, xs, 2.0)
    with pytest.raises(TypeError, match="output 0 .* is a dict"):
        st.call_jax(lambda a: {"y": a}, xs)
    with pytest.raises(TypeError, match="output 1 .* is a NoneType"):
        st.call_jax(lambda a: (a, None), x)
    with pytest.raises(TypeError, match="must be hashable"):
        st.call_jax(lambda a, *, m: a, xs, m=[1, 2])
    with pytest.raises(TypeError, match="dtype int4, which torch cannot hold"):
        st.call_jax(lambda a: a.astype(jnp.int4), xs)
    with pytest.raises(TypeError, match="JAX cannot hold"):
        st.call_jax(jnp.sin, torch.zeros(2, dtype=torch.float8_e4m3fnuz))


def test_out_specs_that_do_not_fit_the_output_are_a_clear_error():
    mesh = mesh_4x2()

    @st.jax_op(mesh=mesh, in_specs=(st.P("data", None),), out_specs=st.P("data", None, "model"))
    def rank_two(a):
        return a * 2

    with pytest.raises(ValueError, match="rank_two"):
        rank_two(st.shard(_data(9)[0], mesh, ("data", None)))
    with pytest.raises(ValueError, match="in_specs has 1 specs but the op got 2 tensors"):
        rank_two(torch.ones(8, 2), torch.ones(8, 2))
    with pytest.raises(ValueError, match="'nope' is not an axis"):
        st.jax_op(lambda a: a, mesh=mesh, in_specs=(("nope",),), out_specs=st.P())
