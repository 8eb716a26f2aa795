"""Issue 4 §4: ``torch.compile(model, backend="shardtensor")`` — Dynamo captures a model on sharded
parameters and inputs without graph breaks, each captured graph runs as one JAX program, results and
training match eager torch on CPU, graph breaks still give the right answer, and a new input sharding
(same shape) recompiles."""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters as dynamo_counters
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import shardtensor as st
from _training_helpers import (
    ATOL,
    MLP,
    MLP_SPECS,
    RTOL,
    LM_SPECS_4x2,
    TinyLM,
    make_pair,
    mesh_4x2,
    mesh_8,
    reset_state,
    shard_params,
)


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    torch._dynamo.reset()
    dynamo_counters.clear()
    st.clear_counters()
    yield
    reset_state()
    torch._dynamo.reset()


def n(name):
    return st.counter_value(name) or 0


def graph_breaks():
    return sum(dynamo_counters["graph_break"].values())


def graphs():
    return dynamo_counters["stats"]["unique_graphs"]


def _x(seed, shape=(16, 16)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- registration ----------------------------------------------------------------------------------
def test_backend_is_registered_by_name():
    assert "shardtensor" in torch._dynamo.list_backends()
    # registering costs no torch._dynamo import (about 3 s) at `import shardtensor`
    code = "import sys, shardtensor; assert 'torch._dynamo' not in sys.modules, 'dynamo imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_backend_name_works_without_the_entry_point():
    """Run from a source tree that was never pip-installed (or with stale metadata shadowing the
    installed one), Dynamo sees no entry point: the name is registered when Dynamo loads."""
    code = textwrap.dedent("""
        import importlib.metadata as md
        import torch, shardtensor as st
        seen = md.entry_points
        md.entry_points = lambda **kw: md.EntryPoints([]) if kw.get("group") == "torch_dynamo_backends" else seen(**kw)
        f = torch.compile(lambda x: (x * 2).sum(), backend="shardtensor")
        print(f(torch.ones(8, 4).to(st.device())).item())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("64.0"), out.stderr[-3000:]


def test_sharded_tensor_is_traceable_only_while_compiling():
    # outside compilation nn.Module.to() must keep its usual path (not torch.utils.swap_tensors,
    # which fails while autograd still references a parameter)
    x = st.shard(_x(0), mesh_8(), ("d", None))
    assert not is_traceable_wrapper_subclass(x)
    lin = nn.Linear(16, 4)
    lin(_x(1)).sum().backward()  # the graph keeps references to lin.weight
    moved = lin.to(st.device())
    assert isinstance(moved.weight, st.ShardedTensor)


# --- forward ---------------------------------------------------------------------------------------
def test_mlp_one_graph_one_program_matches_eager():
    mesh = mesh_8()
    ref, dev = make_pair(MLP)
    shard_params(dev, mesh, MLP_SPECS)
    st.sync()  # the parameters' own pending work is not part of the count below
    compiled = torch.compile(dev, backend="shardtensor")
    for seed in range(4):  # new values each call; the later calls replay the frozen program
        x = _x(seed)
        xs = st.shard(x, mesh, ("d", None))
        before = n("ExecuteReplicated")
        with torch.no_grad():
            out = compiled(xs)
        assert n("ExecuteReplicated") - before == 1, "one program per call"
        torch.testing.assert_close(out.cpu(), ref(x).detach(), rtol=RTOL, atol=ATOL)
    assert graph_breaks() == 0
    assert graphs() == 1
    assert n("DynamoGraph") == 1
    assert n("CompileReplay") >= 1, "the graph's Python no longer runs once frozen"


def test_transformer_lm_matches_eager():
    mesh = mesh_4x2()
    ref, dev = make_pair(TinyLM)
    shard_params(dev, mesh, LM_SPECS_4x2)
    st.sync()
    compiled = torch.compile(dev, backend="shardtensor")
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        idx = torch.randint(0, 30, (8, 8), generator=g)
        before = n("ExecuteReplicated")
        out = compiled(st.shard(idx, mesh, ("data", None)))  # requires grad: pending, for a backward
        result = out.cpu()
        assert n("ExecuteReplicated") - before == 1
        torch.testing.assert_close(result, ref(idx).detach(), rtol=RTOL, atol=ATOL)
    # embedding, torch.arange(device=...), RMSNorm, SDPA and softmax attention, views: all captured
    assert graph_breaks() == 0
    assert graphs() == 1


# --- training --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.AdamW(p, lr=0.01),
    ],
    ids=["sgd", "adamw"],
)
def test_training_through_compiled_model_matches_eager(make_opt):
    mesh = mesh_8()
    ref, dev = make_pair(MLP)
    shard_params(dev, mesh, MLP_SPECS)
    ref_opt, dev_opt = make_opt(ref.parameters()), make_opt(dev.parameters())
    compiled = torch.compile(dev, backend="shardtensor")
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(16, 16, generator=g), torch.randint(0, 5, (16,), generator=g)
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        xs, ys = st.shard(x, mesh, ("d", None)), st.shard(y, mesh, ("d",))
        st.sync()
        before = n("ExecuteReplicated")
        with st.step():  # the compiled forward stays pending: one program with backward and optimizer
            loss = F.cross_entropy(compiled(xs), ys)
            loss.backward()
            dev_opt.step()
            dev_opt.zero_grad()
        assert n("ExecuteReplicated") - before == 1
        torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(ref.named_parameters(), dev.parameters()):
        torch.testing.assert_close(q.cpu(), p.detach(), rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
    assert graph_breaks() == 0
    assert graphs() == 1


# --- a whole training step under torch.compile ----------------------------------------------------
def _train_step(model, opt):
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # a graph break: the backward records onto the forward's pending program
        opt.step()
        opt.zero_grad()
        return loss

    return step


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.AdamW(p, lr=0.01),  # Dynamo writes its updates with prims.fma
    ],
    ids=["sgd", "adamw"],
)
def test_compiled_training_step_is_one_program(make_opt):
    mesh = mesh_8()
    ref, dev = make_pair(MLP)
    shard_params(dev, mesh, MLP_SPECS)
    ref_opt, dev_opt = make_opt(ref.parameters()), make_opt(dev.parameters())
    ref_step, compiled = _train_step(ref, ref_opt), torch.compile(_train_step(dev, dev_opt), backend="shardtensor")
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        x, y = torch.randn(16, 16, generator=g), torch.randint(0, 5, (16,), generator=g)
        xs, ys = st.shard(x, mesh, ("d", None)), st.shard(y, mesh, ("d",))
        st.sync()  # the inputs' uploads are not part of the count below
        before = {k: n(k) for k in ("ExecuteReplicated", "UncachedCompile", "DynamoGraph")}
        loss = compiled(xs, ys)
        assert n("ExecuteReplicated") - before["ExecuteReplicated"] == 1, "forward, backward and update: one program"
        if i >= 2:  # (step 0 creates the optimizer state and step 1 starts from parameters XLA laid out)
            assert n("DynamoGraph") == before["DynamoGraph"], "no Dynamo recompile"
            assert n("UncachedCompile") == before["UncachedCompile"], "no XLA compile"
        torch.testing.assert_close(loss.item(), ref_step(x, y).item(), rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(ref.named_parameters(), dev.parameters()):
        torch.testing.assert_close(q.cpu(), p.detach(), rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
        assert q.grad is None  # zero_grad ran after the update
    # Dynamo compiled only the step's own frames (forward; the optimizer step, once more when its
    # state appears), never shardtensor's dispatch running under backward()
    assert graphs() <= 3


def test_compiled_fsdpv2_model_trains_like_eager():
    """FSDPv2's forward shards its output reading ``partition_spec``: under Dynamo the tensors it
    reads are the tracing stand-ins, which answer from the traced input's sharding."""
    from shardtensor.fsdp import FSDPv2

    mesh = st.Mesh(range(8), (8,), ("fsdp",))
    ref, dev = make_pair(MLP)
    dev = FSDPv2(dev, mesh=mesh)
    ref_opt, dev_opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(dev.parameters(), lr=0.1)
    compiled = _train_step(dev, dev_opt)
    compiled = torch.compile(compiled, backend="shardtensor")
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        x, y = torch.randn(16, 16, generator=g), torch.randint(0, 5, (16,), generator=g)
        loss = compiled(x.to(st.device()), y.to(st.device()))
        torch.testing.assert_close(loss.item(), _train_step(ref, ref_opt)(x, y).item(), rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(ref.named_parameters(), dev.module.parameters()):
        torch.testing.assert_close(q.cpu(), p.detach(), rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


# --- tensors made from host data inside the compiled function -------------------------------------
def _fresh_tensors(x, n):
    dev = x.device
    made = torch.tensor([1.5, 2.5], device=dev)  # torch's kernels run for real even while tracing
    counted = torch.tensor([n, n + 1], device=dev)  # n symbolic after a recompile: Dynamo's own fake
    zeros = torch.zeros(2, device=dev)  # a fake of Dynamo's fake mode while tracing
    return torch.cat([x * torch.tensor(3.0, device=dev), made + zeros, made * counted])


def test_host_data_tensors_inside_a_compiled_function():
    """``torch.tensor(data, device=st.device())`` in traced code meets Dynamo's fake tensors (from
    ``torch.zeros(device=...)``, or from ``torch.tensor`` of a symbolic int) and the traced inputs;
    each call gives eager torch's values."""
    compiled = torch.compile(_fresh_tensors, backend="shardtensor")
    x = torch.arange(3.0)
    for count in (1, 2, 5):  # the second call recompiles with n symbolic
        expected = _fresh_tensors(x, count)
        torch.testing.assert_close(compiled(x.to(st.device()), count).cpu(), expected, rtol=0, atol=0)
    assert graph_breaks() == 0


# --- Hugging Face models with their default KV cache ----------------------------------------------
def _hf_model(name):
    transformers = pytest.importorskip("transformers")
    tiny = dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2))
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny, num_key_value_heads=1))
    if name == "mixtral":
        # the default experts: under torch.compile, float32 experts take transformers'
        # grouped_mm_fallback custom op (histc on int32 expert ids, as on any accelerator)
        moe = dict(num_local_experts=4, num_experts_per_tok=2)
        config = transformers.MixtralConfig(**tiny, **moe, num_key_value_heads=1)
        return transformers.MixtralForCausalLM(config)
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2)
    return transformers.T5ForConditionalGeneration(config)


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "mixtral"])
def test_hugging_face_inference_with_kv_cache(name):
    """The default path makes a DynamicCache, whose layers start as ``torch.tensor([], device=...)``
    inside the traced code: a real device tensor among the tracing ones."""
    torch.manual_seed(0)
    ref = _hf_model(name).eval()
    dev = copy.deepcopy(ref).to(st.device())
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    extra = {"decoder_input_ids": ids[:, :4]} if name == "t5" else {}
    with torch.no_grad():
        expected = ref(input_ids=ids, **extra)
        compiled = torch.compile(dev, backend="shardtensor")
        out = compiled(input_ids=ids.to(st.device()), **{k: v.to(st.device()) for k, v in extra.items()})
    assert out.past_key_values is not None and expected.past_key_values is not None
    torch.testing.assert_close(out.logits.cpu(), expected.logits, rtol=RTOL, atol=ATOL)
    if name in ("gpt2", "llama"):  # a decode step on the cache the compiled prefill filled
        step = ids[:, -1:]
        with torch.no_grad():
            expected = ref(input_ids=step, cache=expected.past_key_values)
            out = compiled(input_ids=step.to(st.device()), cache=out.past_key_values)
        torch.testing.assert_close(out.logits.cpu(), expected.logits, rtol=RTOL, atol=ATOL)


