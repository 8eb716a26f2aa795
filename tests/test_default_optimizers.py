"""Issue 37: torch's default (non-capturable) optimizers inside ``st.compile`` count their steps on the
devices (``shardtensor/optim_steps.py``), so the trace freezes. What the user sees stays torch's
default: ``param_groups`` say ``capturable=False``, ``state_dict()`` holds CPU step counters that load
into a plain CPU optimizer and back, lazy steps after compiled ones equal eager torch, and a changed
step still re-traces."""

import io

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from _training_helpers import MLP, MLP_SPECS, make_pair, mesh_8, mlp_batches, reset_state, shard_params

TOL = dict(rtol=1e-4, atol=1e-5)


def n(name):
    return st.counter_value(name) or 0


def _step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _setup(make_opt=lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)):
    reset_state()
    mesh = mesh_8()
    ref, dev = make_pair(MLP)
    shard_params(dev, mesh, MLP_SPECS)
    ref_opt, dev_opt = make_opt(ref.parameters()), make_opt(dev.parameters())
    compiled = st.compile(lambda x, y: _step(dev, dev_opt, x, y))

    def both(x, y, run=compiled):
        got = run(st.shard(x, mesh, ("d", None)), st.shard(y, mesh, ("d",)))
        torch.testing.assert_close(got.cpu(), _step(ref, ref_opt, x, y), **TOL)

    return ref, dev, ref_opt, dev_opt, both


def _assert_same(ref, dev, ref_opt, dev_opt):
    for (name, p), q in zip(dev.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, **TOL, msg=lambda m, name=name: f"{name}: {m}")
        for k, v in ref_opt.state[q].items():
            got = dev_opt.state[p][k]
            torch.testing.assert_close(got.cpu(), v, **TOL, msg=lambda m, k=k, name=name: f"{name} {k}: {m}")


def _round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_state_dict_holds_host_counters_and_loads_into_a_cpu_optimizer_and_back():
    ref, dev, ref_opt, dev_opt, both = _setup()
    batches = mlp_batches(8, torch.Generator().manual_seed(3))
    replays = n("CompileReplay")
    for x, y in batches[:4]:
        both(x, y)
    assert n("CompileReplay") > replays, "the default AdamW step never froze"
    saved = dev_opt.state_dict()
    assert [g["capturable"] for g in saved["param_groups"]] == [False]
    for entries in saved["state"].values():  # as torch's default optimizer holds it
        assert type(entries["step"]) is torch.Tensor and entries["step"].device.type == "cpu"
        assert entries["step"].dtype == torch.float32 and entries["step"].item() == 4.0
    assert all(isinstance(s["step"], st.ShardedTensor) for s in dev_opt.state.values()), "the optimizer's own"

    # into a plain CPU optimizer: it continues exactly as the eager reference does
    cpu_model = MLP()
    cpu_model.load_state_dict({k: v.cpu() for k, v in dev.state_dict().items()})
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-2, weight_decay=0.1)
    cpu_opt.load_state_dict(_round_trip(saved))
    assert cpu_opt.param_groups[0]["capturable"] is False
    import copy

    ref_copy, ref_opt_copy = copy.deepcopy(ref), None
    ref_opt_copy = torch.optim.AdamW(ref_copy.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt_copy.load_state_dict(ref_opt.state_dict())
    for x, y in batches[4:6]:
        torch.testing.assert_close(_step(cpu_model, cpu_opt, x, y), _step(ref_copy, ref_opt_copy, x, y), **TOL)
    _assert_same(ref_copy, cpu_model, ref_opt_copy, cpu_opt)

    # and back: the CPU optimizer's state loads into the device one, which re-traces and freezes again
    dev_opt.load_state_dict(_round_trip(cpu_opt.state_dict()))
    ref_opt.load_state_dict(ref_opt_copy.state_dict())
    ref.load_state_dict(ref_copy.state_dict())
    dev.load_state_dict(cpu_model.state_dict())
    traces = n("CompileTrace")
    for x, y in batches[6:] + batches[:3]:
        both(x, y)
    assert n("CompileTrace") - traces <= 3, "the loaded optimizer's step never froze again"
    assert dev_opt.param_groups[0]["capturable"] is False
    _assert_same(ref, dev, ref_opt, dev_opt)


def test_lazy_steps_after_compiled_ones_equal_eager_torch():
    """Once the counters live on the devices, a lazy step takes torch's capturable path too (no step
    reads a counter back from the devices) and still equals the default optimizer."""
    ref, dev, ref_opt, dev_opt, both = _setup()
    batches = mlp_batches(6, torch.Generator().manual_seed(4))
    for x, y in batches[:3]:
        both(x, y)
    for x, y in batches[3:]:
        both(x, y, run=lambda x, y: _step(dev, dev_opt, x, y))
    assert dev_opt.param_groups[0]["capturable"] is False
    _assert_same(ref, dev, ref_opt, dev_opt)


def test_a_changed_step_re_traces_and_still_equals_eager_torch():
    """After freezing, turning on amsgrad changes the program: the call runs its Python again and
    compiles the new program; a new learning rate re-runs the Python (once, or twice when the old rate
    shared a program input with an equal scalar) and replays again."""
    ref, dev, ref_opt, dev_opt, both = _setup()
    batches = mlp_batches(10, torch.Generator().manual_seed(5))
    for x, y in batches[:3]:
        both(x, y)
    traces, compiles = n("CompileTrace"), n("UncachedCompile")
    for o in (ref_opt, dev_opt):
        o.param_groups[0]["amsgrad"] = True
        for s in o.state.values():
            s["max_exp_avg_sq"] = s["exp_avg_sq"].clone()
    for x, y in batches[3:6]:
        both(x, y)
    assert n("CompileTrace") > traces and n("UncachedCompile") > compiles
    for o in (ref_opt, dev_opt):
        o.param_groups[0]["lr"] = 5e-3
    traces = n("CompileTrace")
    for x, y in batches[6:]:
        replays = n("CompileReplay")
        both(x, y)
    assert n("CompileTrace") - traces <= 2 and n("CompileReplay") == replays + 1, "no replay after a new lr"
    _assert_same(ref, dev, ref_opt, dev_opt)


def test_a_step_that_raises_inside_compile_leaves_the_groups_as_they_were():
    ref, dev, ref_opt, dev_opt, both = _setup()
    x, y = mlp_batches(1, torch.Generator().manual_seed(6))[0]

    def refuse(optimizer, args, kwargs):
        raise RuntimeError("refused by the test's hook")

    handle = dev_opt.register_step_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="refused by the test's hook"):
        both(x, y)
    handle.remove()
    assert dev_opt.param_groups[0]["capturable"] is False
    reset_state()


def test_torch_takes_its_foreach_path_for_shardtensor_parameters():
    """As for DTensor, torch's default optimizers use their multi-tensor (foreach) path on
    shardtensor's device (one _foreach_ op per stage, not one op per parameter); CPU parameters keep
    torch's own choice, and a foreach AdamW step equals eager torch's."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    cpu = [torch.nn.Parameter(torch.randn(3))]
    assert _default_to_fused_or_foreach(cpu, False) == (False, False)
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    mine = torch.nn.Linear(4, 3)
    mine.load_state_dict(ref.state_dict())
    mine.to(st.device())
    assert _default_to_fused_or_foreach(list(mine.parameters()), False) == (False, True)
    x = torch.randn(5, 4)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (ref, mine)]
    for _ in range(3):
        for m, opt, inp in ((ref, opts[0], x), (mine, opts[1], x.to(st.device()))):
            m(inp).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(mine.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach().cpu(), b.detach())
