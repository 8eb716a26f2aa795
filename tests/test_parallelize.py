"""Issue 17 §2: ``st.parallelize_module`` with DTensor's tensor/sequence-parallel styles as sharding
annotations, ``st.loss_parallel``, composition with FSDPv2, and a tiny Hugging Face Llama trained
with the Megatron recipe on a (4, 2) mesh, compared with eager torch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardtensor as st
from shardtensor import P, Replicate, Shard
from shardtensor.fsdp import FSDPv2


def _mesh(first="dp"):
    return st.init_device_mesh("cpu", (4, 2), mesh_dim_names=(first, "tp"))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


MLP_PLAN = {"up": st.ColwiseParallel(), "down": st.RowwiseParallel()}


def _pair(make, seed=0):
    torch.manual_seed(seed)
    ref = make()
    return ref, copy.deepcopy(ref)


def _check_forward_backward(ref, model, x, sharded_x):
    """Outputs and every parameter's gradient equal eager torch's."""
    out = model(sharded_x)
    (out * out).sum().backward()
    expected = ref(x)
    (expected * expected).sum().backward()
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), p_ref.grad, rtol=1e-5, atol=1e-5, msg=name)
    return out


def _collective_ops(fn, *args):
    """(kind, result type without layout) of every collective of the program ``fn(*args)`` records."""
    ex = st.explain(fn, *args)
    return [(op.kind, op.result_type.split("{")[0]) for op in ex.ops]


def test_colwise_then_rowwise_linear_is_one_all_reduce():
    mesh = _mesh()
    ref, model = _pair(MLP)
    st.parallelize_module(model, mesh, MLP_PLAN)
    # DTensor's placements: colwise splits the output features, rowwise the input features
    assert model.up.weight.partition_spec == P("tp", None) and model.up.bias.partition_spec == P("tp")
    assert model.down.weight.partition_spec == P(None, "tp") and model.down.bias.partition_spec == P(None)
    assert model.up.weight.placements == (Replicate(), Shard(0)) and st.tensor_parallel.is_tensor_parallel(
        model.up.weight
    )
    x = torch.randn(8, 4, 16)
    xs = st.shard(x, mesh, ("dp", None, None))
    # forward: the row-wise partial sums meet in one all-reduce of the (batch-split) output
    ops = _collective_ops(model, xs)
    assert ops == [("all-reduce", "f32[8,16]")]  # (2 * 4 rows of this device, 16)
    st.sync()
    out = _check_forward_backward(ref, model, x, xs)
    assert out.placements == (Shard(0), Replicate())  # output_layouts=Replicate(); the batch stays split


def test_one_axis_mesh_in_compile_and_eager_mode():
    mesh = st.init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
    ref, model = _pair(MLP)
    st.parallelize_module(model, mesh, MLP_PLAN)
    assert model.up.weight.partition_spec == P("tp", None) and model.down.weight.partition_spec == P(None, "tp")
    x = torch.randn(4, 16)
    compiled = st.compile(model)
    torch.testing.assert_close(compiled(st.shard(x, mesh, (None, None))).cpu(), ref(x), rtol=1e-5, atol=1e-5)
    with st.eager_mode():
        _check_forward_backward(ref, model, x, st.shard(x, mesh, (None, None)))


def test_embedding_styles():
    mesh = _mesh()
    ids = torch.randint(0, 12, (8, 5), generator=torch.Generator().manual_seed(0))
    for style, spec, out_tp in (
        (st.ColwiseParallel(), P(None, "tp"), Shard(2)),
        (st.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)), P("tp", None), Shard(1)),
    ):
        ref, model = _pair(lambda: nn.Embedding(12, 6))
        st.parallelize_module(model, mesh, style)
        assert model.weight.partition_spec == spec
        out = _check_forward_backward(ref, model, ids, st.shard(ids, mesh, ("dp", None)))
        assert out.placements == (Shard(0), out_tp)


def test_sequence_parallel_norm_keeps_the_sequence_split():
    mesh = _mesh()
    ref, model = _pair(lambda: nn.LayerNorm(8))
    st.parallelize_module(model, mesh, st.SequenceParallel())
    assert model.weight.partition_spec == P(None) and model.bias.partition_spec == P(None)
    x = torch.randn(4, 6, 8)
    out = _check_forward_backward(ref, model, x, st.shard(x, mesh, (None, None, None)))
    assert out.partition_spec == P("dp", "tp", None)
    assert _collective_ops(model, st.shard(x, mesh, ("dp", "tp", None))) == []  # per position: nothing moves


class TwoInputs(nn.Module):
    """Records the layouts its inputs arrive with; returns two tensors."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def forward(self, a, b, *, c=None):
        self.seen = {"a": a.partition_spec, "b": b.partition_spec, "c": c.partition_spec}
        return a * 2, b + c


