"""Issue 2 §6/§7: small models trained a few steps in lazy, eager and st.compile mode, with their
parameters sharded by hand over the meshes (8,), (4, 2), (2, 2, 2) and (1, 8) (uneven shards
included), compared with the same model trained in eager PyTorch on CPU: losses, parameters,
buffers and optimizer state.

Models (see _training_helpers.py): an MLP (Linear, LayerNorm, GELU, SiLU, dropout p=0), a tiny LM
(Embedding, RMSNorm, causal F.scaled_dot_product_attention, explicit softmax attention, LayerNorm,
cross-entropy) and a CNN (Conv2d, BatchNorm2d, max and avg pooling). Dropout numerics use p=0 here;
its randomness is tested in test_random.py.
"""

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from _training_helpers import (
    CNN,
    CNN_SPECS,
    MLP,
    MLP_SPECS,
    LM_SPECS_2x2x2,
    LM_SPECS_4x2,
    TinyLM,
    assert_sharding_kept,
    assert_trained_alike,
    cnn_batches,
    fresh_executable_cache,
    lm_batches,
    lm_loss,
    make_pair,
    mesh_1x8,
    mesh_2x2x2,
    mesh_4x2,
    mesh_8,
    mlp_batches,
    reset_state,
    run_both,
    shard_batches,
    shard_params,
)

MODES = ["lazy", "eager", "compile"]
STEPS = 3  # step 1 creates the optimizer state, step 2 uses it, step 3 reuses step 2's program


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    yield
    reset_state()


def _gen(seed=1):
    return torch.Generator().manual_seed(seed)


# Adam/AdamW use lr=1e-3: an Adam update is lr * m / sqrt(v), so float32 rounding noise in a tiny
# gradient can move a parameter by a fraction of lr; with lr=1e-3 that stays inside atol=1e-5-ish
# tolerances while a wrong update (wrong bias correction, stale state) is still 100x larger.
def sgd(ps, **kw):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9, **kw)


def adam(ps, **kw):
    return torch.optim.Adam(ps, lr=1e-3, **kw)


def adamw(ps, **kw):
    return torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, **kw)


def _assert_optimizer_state_alike(ref_opt, dev_opt, ref_params, dev_params):
    for (name, p_ref), p_dev in zip(ref_params, dev_params):
        s_ref, s_dev = ref_opt.state[p_ref], dev_opt.state[p_dev]
        assert s_ref.keys() == s_dev.keys(), name
        for k in s_ref:
            got = s_dev[k]
            got = got.cpu() if isinstance(got, torch.Tensor) else torch.as_tensor(got)
            torch.testing.assert_close(
                got, torch.as_tensor(s_ref[k]), rtol=1e-4, atol=1e-5, msg=lambda m, name=name, k=k: f"{name} {k}: {m}"
            )


def _assert_no_compile_after_warmup(mode, compiles):
    """Lazy and compile mode: step 1 (optimizer state created) and step 2 may compile; step 3 is the
    same program again and must reuse it (eager compiles per op and is not checked). The tests that
    use this start from fresh_executable_cache()."""
    if mode in ("lazy", "compile"):
        assert compiles[-1] == compiles[1], f"UncachedCompile after each step: {compiles}"


# --- the optimizers' code paths: SGD(momentum) on fc1/ln, Adam on fc2, AdamW on head ---------------
@pytest.mark.parametrize("foreach", [None, False, True], ids=["default", "foreach_false", "foreach_true"])
def test_optimizers_sgd_adam_adamw(foreach):
    """One MLP, three optimizers over disjoint parameter groups, all with the same ``foreach``
    (None = torch's default choice for this device), trained in lazy mode on mesh (8,)."""
    mesh = mesh_8()
    ref, dev = make_pair(MLP)
    shard_params(dev, mesh, MLP_SPECS)

    def optimizers(model):
        groups = {"sgd": [], "adam": [], "adamw": []}
        for name, p in model.named_parameters():
            key = "sgd" if name.startswith(("fc1", "ln")) else "adam" if name.startswith("fc2") else "adamw"
            groups[key].append((name, p))
        return groups, [
            sgd([p for _, p in groups["sgd"]], foreach=foreach),
            adam([p for _, p in groups["adam"]], foreach=foreach),
            adamw([p for _, p in groups["adamw"]], foreach=foreach),
        ]

    ref_groups, ref_opts = optimizers(ref)
    dev_groups, dev_opts = optimizers(dev)
    batches = mlp_batches(STEPS, _gen())
    dev_batches = shard_batches(batches, mesh, ("d", None), ("d",))
    ref_losses, dev_losses = [], []
    for (x, y), (xd, yd) in zip(batches, dev_batches):
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()
        ref_losses.append(loss.item())
        with st.step():
            dloss = F.cross_entropy(dev(xd), yd)
            dloss.backward()
            for o in dev_opts:
                o.step()
                o.zero_grad()
        dev_losses.append(dloss.item())
    assert_trained_alike(ref, dev, ref_losses, dev_losses)
    assert_sharding_kept(dev, mesh, MLP_SPECS)
    for key, ro, do in zip(("sgd", "adam", "adamw"), ref_opts, dev_opts):
        _assert_optimizer_state_alike(ro, do, ref_groups[key], [p for _, p in dev_groups[key]])


