"""Issue 17 §3: manual regions — ``st.shard_map`` / ``st.local_map`` run a torch function on local
shards with ``st.manual.*`` collectives over mesh axes, as one node of the program: a hand-written
tensor-parallel MLP matches the annotated one and eager torch (forward and backward; lazy, eager,
``st.compile``), an all-gather attention and a ppermute ring match torch, and mismatched declarations
are clear errors."""

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from _training_helpers import Traces, mesh_4x2, mesh_8, reset_state


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    st.clear_counters()
    yield
    reset_state()


def _mlp_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 6, generator=g), torch.randn(6, 10, generator=g), torch.randn(10, 6, generator=g)


def _tp_mlp(x, w1, w2):
    """Megatron's MLP on local blocks: w1 column-sharded, w2 row-sharded, one all-reduce at the end."""
    return st.manual.all_reduce(torch.relu(x @ w1) @ w2, "model")


TP_SPECS = (st.P("data", None), st.P(None, "model"), st.P("model", None))


def _reference(x, w1, w2):
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    out = torch.relu(leaves[0] @ leaves[1]) @ leaves[2]
    out.pow(2).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _sharded(mesh, tensors, specs):
    return [st.shard(t, mesh, s).requires_grad_() for t, s in zip(tensors, specs)]


@pytest.mark.parametrize("eager", [False, True])
def test_hand_written_tensor_parallel_mlp_matches_annotated_and_eager(eager):
    mesh = mesh_4x2()
    data = _mlp_data()
    ref, ref_grads = _reference(*data)
    manual = st.shard_map(_tp_mlp, mesh, TP_SPECS, st.P("data", None))
    with st.eager_mode(eager):
        args = _sharded(mesh, data, TP_SPECS)
        out = manual(*args)
        out.pow(2).sum().backward()
        annotated_args = _sharded(mesh, data, TP_SPECS)  # the same program written for one device
        annotated = torch.relu(annotated_args[0] @ annotated_args[1]) @ annotated_args[2]
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.cpu(), annotated.cpu(), rtol=1e-5, atol=1e-5)
    for a, g in zip(args, ref_grads):
        torch.testing.assert_close(a.grad.cpu(), g, rtol=1e-4, atol=1e-4)


def test_region_in_st_compile_freezes_and_trains():
    mesh = mesh_4x2()
    calls = Traces()
    manual = st.shard_map(_tp_mlp, mesh, TP_SPECS, st.P("data", None))

    @st.compile
    def step(x, w1, w2):
        return manual(x, w1, w2) * 2

    for seed in range(4):
        data = _mlp_data(seed)
        out = step(*[st.shard(t, mesh, s) for t, s in zip(data, TP_SPECS)])
        torch.testing.assert_close(out.cpu(), 2 * (torch.relu(data[0] @ data[1]) @ data[2]), rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 and (st.counter_value("CompileFrozen") or 0) == 1


def test_local_map_row_parallel_with_a_partial_result_and_cpu_tensors():
    mesh = st.Mesh(range(8), (8,), ("tp",))
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 16, generator=g), torch.randn(16, 3, generator=g)
    row_parallel = st.local_map(
        lambda a, b: a @ b,
        out_placements=[st.Partial()],
        in_placements=([st.Shard(1)], [st.Shard(0)]),
        device_mesh=mesh,
    )
    xs = st.shard(x, mesh, (None, "tp")).requires_grad_()
    y = row_parallel(xs, st.shard(w, mesh, ("tp", None)))
    torch.testing.assert_close(y.cpu(), x @ w, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    torch.testing.assert_close(xs.grad.cpu(), w.sum(1).expand(4, 16), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row_parallel(x, w), x @ w, rtol=1e-5, atol=1e-5)  # CPU tensors in, CPU out


def test_all_gather_attention_over_sequence_shards_matches_sdpa():
    mesh = mesh_8()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 16, 4, generator=g) for _ in range(3))  # (batch, sequence, head dim)

    def attention(q_block, k_block, v_block):
        k_all = st.manual.all_gather(k_block, "d", dim=1)  # every device's keys and values
        v_all = st.manual.all_gather(v_block, "d", dim=1)
        return F.scaled_dot_product_attention(q_block, k_all, v_all)

    spec = st.P(None, "d", None)
    region = st.shard_map(attention, mesh, (spec, spec, spec), spec)
    args = [st.shard(t, mesh, spec).requires_grad_() for t in (q, k, v)]
    out = region(*args)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves)
    torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    for a, r in zip(args, leaves):
        torch.testing.assert_close(a.grad.cpu(), r.grad, rtol=1e-4, atol=1e-5)


