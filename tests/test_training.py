"""Issue 2 §6/§7: small models trained a few steps in lazy, eager and st.compile mode, with their
parameters sharded by hand over the meshes (8,), (4, 2), (2, 2, 2) and (1, 8) (uneven shards
included), compared with the same model trained in eager PyTorch on CPU: losses and parameters."""
import functools

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from _training_helpers import (
    CNN, CNN_SPECS, EXPLICIT_LM_SPECS, MLP, MLP_SPECS, SDPA_LM_SPECS, TinyLM, assert_sharding_kept,
    assert_trained_alike, cnn_batches, lm_batches, lm_loss, make_pair, mesh_1x8, mesh_2x2x2, mesh_4x2,
    mesh_8, mlp_batches, reset_state, run_both, shard_params,
)

MODES = ["lazy", "eager", "compile"]
STEPS = 3


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    yield
    reset_state()


def _gen(seed=1):
    return torch.Generator().manual_seed(seed)


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd_momentum_foreach_false": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    "sgd_momentum_foreach_true": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam_foreach_false": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "adam_foreach_true": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_foreach_false": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw_foreach_true": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
}


# --- each optimizer path, on the MLP (mesh (8,)), lazy mode -----------------------------------------
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_mlp_optimizers_lazy(opt_name):
    mesh = mesh_8()
    batches = mlp_batches(STEPS, _gen())
    ref, dev, rl, dl, ref_opt, dev_opt = run_both(MLP, MLP_SPECS, mesh, batches, OPTIMIZERS[opt_name], "lazy")
    assert_trained_alike(ref, dev, rl, dl)
    assert_sharding_kept(dev, mesh, MLP_SPECS)
    # optimizer state (momentum buffers / exp_avg / exp_avg_sq / step) matches too
    for p_ref, p_dev in zip(ref.parameters(), dev.parameters()):
        s_ref, s_dev = ref_opt.state[p_ref], dev_opt.state[p_dev]
        assert s_ref.keys() == s_dev.keys()
        for k in s_ref:
            got = s_dev[k]
            got = got.cpu() if isinstance(got, torch.Tensor) else torch.as_tensor(got)
            torch.testing.assert_close(got, torch.as_tensor(s_ref[k]), rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


# --- each model in each mode ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_mlp_sgd_momentum_mesh_8(mode):
    mesh = mesh_8()
    batches = mlp_batches(STEPS, _gen(2))
    ref, dev, rl, dl, *_ = run_both(MLP, MLP_SPECS, mesh, batches, OPTIMIZERS["sgd_momentum"], mode)
    assert_trained_alike(ref, dev, rl, dl)
    assert_sharding_kept(dev, mesh, MLP_SPECS)


@pytest.mark.parametrize("mode", MODES)
def test_sdpa_lm_adamw_mesh_4x2(mode):
    mesh = mesh_4x2()
    batches = lm_batches(STEPS, _gen(3))
    ref, dev, rl, dl, *_ = run_both(functools.partial(TinyLM, "sdpa"), SDPA_LM_SPECS, mesh, batches,
                                    OPTIMIZERS["adamw"], mode, loss_fn=lm_loss,
                                    x_spec=("data", None), y_spec=("data", None))
    assert_trained_alike(ref, dev, rl, dl)
    assert_sharding_kept(dev, mesh, SDPA_LM_SPECS)


@pytest.mark.parametrize("mode", MODES)
def test_explicit_attention_lm_adam_mesh_2x2x2(mode):
    mesh = mesh_2x2x2()
    batches = lm_batches(STEPS, _gen(4))
    ref, dev, rl, dl, *_ = run_both(functools.partial(TinyLM, "explicit"), EXPLICIT_LM_SPECS, mesh, batches,
                                    OPTIMIZERS["adam_foreach_false"], mode, loss_fn=lm_loss,
                                    x_spec=(("a", "b"), None), y_spec=(("a", "b"), None))
    assert_trained_alike(ref, dev, rl, dl)
    assert_sharding_kept(dev, mesh, EXPLICIT_LM_SPECS)


@pytest.mark.parametrize("mode", MODES)
def test_cnn_batchnorm_sgd_mesh_1x8(mode):
    mesh = mesh_1x8()
    batches = cnn_batches(STEPS, _gen(5))
    ref, dev, rl, dl, *_ = run_both(CNN, CNN_SPECS, mesh, batches, OPTIMIZERS["sgd_momentum_foreach_false"],
                                    mode, x_spec=("m", None, None, None), y_spec=("m",))
    # state_dict includes BatchNorm running_mean / running_var / num_batches_tracked
    assert_trained_alike(ref, dev, rl, dl)
    assert_sharding_kept(dev, mesh, CNN_SPECS)
    # eval mode uses the running statistics
    ref.eval()
    dev.eval()
    x = batches[0][0]
    torch.testing.assert_close(dev(st.shard(x, mesh, ("m", None, None, None))).cpu(), ref(x).detach(),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["lazy", "compile"])
def test_cnn_adam_default_mesh_1x8(mode):
    mesh = mesh_1x8()
    batches = cnn_batches(STEPS, _gen(6))
    ref, dev, rl, dl, *_ = run_both(CNN, CNN_SPECS, mesh, batches, OPTIMIZERS["adam"], mode,
                                    x_spec=("m", None, None, None), y_spec=("m",))
    assert_trained_alike(ref, dev, rl, dl)


# --- gradients of one backward, per model (isolates forward/backward from the optimizer) -----------
MODELS = {
    "mlp": (MLP, MLP_SPECS, mesh_8, lambda g: mlp_batches(1, g)[0], F.cross_entropy, ("d", None), ("d",)),
    "sdpa_lm": (functools.partial(TinyLM, "sdpa"), SDPA_LM_SPECS, mesh_4x2, lambda g: lm_batches(1, g)[0],
                lm_loss, ("data", None), ("data", None)),
    "explicit_lm": (functools.partial(TinyLM, "explicit"), EXPLICIT_LM_SPECS, mesh_2x2x2,
                    lambda g: lm_batches(1, g)[0], lm_loss, ("a", None), (None, "b")),
    "cnn": (CNN, CNN_SPECS, mesh_1x8, lambda g: cnn_batches(1, g)[0], F.cross_entropy,
            (None, "m", None, None), ("m",)),
}


@pytest.mark.parametrize("mode", ["lazy", "eager"])
@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_match_torch(name, mode):
    make, specs, make_mesh, data, loss_fn, x_spec, y_spec = MODELS[name]
    mesh = make_mesh()
    ref, dev = make_pair(make)
    shard_params(dev, mesh, specs)
    x, y = data(_gen(7))
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    with st.eager_mode(mode == "eager"):
        loss = loss_fn(dev(st.shard(x, mesh, x_spec)), st.shard(y, mesh, y_spec))
        loss.backward()
    torch.testing.assert_close(loss.detach().cpu(), ref_loss.detach(), rtol=1e-4, atol=1e-5)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for n, p in dev.named_parameters():
        assert p.grad is not None, n
        assert isinstance(p.grad, st.ShardedTensor), n
        torch.testing.assert_close(p.grad.cpu(), ref_grads[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