def test_prepare_module_input_and_output():
    mesh = _mesh()
    module = TwoInputs()
    st.parallelize_module(
        module,
        mesh,
        {
            "": st.PrepareModuleInput(
                input_layouts=(Shard(1), None),
                desired_input_layouts=(Replicate(), None),
                input_kwarg_layouts={"c": Replicate()},
                desired_input_kwarg_layouts={"c": Shard(2)},
            )
        },
    )
    st.parallelize_module(
        module,
        mesh,
        st.PrepareModuleOutput(output_layouts=(Replicate(), None), desired_output_layouts=(Shard(1), None)),
    )
    a, b, c = (torch.randn(4, 6, 8) for _ in range(3))
    sa, sb, sc = (st.shard(t, mesh, (None, None, None)) for t in (a, b, c))
    with st.step():
        x, y = module(sa, sb, c=sc)
        assert module.seen == {"a": P("dp", None, None), "b": P(None, None, None), "c": P("dp", None, "tp")}
        assert x.partition_spec == P("dp", "tp", None)  # use_local_output: the output stays a ShardedTensor
    torch.testing.assert_close(x.cpu(), a * 2)
    torch.testing.assert_close(y.cpu(), b + c)


def test_loss_parallel_cross_entropy_on_vocab_split_logits():
    mesh = _mesh()
    ref, model = _pair(lambda: nn.Linear(8, 16))
    st.parallelize_module(model, mesh, st.ColwiseParallel(output_layouts=Shard(-1)))
    x = torch.randn(8, 8)
    target = torch.randint(0, 16, (8,), generator=torch.Generator().manual_seed(0))
    with st.loss_parallel():
        logits = model(st.shard(x, mesh, ("dp", None)))
        assert logits.placements == (Shard(0), Shard(1))
        loss = F.cross_entropy(logits, st.shard(target, mesh, ("dp",)))
        loss.backward()
    expected = F.cross_entropy(ref(x), target)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected)
    torch.testing.assert_close(model.weight.grad.cpu(), ref.weight.grad)
    assert model.weight.grad.partition_spec in (P("tp", None), None)

    def loss_of_float_logits(inp, tgt):  # .float() drops the head's annotation: the mesh names the axis
        with st.loss_parallel(mesh):
            loss = F.cross_entropy(model(inp).float(), tgt)
            loss.backward()
        return loss

    sx, st_target = st.shard(x, mesh, ("dp", None)), st.shard(target, mesh, ("dp",))
    assert all(kind == "all-reduce" for kind, _ in _collective_ops(loss_of_float_logits, sx, st_target))
    st.sync()