# --- each model in each mode ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_mlp_sgd_momentum_mesh_8(mode):
    mesh = mesh_8()
    batches = mlp_batches(STEPS, _gen(2))
    compiles = []
    fresh_executable_cache()
    ref, dev, rl, dl, ref_opt, dev_opt = run_both(
        MLP, MLP_SPECS, mesh, batches, sgd, mode, x_spec=("d", None), y_spec=("d",), compiles=compiles
    )
    assert_trained_alike(ref, dev, rl, dl)
    _assert_no_compile_after_warmup(mode, compiles)
    assert_sharding_kept(dev, mesh, MLP_SPECS)
    _assert_optimizer_state_alike(ref_opt, dev_opt, list(ref.named_parameters()), list(dev.parameters()))


@pytest.mark.parametrize("mode", ["lazy", "compile"])
def test_lm_adamw_mesh_4x2(mode):
    mesh = mesh_4x2()
    batches = lm_batches(STEPS, _gen(3))
    compiles = []
    fresh_executable_cache()
    ref, dev, rl, dl, ref_opt, dev_opt = run_both(
        TinyLM,
        LM_SPECS_4x2,
        mesh,
        batches,
        adamw,
        mode,
        loss_fn=lm_loss,
        x_spec=("data", None),
        y_spec=("data", None),
        compiles=compiles,
    )
    assert_trained_alike(ref, dev, rl, dl)
    _assert_no_compile_after_warmup(mode, compiles)
    assert_sharding_kept(dev, mesh, LM_SPECS_4x2)
    _assert_optimizer_state_alike(ref_opt, dev_opt, list(ref.named_parameters()), list(dev.parameters()))
    # a no_grad eval forward, with the batch sharded another way, matches torch too
    idx = batches[0][0]
    ref.eval()
    dev.eval()
    with torch.no_grad():
        out = dev(st.shard(idx, mesh, (None, "model")))
        assert out.grad_fn is None
        torch.testing.assert_close(out.cpu(), ref(idx), rtol=1e-4, atol=1e-5)


def test_lm_sgd_mesh_4x2_eager():
    """Eager mode runs every op as its own program (compiled once per op signature), so this uses
    plain SGD — a handful of optimizer ops — rather than AdamW's dozens per parameter shape."""
    mesh = mesh_4x2()
    batches = lm_batches(STEPS, _gen(3))
    ref, dev, rl, dl, *_ = run_both(
        TinyLM,
        LM_SPECS_4x2,
        mesh,
        batches,
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        "eager",
        loss_fn=lm_loss,
        x_spec=("data", None),
        y_spec=("data", None),
    )
    assert_trained_alike(ref, dev, rl, dl)
    assert_sharding_kept(dev, mesh, LM_SPECS_4x2)


def test_lm_adam_foreach_false_mesh_2x2x2():
    mesh = mesh_2x2x2()
    batches = lm_batches(STEPS, _gen(4))
    compiles = []
    fresh_executable_cache()
    ref, dev, rl, dl, ref_opt, dev_opt = run_both(
        TinyLM,
        LM_SPECS_2x2x2,
        mesh,
        batches,
        lambda ps: adam(ps, foreach=False),
        "lazy",
        loss_fn=lm_loss,
        x_spec=(("a", "b"), None),
        y_spec=(("a", "b"), None),
        compiles=compiles,
    )
    assert_trained_alike(ref, dev, rl, dl)
    _assert_no_compile_after_warmup("lazy", compiles)
    assert_sharding_kept(dev, mesh, LM_SPECS_2x2x2)
    _assert_optimizer_state_alike(ref_opt, dev_opt, list(ref.named_parameters()), list(dev.parameters()))


@pytest.mark.parametrize("mode", MODES)
def test_cnn_batchnorm_sgd_mesh_1x8(mode):
    mesh = mesh_1x8()
    batches = cnn_batches(STEPS, _gen(5))
    compiles = []
    fresh_executable_cache()
    ref, dev, rl, dl, *_ = run_both(
        CNN,
        CNN_SPECS,
        mesh,
        batches,
        lambda ps: sgd(ps, foreach=False),
        mode,
        x_spec=("m", None, None, None),
        y_spec=("m",),
        compiles=compiles,
    )
    # state_dict includes BatchNorm's running_mean / running_var / num_batches_tracked
    assert_trained_alike(ref, dev, rl, dl)
    _assert_no_compile_after_warmup(mode, compiles)
    assert_sharding_kept(dev, mesh, CNN_SPECS)
    # eval mode normalises with the running statistics
    ref.eval()
    dev.eval()
    x = batches[0][0]
    torch.testing.assert_close(
        dev(st.shard(x, mesh, ("m", None, None, None))).detach().cpu(), ref(x).detach(), rtol=1e-4, atol=1e-5
    )
