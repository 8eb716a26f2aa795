"""Issue 48 §3: every ``torch.optim`` optimizer with each of its options under ``st.compile``: frozen
and equal to eager torch on the CPU, or running its Python each call for a reason it says.

The freezable configurations are stepped together, each over a layer of its own, by one compiled
training step (one program: a compile per configuration would take minutes): the step must replay
from its third call, and every parameter and state tensor equal eager torch's after each call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.testing import assert_close

import shardtensor as st
from _training_helpers import reset_state

optim = torch.optim


def _configs():
    """(name, optimizer class, keyword arguments) of the configurations that freeze. (With
    ``capturable=False``, torch's default, a compiled step takes torch's capturable path, as with
    ``capturable=True``: ``optim_steps``; the latter is stepped for Adam and AdamW.)"""
    out = []
    for foreach in (None, False):  # (torch's foreach and single-tensor implementations)
        tag = f"foreach={foreach}"
        for extra in ({}, {"amsgrad": True}, {"maximize": True}, {"weight_decay": 0.1}):
            for cls in (optim.Adam, optim.AdamW):
                out.append((f"{cls.__name__}({tag},{extra})", cls, dict(foreach=foreach, **extra)))
        base = dict(foreach=foreach)
        out += [
            (f"NAdam({tag})", optim.NAdam, base),
            (f"NAdam({tag},decoupled)", optim.NAdam, dict(base, decoupled_weight_decay=True, weight_decay=0.1)),
            (f"RAdam({tag})", optim.RAdam, base),
            (f"RAdam({tag},decoupled)", optim.RAdam, dict(base, decoupled_weight_decay=True, weight_decay=0.1)),
            (f"Adamax({tag})", optim.Adamax, dict(base, maximize=True)),
            (f"ASGD({tag})", optim.ASGD, base),
            (f"RMSprop({tag})", optim.RMSprop, base),
            (f"RMSprop({tag},centered)", optim.RMSprop, dict(base, centered=True, momentum=0.9, maximize=True)),
            (f"Adadelta({tag})", optim.Adadelta, dict(base, weight_decay=0.1)),
            (f"Rprop({tag})", optim.Rprop, dict(base, maximize=True)),
            (f"SGD({tag})", optim.SGD, base),
            (f"SGD({tag},nesterov)", optim.SGD, dict(base, momentum=0.9, nesterov=True)),
            (
                f"SGD({tag},dampening)",
                optim.SGD,
                dict(base, momentum=0.9, dampening=0.1, weight_decay=0.1, maximize=True),
            ),
        ]
    out += [
        ("Adam(capturable)", optim.Adam, dict(capturable=True, amsgrad=True)),
        ("AdamW(capturable,foreach=False)", optim.AdamW, dict(capturable=True, foreach=False, weight_decay=0.1)),
        ("Adam(fused)", optim.Adam, dict(fused=True, amsgrad=True)),
        ("AdamW(fused)", optim.AdamW, dict(fused=True, weight_decay=0.1)),
        ("SGD(fused)", optim.SGD, dict(fused=True, momentum=0.9)),
        ("Adagrad(fused)", optim.Adagrad, dict(fused=True, lr_decay=0.01, weight_decay=0.1)),
        ("Adagrad", optim.Adagrad, dict(lr_decay=0.01, weight_decay=0.1, maximize=True)),  # (fused in a trace)
        ("Adagrad(foreach=False)", optim.Adagrad, dict(foreach=False, initial_accumulator_value=0.1)),
    ]
    return out


def _cpu_kwargs(kwargs):
    # capturable=True is refused for CPU parameters; the default path is the same math
    return {k: (False if k == "capturable" else v) for k, v in kwargs.items()}


def _step(layers, optimizers):
    def step(x, y):
        loss = sum(((layer(x) - y) ** 2).mean() for layer in layers)
        loss.backward()
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad()
        return loss.detach()

    return step


def _world(configs, device):
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(4, 3) for _ in configs).to(device)
    cpu = device == "cpu"
    optimizers = [
        cls(layer.parameters(), lr=0.01, **(_cpu_kwargs(kw) if cpu else kw))
        for layer, (_, cls, kw) in zip(layers, configs)
    ]
    return layers, optimizers


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def test_every_optimizer_freezes_and_equals_eager():
    reset_state()
    configs = _configs()
    hook = register_optimizer_step_pre_hook(lambda opt, args, kwargs: None)  # (a user's global hook too)
    try:
        ref_layers, ref_opts = _world(configs, "cpu")
        layers, opts = _world(configs, st.device())
        ref_step, step = _step(ref_layers, ref_opts), st.compile(_step(layers, opts))
        replayed = []
        for i in range(4):
            x, y = _batch(i)
            before = st.counter_value("CompileReplay") or 0
            got = step(x.to(st.device()), y.to(st.device()))
            replayed.append((st.counter_value("CompileReplay") or 0) > before)
            assert_close(got.cpu(), ref_step(x, y), rtol=1e-4, atol=1e-5)  # (every layer's loss summed)
        for (name, _, _), ref, dev, ro, do in zip(configs, ref_layers, layers, ref_opts, opts):
            for p_ref, p in zip(ref.parameters(), dev.parameters()):
                assert_close(p.cpu(), p_ref, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
                for key, value in ro.state[p_ref].items():
                    assert_close(
                        torch.as_tensor(do.state[p][key]).cpu().to(torch.as_tensor(value).dtype),
                        torch.as_tensor(value),
                        rtol=1e-4,
                        atol=1e-5,
                        msg=lambda m, n=name, k=key: f"{n} state {k}: {m}",
                    )
        assert replayed[2:] == [True, True], f"not frozen by its third call: {replayed}"
    finally:
        hook.remove()


def test_an_optimizer_counting_on_the_host_runs_its_python_and_says_why(monkeypatch, capsys):
    """torch's Adafactor reads its step count on the host (no capturable nor fused path): each call
    runs its Python (one cached program), equal to eager, and the debug output says why."""
    reset_state()
    monkeypatch.setenv("SHARDTENSOR_DEBUG", "1")
    configs = [("Adafactor", optim.Adafactor, {})]
    ref_layers, ref_opts = _world(configs, "cpu")
    layers, opts = _world(configs, st.device())
    ref_step, step = _step(ref_layers, ref_opts), st.compile(_step(layers, opts))
    for i in range(3):
        x, y = _batch(i)
        step(x.to(st.device()), y.to(st.device()))
        ref_step(x, y)
    for p_ref, p in zip(ref_layers.parameters(), layers.parameters()):
        assert_close(p.cpu(), p_ref, rtol=1e-4, atol=1e-5)
    assert "it reads a device value on the host" in capsys.readouterr().err


def test_state_dict_keeps_torchs_own_form():
    """A state dict of optimizers whose steps ran on the devices inside a trace says what torch's
    own would (capturable / fused as the user set them, counters on the CPU): it loads into plain
    CPU optimizers, which then step as the device ones do."""
    reset_state()
    configs = [("Adam", optim.Adam, {}), ("Adagrad", optim.Adagrad, {})]
    layers, opts = _world(configs, st.device())
    step = st.compile(_step(layers, opts))
    for i in range(3):
        x, y = _batch(i)
        step(x.to(st.device()), y.to(st.device()))
    cpu_layers, _ = _world(configs, "cpu")
    cpu_layers.load_state_dict({k: v.cpu() for k, v in layers.state_dict().items()})
    cpu_opts = [cls(layer.parameters(), lr=0.01, **kw) for layer, (_, cls, kw) in zip(cpu_layers, configs)]
    for opt, cpu_opt in zip(opts, cpu_opts):
        state = opt.state_dict()
        group = state["param_groups"][0]
        assert group.get("capturable") == opt.defaults.get("capturable") and group["fused"] == opt.defaults["fused"]
        assert all(type(s["step"]) is torch.Tensor for s in state["state"].values())  # (CPU tensors)
        cpu_opt.load_state_dict(state)
    x, y = _batch(9)
    step(x.to(st.device()), y.to(st.device()))
    _step(cpu_layers, cpu_opts)(x, y)
    for p_cpu, p in zip(cpu_layers.parameters(), layers.parameters()):
        assert_close(p.cpu(), p_cpu, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", [optim.Adam, optim.SGD])
def test_differentiable_optimizer_raises_as_eager(cls):
    """``differentiable=True`` steps leaf parameters that require grad in place: eager torch raises,
    and so does the compiled step (the same type)."""
    reset_state()
    configs = [
        (cls.__name__, cls, {"differentiable": True, "momentum": 0.9} if cls is optim.SGD else {"differentiable": True})
    ]
    errors = []
    for device in ("cpu", st.device()):
        layers, opts = _world(configs, device)
        step = _step(layers, opts) if device == "cpu" else st.compile(_step(layers, opts))
        x, y = _batch(0)
        with pytest.raises(RuntimeError) as info:
            step(x.to(device), y.to(device))
        errors.append(type(info.value))
    assert errors[0] is errors[1]
