"""State dicts of sharded modules and optimizers: loading keeps each tensor's sharding (no replicated
copy), a pickled module keeps its sharded ``nn.Parameter``s, and a load that fails changes nothing."""

import copy
import functools
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardtensor as st
from shardtensor.fsdp import FSDPv2, transformer_auto_wrap_policy

MESH = st.Mesh(range(8), (8,), ("fsdp",))
ROOT = Path(__file__).resolve().parent.parent


class Tiny(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32) if norm else nn.Identity()  # buffers
        self.b = nn.Linear(32, 8)

    def forward(self, x):
        return self.b(self.norm(torch.relu(self.a(x))))


def tiny(seed=0, norm=False):
    torch.manual_seed(seed)
    return Tiny(norm)


def round_trip(obj, **load_kwargs):
    """``obj`` written with ``torch.save`` and read back with ``torch.load`` (CPU tensors)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, **load_kwargs)


def bytes_per_device(t):
    return [s.data.numel() * s.data.element_size() for s in t.local_shards]


def train_step(model, opt, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


@pytest.mark.parametrize("source", ["sharded", "torch.load"])
def test_adamw_state_loads_with_its_parameters_sharding_and_the_next_step_matches(source):
    x = torch.randn(8, 16)
    eager = tiny()
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for _ in range(2):
        train_step(eager, eager_opt, x)

    model = FSDPv2(tiny(), mesh=MESH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    xs = x.to(st.device())
    train_step(model, opt, xs)
    saved = opt.state_dict()
    layout_before = {i: bytes_per_device(opt.state[p]["exp_avg_sq"]) for i, p in enumerate(model.parameters())}
    values_before = {i: {k: v.cpu() for k, v in s.items()} for i, s in saved["state"].items()}
    if source == "torch.load":
        saved = round_trip(saved)
        assert not isinstance(saved["state"][0]["exp_avg"], st.ShardedTensor)
    module_state = round_trip(model.module.state_dict())

    fresh = FSDPv2(tiny(seed=1), mesh=MESH)
    fresh.module.load_state_dict(module_state)
    fresh_opt = st.keep_optimizer_state_sharded(torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    fresh_opt.load_state_dict(saved)
    for i, p in enumerate(fresh.parameters()):
        state = fresh_opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].sharding_spec == p.sharding_spec
            assert bytes_per_device(state[key]) == layout_before[i]  # one shard per device, not a replica
            assert torch.equal(state[key].cpu(), values_before[i][key])
        assert torch.equal(state["step"].cpu(), values_before[i]["step"])

    train_step(fresh, fresh_opt, xs)
    for p, ref in zip(fresh.parameters(), eager.parameters()):
        torch.testing.assert_close(p.cpu(), ref.detach(), rtol=1e-5, atol=1e-6)


def test_an_optimizer_state_dict_for_other_parameters_gives_torchs_error_and_loads_nothing():
    model = FSDPv2(tiny(), mesh=MESH)
    opt = torch.optim.AdamW(model.parameters())
    opt.register_load_state_dict_pre_hook(st.place_optimizer_state)
    other = torch.optim.AdamW(list(tiny().parameters())[:3])  # 3 parameters, not 4
    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
        opt.load_state_dict(round_trip(other.state_dict()))
    assert len(opt.state) == 0


def test_torch_save_of_a_whole_fsdp_model_keeps_its_sharded_parameters():
    model = FSDPv2(tiny(), mesh=MESH)
    model.module.a.weight.requires_grad_(False)
    loaded = round_trip(model, weights_only=False)
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert isinstance(q, nn.Parameter) and isinstance(q, st.ShardedTensor), name
        assert (q.partition_spec, q.requires_grad) == (p.partition_spec, p.requires_grad), name
        assert bytes_per_device(q) == bytes_per_device(p), name
        assert torch.equal(q.cpu(), p.cpu()), name
    x = torch.randn(8, 16).to(st.device())
    torch.testing.assert_close(loaded(x).cpu(), model(x).cpu(), rtol=0, atol=0)


def test_a_pickled_sharded_parameter_is_a_cpu_parameter_and_a_state_dict_plain_tensors():
    weight = nn.Parameter(st.shard(torch.randn(16, 4), MESH, ("fsdp", None)), requires_grad=False)
    back = round_trip({"w": weight}, weights_only=True)["w"]  # loadable without shardtensor
    assert type(back) is nn.Parameter and not back.requires_grad and torch.equal(back, weight.cpu())
    plain = round_trip(FSDPv2(tiny(), mesh=MESH).module.state_dict(), weights_only=True)
    assert all(type(v) is torch.Tensor for v in plain.values())


_LOAD_WITH_4_DEVICES = """
    import io, sys, warnings, torch, shardtensor as st
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = torch.load(io.BytesIO(sys.stdin.buffer.read()), weights_only=False)
    params = list(model.parameters())
    print(st.global_runtime_device_count(), all(type(p) is torch.nn.Parameter for p in params),
          {p.device.type for p in params}, float(sum(p.detach().sum() for p in params)))
    print(*[str(w.message) for w in caught])