# --- graph breaks ----------------------------------------------------------------------------------
def _with_breaks(x, w):
    h = torch.tanh(x @ w)
    torch._dynamo.graph_break()
    s = h.sum().item()  # a value on the host: another break
    return F.gelu(h) * 2 + s


def test_graph_breaks_still_match():
    mesh = mesh_4x2()
    compiled = torch.compile(_with_breaks, backend="shardtensor")
    for seed in range(3):
        x, w = _x(seed, (8, 6)), _x(seed + 10, (6, 4))
        out = compiled(st.shard(x, mesh, ("data", None)), st.shard(w, mesh, (None, "model")))
        torch.testing.assert_close(out.cpu(), _with_breaks(x, w), rtol=RTOL, atol=ATOL)
    assert graph_breaks() >= 2
    assert graphs() >= 2


def _annotates(x, mesh):
    y = x * 2
    st.mark_sharding(y, mesh, (None, "d"))  # a graph break: it runs on the real tensor in between
    return y, y + 1


def test_mark_sharding_inside_is_a_graph_break():
    mesh = mesh_8()
    x = _x(0, (8, 16))
    y, z = torch.compile(_annotates, backend="shardtensor")(st.shard(x, mesh, ("d", None)), mesh)
    torch.testing.assert_close(z.cpu(), x * 2 + 1)
    assert tuple(y.partition_spec) == (None, "d")
    assert graph_breaks() == 1


