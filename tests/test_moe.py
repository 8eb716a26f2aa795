"""Mixture-of-experts grouped matmul (``aten._grouped_mm``, shardtensor/ops/grouped_mm.py) against eager
torch on CPU: the bare op in its four operand layouts, forward and backward (torch's backward calls
``_grouped_mm`` again), with the experts' weights sharded over a mesh axis (expert parallel), and a
tiny random-init transformers ``MixtralForCausalLM`` (``experts_implementation="grouped_mm"``, its
default) trained one step: loss and every gradient.

torch's CPU kernel needs 16-byte aligned strides, so the shapes here are multiples of 4.
"""

import copy

import pytest
import torch

import shardtensor as st

TOL = {"rtol": 1e-5, "atol": 1e-5}
OFFS = torch.tensor([2, 2, 8], dtype=torch.int32)  # groups of 2, 0 and 6 rows

# (first operand, second operand, offs): rows grouped, columns grouped, contraction grouped, batched
LAYOUTS = {
    "2d_3d": ((8, 4), (3, 4, 8), OFFS),
    "3d_2d": ((3, 8, 4), (4, 8), OFFS),
    "2d_2d": ((8, 8), (8, 4), OFFS),
    "3d_3d": ((3, 4, 4), (3, 4, 8), None),
}


def _mesh_4x2():
    return st.Mesh(range(8), (4, 2), ("data", "expert"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_mm_forward_backward(layout):
    a_shape, b_shape, offs = LAYOUTS[layout]
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(a_shape, generator=g), torch.randn(b_shape, generator=g)
    ref_a, ref_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    ref = torch._grouped_mm(ref_a, ref_b, offs)
    grad = torch.randn(ref.shape, generator=g)
    ref.backward(grad)

    mesh = _mesh_4x2()
    # a group (expert) dimension sharded over "expert", the other operand over "data"
    dev_a = st.shard(a, mesh, ("expert" if len(a_shape) == 3 else "data",) + (None,) * (len(a_shape) - 1))
    dev_b = st.shard(b, mesh, ("expert",) + (None,) * (len(b_shape) - 1))
    dev_a.requires_grad_(), dev_b.requires_grad_()
    out = torch._grouped_mm(dev_a, dev_b, None if offs is None else offs.to(st.device()))
    out.backward(grad.to(st.device()))
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), **TOL)
    torch.testing.assert_close(dev_a.grad.cpu(), ref_a.grad, **TOL)
    torch.testing.assert_close(dev_b.grad.cpu(), ref_b.grad, **TOL)


def test_grouped_mm_rows_past_the_last_offset_and_errors():
    """torch leaves rows past offs[-1] unwritten (whatever memory held); shardtensor gives 0 there.
    Bad input raises torch's errors."""
    a, b = torch.randn(8, 4), torch.randn(3, 4, 8)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    dev = st.device()
    out = torch._grouped_mm(a.to(dev), b.to(dev), offs.to(dev)).cpu()
    torch.testing.assert_close(out[:6], torch._grouped_mm(a, b, offs)[:6], **TOL)
    assert out[6:].eq(0).all()
    bad = [
        ((a, b, offs.long()), "Offsets have to be int32"),
        ((a, b), "Have to provide offsets"),
        ((a, b[:, :3], offs), "contraction dimension"),
        ((a.double(), b.double(), offs), "Expected mat_a to be Float32, BFloat16 or Float16"),
    ]
    for args, message in bad:
        with pytest.raises(RuntimeError, match=message):
            torch._grouped_mm(*args)
        with pytest.raises(RuntimeError, match=message):
            torch._grouped_mm(*(t.to(dev) for t in args))
    with pytest.raises(RuntimeError, match="Bias not supported"):
        torch._grouped_mm(a.to(dev), b.to(dev), offs.to(dev), bias=torch.zeros(3, 8, device=dev))


def test_mixtral_forward_backward_expert_parallel(monkeypatch):
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=100,
        max_position_embeddings=32,
        output_router_logits=True,  # the router's auxiliary loss too
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    assert model.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, 100, (8, 6), generator=torch.Generator().manual_seed(1))
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    calls = []
    grouped_mm = torch.nn.functional.grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[0].device.type)
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "grouped_mm", counting)
    mesh = _mesh_4x2()
    model.to(st.device())
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
    assert len(experts) == 2  # gate_up_proj and down_proj: (experts, out, in)
    for p in experts.values():
        st.mark_sharding(p, mesh, ("expert", None, None))
    dev_ids = st.shard(ids, mesh, ("data", None))
    out = model(input_ids=dev_ids, labels=dev_ids)
    out.loss.backward()
    assert calls == [st.device().type] * 2  # up and down projections, through _grouped_mm
    torch.testing.assert_close(out.loss.detach().cpu(), ref.loss.detach(), **TOL)
    torch.testing.assert_close(out.aux_loss.detach().cpu(), ref.aux_loss.detach(), **TOL)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), ref_grads[name], **TOL, msg=name)
    for p in experts.values():
        assert p.partition_spec == st.PartitionSpec("expert", None, None)


def test_mixtral_lazy_training_step_is_one_program():
    """Issue 18: a lazy training step of a tiny Mixtral (default experts: ``_grouped_mm``, lowered)
    runs as one program and compiles once; losses and updated weights match eager torch. The
    parameters are moved before any global mesh exists (they land on the default mesh) and the
    batch is sharded over another mesh: the second step is the first one's program again."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    ref = transformers.MixtralForCausalLM(config)
    assert ref.config._experts_implementation == "grouped_mm"
    dev = copy.deepcopy(ref).to(st.device())
    st.sync()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    dev_opt = torch.optim.SGD(dev.parameters(), lr=0.1)
    mesh = st.Mesh(range(8), (8,), ("data",))
    for step in range(2):
        ids = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(step))
        expected = ref(input_ids=ids, labels=ids).loss
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        runs, compiles = st.counter_value("ExecuteReplicated") or 0, st.counter_value("UncachedCompile") or 0
        batch = st.shard(ids, mesh, ("data", None))
        loss = dev(input_ids=batch, labels=batch).loss
        loss.backward()
        dev_opt.step()
        dev_opt.zero_grad()
        st.sync()
        assert (st.counter_value("ExecuteReplicated") or 0) - runs == 1  # forward, backward, update
        assert (st.counter_value("UncachedCompile") or 0) - compiles == (1 if step == 0 else 0)
        torch.testing.assert_close(loss.detach().cpu(), expected.detach(), **TOL)
    for (name, p), q in zip(ref.named_parameters(), dev.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), **TOL, msg=name)