def test_bad_plans_are_clear_errors():
    mesh = _mesh()
    with pytest.raises(
        ValueError, match=r"'layers.\*.q_proj'.*no submodule of the module matches 'layers'.*\['down', 'up'\]"
    ):
        st.parallelize_module(MLP(), mesh, {"layers.*.q_proj": st.ColwiseParallel()})
    with pytest.raises(ValueError, match=r"no submodule of up matches 'x'"):
        st.parallelize_module(MLP(), mesh, {"up.x": st.ColwiseParallel()})
    with pytest.raises(TypeError, match="ColwiseParallel applies to nn.Linear and nn.Embedding, not to LayerNorm"):
        st.parallelize_module(nn.LayerNorm(4), mesh, st.ColwiseParallel())
    with pytest.raises(TypeError, match="RowwiseParallel applies to nn.Linear and nn.Embedding, not to MLP"):
        st.parallelize_module(MLP(), mesh, {"": st.RowwiseParallel()})
    with pytest.raises(TypeError, match=r"parallelize_plan\['up'\] is 'colwise', not a style"):
        st.parallelize_module(MLP(), mesh, {"up": "colwise"})
    with pytest.raises(TypeError, match="must be a style or a dict"):
        st.parallelize_module(MLP(), mesh, None)
    with pytest.raises(ValueError, match="needs to know which one is tensor parallel"):
        st.parallelize_module(MLP(), st.Mesh(range(8), (4, 2), ("a", "b")), MLP_PLAN)
    with pytest.raises(ValueError, match="tp_axis='z' is not an axis"):
        st.parallelize_module(MLP(), mesh, MLP_PLAN, tp_axis="z")
    with pytest.raises(ValueError, match="never a pending partial sum"):
        st.RowwiseParallel(output_layouts=st.Partial())
    with pytest.raises(ValueError, match="same length"):
        st.PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(),))
    model = st.parallelize_module(MLP(), mesh, MLP_PLAN)
    with pytest.raises(TypeError, match="not on st.device"):
        model(torch.randn(2, 16))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


def test_tied_parameters_stay_tied_or_are_a_clear_error():
    mesh = _mesh()
    ref, model = _pair(Tied)
    plan = {"a": st.ColwiseParallel(output_layouts=Replicate()), "b": st.ColwiseParallel()}
    st.parallelize_module(model, mesh, plan)
    assert model.a.weight is model.b.weight and model.a.weight.partition_spec == P("tp", None)
    x = torch.randn(8, 8)
    _check_forward_backward(ref, model, x, st.shard(x, mesh, ("dp", None)))
    with pytest.raises(ValueError, match=r"tied parameters \['a.weight', 'b.weight'\].*different layouts"):
        st.parallelize_module(Tied(), mesh, {"a": st.ColwiseParallel(), "b": st.RowwiseParallel()})
    with pytest.raises(ValueError, match="not in the plan"):
        st.parallelize_module(Tied(), mesh, {"a": st.ColwiseParallel()})
    untouched = Tied()
    with pytest.raises(TypeError, match="not to Tied"):  # the plan is checked before anything is placed
        st.parallelize_module(untouched, mesh, {"a": st.ColwiseParallel(), "": st.RowwiseParallel()})
    assert untouched.a.weight.device.type == "cpu" and not untouched.a._forward_hooks


def test_composes_with_fsdp_both_orders():
    mesh = _mesh("fsdp")
    x = torch.randn(8, 16)
    # the plan first, then FSDPv2 (torchtitan's order): FSDPv2 adds 'fsdp' where the plan left a dim whole
    ref, model = _pair(MLP)
    model = FSDPv2(st.parallelize_module(model, mesh, MLP_PLAN), mesh=mesh)
    m = model.module
    assert m.up.weight.partition_spec == P("tp", "fsdp") and m.up.bias.partition_spec == P(("fsdp", "tp"))
    assert m.down.weight.partition_spec == P("fsdp", "tp") and m.down.bias.partition_spec == P("fsdp")
    _check_forward_backward(ref, model, x, st.shard(x, mesh, ("fsdp", None)))
    # FSDPv2 first: the plan adds 'tp' and keeps 'fsdp'
    ref, model = _pair(MLP)
    model = FSDPv2(model, mesh=mesh)
    st.parallelize_module(model.module, mesh, MLP_PLAN)
    m = model.module
    # (FSDPv2 split each weight's largest dim; the plan's dim is the same one: split over both axes)
    assert m.up.weight.partition_spec == P(("fsdp", "tp"), None) and m.down.weight.partition_spec == P(
        None, ("fsdp", "tp")
    )
    _check_forward_backward(ref, model, x, st.shard(x, mesh, ("fsdp", None)))


# --------------------------------------------------------------------------- a tiny Hugging Face Llama