# --- recompilation on a new sharding ---------------------------------------------------------------
def _f(x, w):
    return F.silu(x @ w).mean(0) + x.sum()


def test_new_input_sharding_recompiles():
    mesh = mesh_4x2()
    x, w = _x(0, (8, 6)), _x(1, (6, 4))
    ws = st.shard(w, mesh, (None, "model"))
    compiled = torch.compile(_f, backend="shardtensor")
    expected = _f(x, w)

    torch.testing.assert_close(compiled(st.shard(x, mesh, ("data", None)), ws).cpu(), expected)
    torch.testing.assert_close(compiled(st.shard(x, mesh, ("data", None)), ws).cpu(), expected)
    assert graphs() == 1 and n("DynamoGraph") == 1, "same sharding: no recompile"
    programs = n("UncachedCompile")

    out = compiled(st.shard(x, mesh, (None, "model")), ws)  # same shape, another sharding
    torch.testing.assert_close(out.cpu(), expected)
    assert graphs() == 2 and n("DynamoGraph") == 2, "Dynamo recompiled for the new sharding"
    assert n("UncachedCompile") > programs, "and XLA compiled a program for it"

    torch.testing.assert_close(compiled(st.shard(x, mesh, ("data", None)), ws).cpu(), expected)
    assert graphs() == 2, "the first sharding's graph is still cached"