def test_ring_ppermute_and_axis_index():
    mesh = mesh_8()

    def ring(block):
        n = st.manual.axis_size("d")
        shifted = st.manual.ppermute(block, "d", [(i, (i + 1) % n) for i in range(n)])
        return shifted + st.manual.axis_index("d", like=block).to(block.dtype)

    x = torch.arange(16.0).reshape(8, 2)
    out = st.shard_map(ring, mesh, (st.P("d", None),), st.P("d", None))(st.shard(x, mesh, ("d", None)))
    torch.testing.assert_close(out.cpu(), torch.roll(x, 1, 0) + torch.arange(8.0)[:, None])


def test_mismatched_declarations_are_clear_errors():
    mesh = mesh_4x2()
    x = st.shard(torch.randn(8, 6), mesh, ("data", None))
    with pytest.raises(ValueError, match="result 0 has 1 dimension.*declares 2"):
        st.shard_map(lambda a: a.sum(1), mesh, (st.P("data", None),), st.P("data", None))(x)
    with pytest.raises(ValueError, match="returns 2 tensors but out_specs declares one spec"):
        st.shard_map(lambda a: (a, a), mesh, (st.P("data", None),), st.P("data", None))(x)
    with pytest.raises(ValueError, match="does not split into 4 equal blocks"):
        st.shard_map(lambda a: a, mesh, (st.P("data", None),), st.P("data", None))(torch.ones(6, 2).to(st.device()))
    with pytest.raises(RuntimeError, match="inside a function run by st.shard_map"):
        st.manual.all_reduce(x, "data")
    with pytest.raises(ValueError, match="'nope' is not an axis"):
        st.shard_map(lambda a: st.manual.all_reduce(a, "nope"), mesh, (st.P("data", None),), st.P("data", None))(x)
    with pytest.raises(st.UnexpectedExecutionError):
        st.shard_map(lambda a: a * a.sum().item(), mesh, (st.P("data", None),), st.P("data", None))(x)


def test_collectives_and_their_transposes_match_a_per_device_emulation():
    mesh = mesh_8()
    g = torch.Generator().manual_seed(3)
    x, w, v = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g), torch.randn(1, 16, generator=g)

    def region(a):  # a: this device's row (1, 16)
        spread = st.manual.all_to_all(a.expand(8, 16) * 1.0, "d", split_dim=0, concat_dim=1)  # (1, 128)
        mine = st.manual.reduce_scatter(spread.reshape(8, 16), "d", dim=0)  # (1, 16)
        total = st.manual.all_reduce(a, "d")  # replicated (1, 16)
        return st.manual.ppermute(mine, "d", [(i, (i + 1) % 8) for i in range(8)]), total

    xs = st.shard(x, mesh, ("d", None)).requires_grad_()
    out, total = st.shard_map(region, mesh, (st.P("d", None),), (st.P("d", None), st.P()))(xs)
    ((out * st.shard(w, mesh, ("d", None))).sum() + (total * v.to(st.device())).sum()).backward()

    xr = x.clone().requires_grad_()
    rows = [xr[i : i + 1].expand(8, 16) for i in range(8)]  # device i's a.expand(8, 16)
    spread = [torch.cat([rows[i][j : j + 1] for i in range(8)], 1).reshape(8, 16) for j in range(8)]
    summed = sum(spread)
    ref = torch.cat([summed[(j - 1) % 8 : (j - 1) % 8 + 1] for j in range(8)])
    ref_total = xr.sum(0, keepdim=True)
    ((ref * w).sum() + (ref_total * v).sum()).backward()
    torch.testing.assert_close(out.cpu(), ref.detach())
    torch.testing.assert_close(total.cpu(), ref_total.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs.grad.cpu(), xr.grad, rtol=1e-5, atol=1e-5)