def llama_plan():
    """The recipe of docs/tensor_parallel.md: Megatron tensor parallelism with sequence-parallel norms."""
    attention_input = st.PrepareModuleInput(  # HF calls self_attn(hidden_states=...) by keyword
        input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
    )
    return {
        "model.embed_tokens": st.ColwiseParallel(output_layouts=Replicate()),
        "model.layers.*.input_layernorm": st.SequenceParallel(),
        "model.layers.*.self_attn": attention_input,
        "model.layers.*.self_attn.[qkv]_proj": st.ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": st.RowwiseParallel(output_layouts=Shard(1)),
        "model.layers.*.post_attention_layernorm": st.SequenceParallel(),
        "model.layers.*.mlp": st.PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "model.layers.*.mlp.[gu][ap]*_proj": st.ColwiseParallel(),  # gate_proj, up_proj
        "model.layers.*.mlp.down_proj": st.RowwiseParallel(output_layouts=Shard(1)),
        "model.norm": st.SequenceParallel(),
        "lm_head": st.ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1)),  # for loss_parallel
    }


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


STEPS = 5


@pytest.mark.parametrize("with_fsdp", [False, True], ids=["tp+dp", "tp+fsdpv2"])
def test_llama_tensor_and_sequence_parallel_trains_like_eager(with_fsdp):
    mesh = _mesh("fsdp" if with_fsdp else "dp")
    data_axis = mesh.axis_names[0]
    reference = _tiny_llama()
    model = st.parallelize_module(copy.deepcopy(reference), mesh, llama_plan())
    layer = model.model.layers[1]
    full_shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    if with_fsdp:
        model = FSDPv2(model, mesh=mesh)
        assert layer.self_attn.q_proj.weight.partition_spec == P("tp", "fsdp")
        assert layer.mlp.down_proj.weight.partition_spec == P("fsdp", "tp")
        assert layer.input_layernorm.weight.partition_spec == P("fsdp")
    else:
        assert layer.self_attn.q_proj.weight.partition_spec == P("tp", None)
        assert layer.self_attn.o_proj.weight.partition_spec == P(None, "tp")
        assert layer.input_layernorm.weight.partition_spec == P(None)
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    batch = st.shard(ids, mesh, (data_axis, None))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    def train_step(x):
        with st.loss_parallel(mesh):  # (HF's loss sees logits.float().view(-1, vocab): name the mesh)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    steps = STEPS
    if not with_fsdp:
        # explain records the first step (it runs with the next one; its loss is not kept)
        ops = _collective_ops(train_step, batch)
        steps -= 1
        kinds = [kind for kind, _ in ops]
        assert "all-to-all" not in kinds
        # no tensor-parallel weight is ever gathered whole: what moves over 'tp' are activations
        gathered = {tuple(int(n) for n in t[4:-1].split(",")) for kind, t in ops if kind == "all-gather"}
        assert not gathered & full_shapes, gathered & full_shapes
        # Megatron with sequence parallelism: per layer, the sequence-split activations (2 rows of
        # this device's batch, 16 positions, 64 features) are gathered before attention and the MLP in
        # forward and again in backward, and the row-wise partial sums (32 = 2 * 16 positions)
        # reduced after them (all-reduce + slice on CPU, a reduce-scatter where XLA makes one)
        assert ops.count(("all-gather", "f32[2,16,64]")) >= 4 * 2
        # attention keeps the heads split over 'tp' (SDPA is one op, its products batched over
        # (batch, heads)): the sequence-split activations are the only thing ever gathered
        assert {t for kind, t in ops if kind == "all-gather"} == {"f32[2,16,64]"}
        assert ops.count(("all-reduce", "f32[32,64]")) >= 2 * 2
    losses = []
    for _ in range(steps):
        with st.step():
            losses.append(train_step(batch))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    expected = []
    for _ in range(STEPS):
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        expected.append(loss.item())
    torch.testing.assert_close([loss.item() for loss in losses], expected[STEPS - steps :], rtol=1e-5, atol=1e-5)
    ref_layer = reference.model.layers[1]
    for name in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
        got_p, want_p = layer.get_parameter(name), ref_layer.get_parameter(name)
        torch.testing.assert_close(got_p.detach().cpu(), want_p.detach(), rtol=1e-4, atol=1e-5, msg=name)