"""


def test_a_pickled_fsdp_model_without_its_mesh_loads_cpu_parameters_with_a_warning():
    model = FSDPv2(nn.Sequential(nn.Linear(16, 8)), mesh=MESH)
    data = io.BytesIO()
    torch.save(model, data)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_"))}
    env.update(SHARDTENSOR_CPU_DEVICES="4", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_LOAD_WITH_4_DEVICES)],
        input=data.getvalue(),
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr.decode()
    counts, warning = result.stdout.decode().splitlines()
    total = float(sum(p.detach().sum() for p in model.parameters()))
    assert counts.split()[:3] == ["4", "True", "{'cpu'}"]
    assert float(counts.split()[3]) == pytest.approx(total, rel=1e-6)
    assert "of 8 devices" in warning and "loaded as CPU nn.Parameters" in warning


@pytest.mark.parametrize("assign", [False, True])
def test_module_load_state_dict_from_cpu_keeps_each_parameters_sharding(assign):
    source = tiny(seed=1, norm=True).state_dict()
    model = FSDPv2(tiny(norm=True), mesh=MESH)
    specs = {name: p.partition_spec for name, p in model.module.named_parameters()}
    model.module.load_state_dict(source, assign=assign)
    for name, p in model.module.named_parameters():
        assert isinstance(p, nn.Parameter) and p.requires_grad
        assert p.partition_spec == specs[name], name
        assert bytes_per_device(p) == [p.numel() * 4 // 8] * 8, name
        assert torch.equal(p.cpu(), source[name]), name

    for name, buffer in model.module.named_buffers():
        assert isinstance(buffer, st.ShardedTensor) and torch.equal(buffer.cpu(), source[name]), name

    partial = {k: v + 1 for k, v in source.items() if k != "b.bias"}
    result = model.module.load_state_dict(partial, strict=False, assign=assign)
    assert result.missing_keys == ["b.bias"]
    for name, p in model.module.named_parameters():
        assert p.partition_spec == specs[name], name
        assert torch.equal(p.cpu(), partial.get(name, source[name])), name


@pytest.mark.parametrize("assign", [False, True])
def test_a_shape_mismatch_gives_torchs_error_and_the_module_is_unchanged(assign):
    model = FSDPv2(tiny(), mesh=MESH)
    before = {k: v.cpu() for k, v in model.module.state_dict().items()}
    bad = {k: v + 1 for k, v in tiny(seed=1).state_dict().items()}
    bad["b.weight"] = torch.zeros(8, 31)
    with pytest.raises(RuntimeError, match=r"size mismatch for b.weight: copying a param with shape"):
        model.module.load_state_dict(bad, assign=assign)
    for name, p in model.module.named_parameters():
        assert torch.equal(p.cpu(), before[name]), name
        assert p.partition_spec is not None, name


def test_a_dtype_mismatch_is_cast_as_torch_does_and_keeps_the_sharding():
    source = {k: v.double() for k, v in tiny(seed=1).state_dict().items()}
    model = FSDPv2(tiny(), mesh=MESH)
    reference = copy.deepcopy(tiny())
    reference.load_state_dict(source)
    model.module.load_state_dict(source)
    for (name, p), ref in zip(model.module.named_parameters(), reference.parameters()):
        assert p.dtype == ref.dtype == torch.float32 and p.partition_spec is not None, name
        assert torch.equal(p.cpu(), ref.detach()), name


def _adamw_after_one_step(seed=0):
    model = FSDPv2(tiny(seed), mesh=MESH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, torch.randn(8, 16, generator=torch.Generator().manual_seed(2)).to(st.device()))
    return model, opt


def _state_layout_and_values(model, opt):
    return {
        (i, key): (bytes_per_device(opt.state[p][key]), opt.state[p][key].cpu())
        for i, p in enumerate(model.parameters())
        for key in ("exp_avg", "exp_avg_sq")
    }


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP without a process group
@pytest.mark.parametrize("path", ["torch.load", "dcp.load+set_state_dict", "cpu+set_state_dict"])
def test_adamw_state_keeps_each_devices_bytes_through_a_save_and_load(path, tmp_path):
    """Issue 14 §4: bytes per device of the AdamW state after loading == before saving, by
    ``opt.load_state_dict(torch.load(...))`` (with ``keep_optimizer_state_sharded``), by DCP's
    ``dcp.load`` + ``set_state_dict`` (no hook needed: DCP loads into the sharded state in place), and by
    ``set_state_dict`` of CPU tensors (with the hook)."""
    model, opt = _adamw_after_one_step()
    before = _state_layout_and_values(model, opt)
    fresh, fresh_opt = FSDPv2(tiny(seed=1), mesh=MESH), None
    if path == "torch.load":
        fresh.load_state_dict(round_trip(model.state_dict()))
        fresh_opt = st.keep_optimizer_state_sharded(torch.optim.AdamW(fresh.parameters(), lr=1e-2))
        fresh_opt.load_state_dict(round_trip(opt.state_dict()))
    elif path == "dcp.load+set_state_dict":
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path)
        set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        model_sd, optim_sd = round_trip(get_state_dict(model, opt))
        fresh_opt = st.keep_optimizer_state_sharded(torch.optim.AdamW(fresh.parameters(), lr=1e-2))
        set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    after = _state_layout_and_values(fresh, fresh_opt)
    for key, (layout, value) in before.items():
        assert after[key][0] == layout, key  # one shard per device, not a replica
        assert torch.equal(after[key][1], value), key
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert p.sharding_spec == q.sharding_spec and torch.equal(p.cpu(), q.cpu())


def test_keep_optimizer_state_sharded_registers_once_and_reaches_a_wrapped_optimizer():
    model, opt = _adamw_after_one_step()
    saved = round_trip(opt.state_dict())

    class Wrapper:  # as accelerate's AcceleratedOptimizer: loads through the optimizer it holds
        def __init__(self, optimizer):
            self.optimizer = optimizer

    inner = torch.optim.AdamW(FSDPv2(tiny(seed=1), mesh=MESH).parameters(), lr=1e-2)
    wrapper = Wrapper(inner)
    assert st.keep_optimizer_state_sharded(wrapper) is wrapper
    calls = []
    inner.register_load_state_dict_pre_hook(lambda o, sd: calls.append(sd["state"][0]["exp_avg"]))
    st.keep_optimizer_state_sharded(inner)  # a second time: no second hook
    inner.load_state_dict(saved)
    assert len(calls) == 1 and isinstance(calls[0], st.ShardedTensor)  # placed by the one earlier hook
    with pytest.raises(TypeError, match="expects a torch.optim.Optimizer"):
        st.keep_optimizer_state_sharded(model)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)

    def forward(self, x):
        return self.norm(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        return self.out(self.block(x))


def net(seed):
    torch.manual_seed(seed)
    return Net()


def wrapped_net(seed=0):
    """FSDPv2 over the whole Net and over its Block: real names carry ``_orig_module.`` twice."""
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    return FSDPv2(net(seed), mesh=MESH, auto_wrap_policy=policy)


def test_an_fsdp_state_dict_has_the_plain_modules_keys_both_ways():
    """``Trainer.save_model``/``save_pretrained``/``accelerator.save_state`` write ``state_dict()``: an
    FSDPv2 model's has the plain model's keys, in its order, and each loads into the other."""
    model, plain = wrapped_net(), net(1)
    assert "_orig_module.block._orig_module.fc.weight" in dict(model.named_parameters())  # names keep it
    state = model.state_dict()
    assert list(state) == list(plain.state_dict())
    plain.load_state_dict(state)  # strict: the wrapped model's checkpoint loads into the plain one
    for key, value in plain.state_dict().items():
        assert torch.equal(value, state[key].cpu()), key
    specs = {name: p.partition_spec for name, p in model.named_parameters()}
    for assign in (False, True):
        source = {k: v + 1 if v.is_floating_point() else v for k, v in net(2 + assign).state_dict().items()}
        assert model.load_state_dict(source, assign=assign) is not None  # strict: every key matched
        for (name, p), expected in zip(model.named_parameters(), net(2 + assign).parameters()):
            assert p.partition_spec == specs[name] and isinstance(p, nn.Parameter), name
            assert torch.equal(p.cpu(), expected.detach() + 1), name
    # an old checkpoint with FSDPv2's real names still loads
    old = {name: t.detach().cpu() * 3 for name, t in [*model.named_parameters(), *model.named_buffers()]}
    model.load_state_dict(old)
    assert torch.equal(model.state_dict()["block.fc.weight"].cpu(), old["_orig_module.block._orig_module.fc.weight"])
    # keys are reported as the state dict names them
    partial = {k: v for k, v in plain.state_dict().items() if k != "block.fc.bias"}
    assert model.load_state_dict(partial, strict=False).missing_keys == ["block.fc.bias"]
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "block.fc.bias"'):
        model.load_state_dict(partial)


def test_a_shape_mismatch_inside_a_nested_wrapper_changes_nothing():
    model = wrapped_net()
    before = {k: v.cpu() for k, v in model.state_dict().items()}
    bad = {k: v + 1 if v.is_floating_point() else v for k, v in net(1).state_dict().items()}
    bad["block.fc.weight"] = torch.zeros(32, 15)
    with pytest.raises(RuntimeError, match="size mismatch for"):
        model.load_state_dict(bad)
    for key, value in model.state_dict().items():
        assert torch.equal(value.cpu(), before[key]), key