def test_region_under_torch_compile_is_one_op():
    import torch._dynamo

    mesh = mesh_4x2()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("shardtensor")(gm, example_inputs)

    torch._dynamo.reset()
    manual = st.shard_map(_tp_mlp, mesh, TP_SPECS, st.P("data", None))
    step = torch.compile(lambda *a: manual(*a).pow(2).sum(), backend=counting_backend, fullgraph=True)
    data = _mlp_data(4)
    ref, ref_grads = _reference(*data)
    args = _sharded(mesh, data, TP_SPECS)
    loss = step(*args)
    loss.backward()
    targets = [nd.target for nd in graphs[0].graph.nodes if nd.op == "call_function"]
    assert torch.ops.shardtensor.call_jax.default in targets or torch.ops.shardtensor.call_jax in targets
    torch.testing.assert_close(loss.item(), ref.pow(2).sum().item(), rtol=1e-5, atol=1e-4)
    for a, g in zip(args, ref_grads):
        torch.testing.assert_close(a.grad.cpu(), g, rtol=1e-4, atol=1e-4)


def _ring_attention(q, k, v):
    """Attention of the local queries over every device's keys/values, passed around a ring with an
    online softmax: no device holds the whole sequence."""
    n = st.manual.axis_size("data")
    ring = [(i, (i + 1) % n) for i in range(n)]
    scale = q.shape[-1] ** -0.5
    top = torch.full(q.shape[:-1] + (1,), float("-inf"), device=q.device)
    total = torch.zeros(q.shape[:-1] + (1,), device=q.device)
    acc = torch.zeros_like(q)
    for step in range(n):
        scores = (q @ k.transpose(-2, -1)) * scale
        new_top = torch.maximum(top, scores.amax(-1, keepdim=True))
        weights = torch.exp(scores - new_top)
        correction = torch.exp(top - new_top)
        total = total * correction + weights.sum(-1, keepdim=True)
        acc = acc * correction + weights @ v
        top = new_top
        if step < n - 1:
            k, v = st.manual.ppermute(k, "data", ring), st.manual.ppermute(v, "data", ring)
    return acc / total


def test_ring_attention_matches_sdpa_forward_and_backward():
    mesh = mesh_4x2()  # the ring runs along "data" (4 devices); "model" holds copies
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 8, 4, generator=g) for _ in range(3))
    spec = st.P(None, "data", None)
    args = [st.shard(t, mesh, spec).requires_grad_() for t in (q, k, v)]
    out = st.shard_map(_ring_attention, mesh, (spec, spec, spec), spec)(*args)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves)
    torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    for a, r in zip(args, leaves):
        torch.testing.assert_close(a.grad.cpu(), r.grad, rtol=1e-4, atol=1e-5)


def test_a_refused_region_leaves_the_step_and_the_random_key_intact():
    mesh = mesh_8()
    x = torch.randn(8, 4)
    xs = st.shard(x, mesh, ("d", None))
    before = xs * 3  # pending work of the step
    with pytest.raises(st.UnexpectedExecutionError):
        st.shard_map(lambda a: a * a.sum().item(), mesh, (st.P("d", None),), st.P("d", None))(xs)
    st.manual_seed(0)
    expected = torch.rand(3, device=st.device()).cpu()
    st.manual_seed(0)
    with pytest.raises(RuntimeError, match="draws random numbers"):
        st.shard_map(lambda a: a + torch.rand_like(a), mesh, (st.P("d", None),), st.P("d", None))(xs)
    torch.testing.assert_close(torch.rand(3, device=st.device()).cpu(), expected)
    torch.testing.assert_close(before.cpu(), x * 3)