# --- other backends --------------------------------------------------------------------------------
def test_aot_autograd_backends_are_refused_clearly():
    x = st.shard(_x(0, (8, 6)), mesh_8(), ("d", None))
    with pytest.raises(Exception, match="backend='shardtensor'"):
        torch.compile(lambda t: t * 2 + 1, backend="aot_eager")(x)


def test_frozen_graph_replays_follow_what_dynamo_guards():
    """A graph's frozen replays leave its inputs' checks to Dynamo's guards (requires_grad, and for a
    graph of fixed shapes: shapes, strides, dtypes, shardings). Whatever changes between calls, each
    result equals eager torch: another shape (Dynamo's graph with symbolic sizes, keyed by shape
    again), a parameter's requires_grad, a hook on an input, a transposed view of a square input."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    dev = copy.deepcopy(ref).to(st.device())
    compiled = torch.compile(dev, backend="shardtensor")

    def check(x):
        with torch.no_grad():
            torch.testing.assert_close(compiled(x.to(st.device())).cpu(), ref(x), rtol=RTOL, atol=ATOL)

    for step in range(4):
        check(_x(step, (8, 8)))
    assert n("CompileReplay") >= 2
    for step in range(4):  # other batch sizes: Dynamo's graph with symbolic sizes, replayed per shape
        check(_x(10 + step, (4 + 2 * (step % 2), 8)))
    check(_x(20, (8, 8)).t())  # a transposed view: values through the view
    with torch.no_grad():  # (a square view replays nothing of the plain input's program)
        square = _x(21, (8, 8))
        out = compiled(square.to(st.device()).t())
        torch.testing.assert_close(out.cpu(), ref(square.t()), rtol=RTOL, atol=ATOL)
    for p, q in zip(ref[0].parameters(), dev[0].parameters()):  # requires_grad: Dynamo recompiles
        p.requires_grad_(False)
        q.requires_grad_(False)
    for step in range(3):
        check(_x(30 + step, (8, 8)))
    replays = n("CompileReplay")
    dev[2].weight.register_hook(lambda g: g * 0)  # (no backward runs through an inference replay)
    with torch.no_grad():
        dev[2].weight.add_(1.0)  # the new value is read: the program's inputs are read each call
        ref[2].weight.add_(1.0)
    for step in range(3):
        check(_x(40 + step, (8, 8)))
    assert n("CompileReplay") > replays
