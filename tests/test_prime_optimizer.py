"""Issue 16 §2: ``st.prime_optimizer`` creates the optimizer state before the first step, exactly as
torch's first step would: the following steps equal eager torch's, and step 1 runs the program every
later step runs (one compile, counted by ``UncachedCompile``)."""

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from _training_helpers import (
    MLP,
    MLP_SPECS,
    assert_trained_alike,
    fresh_executable_cache,
    make_pair,
    mesh_8,
    mlp_batches,
    reset_state,
    shard_batches,
    shard_params,
    train,
)


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    yield
    reset_state()


def _adamw(params, capturable):
    # weight decay on: a zero-gradient step (PyTorch/XLA's priming) would shrink the parameters
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, capturable=capturable)


@pytest.mark.parametrize(("mode", "capturable"), [("compile", True), ("lazy", False)])
def test_primed_steps_equal_torch_and_compile_once(mode, capturable):
    mesh = mesh_8()
    batches = mlp_batches(3, torch.Generator().manual_seed(0))
    ref, dev = make_pair(MLP)
    shard_params(dev, mesh, MLP_SPECS)  # uneven shards: the fresh state is padded like its parameter
    ref_opt, dev_opt = _adamw(ref.parameters(), False), _adamw(dev.parameters(), capturable)
    before = {n: p.detach().cpu().clone() for n, p in dev.named_parameters()}
    assert st.prime_optimizer(dev_opt) is dev_opt
    for name, p in dev.named_parameters():  # the parameters and gradients are as they were
        assert p.grad is None
        torch.testing.assert_close(p.detach().cpu(), before[name], rtol=0, atol=0)
        state = dev_opt.state[p]
        assert float(state["step"]) == 0.0
        assert not state["exp_avg"].cpu().any() and not state["exp_avg_sq"].cpu().any()
    fresh_executable_cache()
    st.clear_counters()
    ref_losses = train(ref, ref_opt, batches, F.cross_entropy, "cpu")
    compiles: list = []
    dev_losses = train(dev, dev_opt, shard_batches(batches, mesh, ("d", None), ("d",)), F.cross_entropy, mode, compiles)
    assert_trained_alike(ref, dev, ref_losses, dev_losses)
    assert compiles == [1, 1, 1]  # step 1 compiled the program steps 2 and 3 reuse
    if mode == "compile":
        assert st.counter_value("CompileReplay") == 1  # traced twice alike, then replayed
    for p_ref, p_dev in zip(ref.parameters(), dev.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(dev_opt.state[p_dev][key].cpu(), ref_opt.state[p_ref][key])
        assert float(dev_opt.state[p_dev]["step"]) == 3.0


def test_existing_state_is_kept_and_unsupported_optimizers_raise():
    _, dev = make_pair(MLP)
    opt = torch.optim.Adam(dev.parameters(), lr=0.1)
    first, *_, frozen = dev.parameters()
    frozen.requires_grad_(False)
    st.prime_optimizer(opt)
    assert frozen not in opt.state  # it never gets a gradient: torch creates no state for it
    exp_avg = opt.state[first]["exp_avg"]
    st.prime_optimizer(opt)  # a second call finds every parameter's state: nothing changes
    assert opt.state[first]["exp_avg"] is exp_avg
    plain = torch.optim.SGD(dev.parameters(), lr=0.1)
    assert st.prime_optimizer(plain) is plain and not plain.state  # plain SGD keeps no state
    with pytest.raises(TypeError, match="SGD"):
        st.prime_optimizer(torch.optim.SGD(dev.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        st.prime_optimizer(dev)


# --- without st.prime_optimizer: the first step creates the state in a small program of its own ---
FIRST_STEP_OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),  # torch's default: capturable=False
    "Adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.05, amsgrad=True),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=0.05),
    "RMSprop-momentum": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),  # (its state is made by its constructor)
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=0.5),
}


@pytest.mark.parametrize("name", list(FIRST_STEP_OPTIMIZERS))
def test_a_compiled_first_step_compiles_the_steady_program(name):
    """Step 1 of an st.compile'd loop creates the optimizer's state, as torch's step does; the state
    is computed first, in a program of its own, so the step's program is the one step 2 replays: no
    compile after step 1, and the results are eager torch's."""
    mesh = mesh_8()
    batches = mlp_batches(4, torch.Generator().manual_seed(0))
    ref, dev = make_pair(MLP)
    shard_params(dev, mesh, MLP_SPECS)
    make = FIRST_STEP_OPTIMIZERS[name]
    ref_opt, dev_opt = make(ref.parameters()), make(dev.parameters())
    dev_batches = shard_batches(batches, mesh, ("d", None), ("d",))
    st.sync()
    fresh_executable_cache()
    st.clear_counters()
    ref_losses = train(ref, ref_opt, batches, F.cross_entropy, "cpu")
    compiles: list = []
    dev_losses = train(dev, dev_opt, dev_batches, F.cross_entropy, "compile", compiles)
    assert_trained_alike(ref, dev, ref_losses, dev_losses, rtol=1e-4, atol=1e-5)  # (float32 bias corrections)
    assert compiles[0] >= 1 and compiles == [compiles[0]] * 4, compiles  # nothing compiled after step 1
    assert st.counter_value("CompileFrozen") == 1
    assert dev_opt.param_groups[0].get("capturable", False) is False  # what the user set, as eager torch
    for p_ref, p_dev in zip(ref.parameters(), dev.parameters()):
        for key, want in ref_opt.state[p_ref].items():
            got = dev_opt.state[p_dev][key]
            assert got.shape == want.shape and got.dtype == want.dtype, key
            torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


def test_the_first_step_hooks_run_once_and_a_new_group_is_made_alone():
    """The optimizer's own step hooks run once per step (its state is made without them), and a
    group added later gets its state at its first step without a second update of the others."""
    mesh = mesh_8()
    batches = mlp_batches(4, torch.Generator().manual_seed(1))
    ref, dev = make_pair(MLP)
    shard_params(dev, mesh, MLP_SPECS)
    (ref_first, *ref_rest), (dev_first, *dev_rest) = list(ref.parameters()), list(dev.parameters())
    ref_opt, dev_opt = _adamw(ref_rest, False), _adamw(dev_rest, False)
    calls = []
    dev_opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    dev_opt.register_step_post_hook(lambda *a: calls.append("post"))
    dev_batches = shard_batches(batches, mesh, ("d", None), ("d",))
    ref_losses = train(ref, ref_opt, batches[:2], F.cross_entropy, "cpu")
    dev_losses = train(dev, dev_opt, dev_batches[:2], F.cross_entropy, "compile")
    ref_opt.add_param_group({"params": [ref_first], "lr": 0.02})
    dev_opt.add_param_group({"params": [dev_first], "lr": 0.02})
    ref_losses += train(ref, ref_opt, batches[2:], F.cross_entropy, "cpu")
    dev_losses += train(dev, dev_opt, dev_batches[2:], F.cross_entropy, "compile")
    assert_trained_alike(ref, dev, ref_losses, dev_losses, rtol=1e-4, atol=1e-5)
    assert calls == ["pre", "post"] * 4
