"""Fused optimizers (``Adam / AdamW / SGD(fused=True)``) and the grad scaler's kernels, against eager
torch on CPU: the bare ops (torch's own fused CPU kernels as reference; their functional and out=
forms too), and a small MLP trained with all three optimizers and ``torch.amp.GradScaler`` in lazy,
eager and st.compile mode (reference: the same on CPU, fused and unfused, foreach on and off).

Tolerances: the fused update is elementwise in float32; torch's CPU kernel uses fused multiply-adds
where XLA may not (1 ulp), and Adam divides by sqrt(v) + eps, which amplifies a 1-ulp difference in
a tiny v: rtol 1e-5 / atol 1e-6 on the bare op, the training tolerances of test_training (rtol 1e-4 /
atol 1e-5, a few steps of a model) against the unfused paths, which round differently.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardtensor as st
from _training_helpers import fresh_executable_cache, reset_state

aten = torch.ops.aten
MESH = st.Mesh(range(8), (4, 2), ("data", "model"))
SHAPES = [(6, 4), (5,), (3, 8)]  # uneven over the mesh on purpose (6 over 4, 5 over 4)
SPECS = [("data", "model"), ("data",), (None, "model")]


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    yield
    reset_state()


def _make(n, seed, positive=False):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(s, generator=g) for s in SHAPES[:n]]
    return [t.abs() + 0.1 for t in ts] if positive else ts


def _dev(ts):
    return [st.shard(t.clone(), MESH, spec) for t, spec in zip(ts, SPECS)]


def _assert_lists_close(got, want, what, rtol=1e-5, atol=1e-6):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g.cpu(), w, rtol=rtol, atol=atol, msg=lambda m, i=i: f"{what}[{i}]: {m}")


# --- the bare ops ------------------------------------------------------------------------------------
ADAM_CASES = {
    "adamw": dict(op="_fused_adamw_", amsgrad=False, maximize=False, weight_decay=0.1, lr=1e-2, scaled=True),
    "adam_amsgrad_maximize_tensor_lr": dict(
        op="_fused_adam_", amsgrad=True, maximize=True, weight_decay=0.05, lr=torch.tensor(3e-2), scaled=False
    ),
}


@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_fused_adam_op_matches_torch_cpu_kernel(case):
    """Three steps of the bare op on sharded lists, the second with found_inf = 1 (skipped: nothing
    changes, not even the gradients); parameters and state keep their shardings."""
    c = ADAM_CASES[case]
    op = getattr(torch, c["op"])
    n = 3
    ref = {"p": _make(n, 0), "m": _make(n, 1), "v": _make(n, 2, positive=True)}
    ref["vmax"] = _make(n, 3, positive=True) if c["amsgrad"] else []
    dev = {k: _dev(v) for k, v in ref.items()}
    lr = c["lr"]
    dev_lr = lr.to(st.device()) if isinstance(lr, torch.Tensor) else lr  # a device lr tensor
    for step, found in enumerate([0.0, 1.0, 0.0], start=1):
        grads = [g * 256 if c["scaled"] else g for g in _make(n, 10 + step)]
        ref["g"], dev["g"] = grads, _dev(grads)
        steps = [torch.tensor(float(step))] * n
        kw = dict(beta1=0.9, beta2=0.99, weight_decay=c["weight_decay"], eps=1e-8)
        kw.update(amsgrad=c["amsgrad"], maximize=c["maximize"])
        scale = dict(grad_scale=torch.tensor(256.0), found_inf=torch.tensor(found)) if c["scaled"] else {}
        op(ref["p"], ref["g"], ref["m"], ref["v"], ref["vmax"], steps, lr=lr, **kw, **scale)
        dev_scale = {k: v.to(st.device()) for k, v in scale.items()}
        dev_steps = [s.to(st.device()) for s in steps]
        op(dev["p"], dev["g"], dev["m"], dev["v"], dev["vmax"], dev_steps, lr=dev_lr, **kw, **dev_scale)
        st.sync()
        for k in ("p", "g", "m", "v", "vmax"):
            _assert_lists_close(dev[k], ref[k], f"step {step} {k}")
    for k in ("p", "m", "v", "vmax"):
        for t, spec in zip(dev[k], SPECS):
            assert tuple(t.partition_spec) == spec, (k, t.partition_spec)


SGD_CASES = {
    "momentum_nesterov_scaled": dict(momentum=0.9, nesterov=True, dampening=0.0, weight_decay=0.1, lr=0.1, scaled=True),
    "dampening_maximize_tensor_lr": dict(
        momentum=0.8, nesterov=False, dampening=0.3, weight_decay=0.0, lr=torch.tensor(0.05), maximize=True
    ),
    # found_inf without grad_scale: what GradScaler passes after scaler.unscale_(opt)
    "no_momentum_found_inf_only": dict(momentum=0.0, nesterov=False, dampening=0.0, weight_decay=0.01, lr=0.2),
}


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_fused_sgd_op_matches_torch_cpu_kernel(case):
    c = dict(SGD_CASES[case])
    scaled, maximize = c.pop("scaled", False), c.pop("maximize", False)
    n = 3
    ref_p = _make(n, 0)
    ref_b = [] if c["momentum"] == 0 else [torch.zeros(s) for s in SHAPES[:n]]
    dev_p, dev_b = _dev(ref_p), _dev(ref_b)
    lr = c.pop("lr")
    dev_lr = lr.to(st.device()) if isinstance(lr, torch.Tensor) else lr
    for step, found in enumerate([0.0, 1.0, 0.0, 0.0], start=1):
        grads = _make(n, 10 + step)
        if scaled:
            grads = [g * 64 for g in grads]
        dev_g = _dev(grads)
        scale = dict(grad_scale=torch.tensor(64.0), found_inf=torch.tensor(found)) if scaled else {}
        if case.endswith("found_inf_only"):
            scale = dict(found_inf=torch.tensor(found))
        kw = dict(c, maximize=maximize, is_first_step=step == 1)
        torch._fused_sgd_(ref_p, grads, ref_b, lr=lr, **kw, **scale)
        dev_scale = {k: v.to(st.device()) for k, v in scale.items()}
        torch._fused_sgd_(dev_p, dev_g, dev_b, lr=dev_lr, **kw, **dev_scale)
        st.sync()
        _assert_lists_close(dev_p, ref_p, f"step {step} params")
        _assert_lists_close(dev_g, grads, f"step {step} grads")
        _assert_lists_close(dev_b, ref_b, f"step {step} momentum buffers")
    for t, spec in zip(dev_p + dev_b, SPECS + SPECS):
        assert tuple(t.partition_spec) == spec


def test_functional_and_out_forms():
    """``_fused_adamw`` returns new lists and leaves its inputs; ``.out`` writes the parameters' new
    values into ``out`` and, as torch's kernel does (its schema says otherwise), nothing else."""
    n = 2
    p, g, m, v = _make(n, 0), _make(n, 1), _make(n, 2), _make(n, 3, positive=True)
    steps = [torch.tensor(2.0)] * n
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    want = aten._fused_adamw.default(p, g, m, v, [], steps, **kw)
    dp, dg, dm, dv = _dev(p), _dev(g), _dev(m), _dev(v)
    dsteps = [s.to(st.device()) for s in steps]
    got = aten._fused_adamw.default(dp, dg, dm, dv, [], dsteps, **kw)
    assert isinstance(got, tuple) and [len(x) for x in got] == [n, n, n, n, 0]
    for k, (gx, wx) in enumerate(zip(got, want)):
        _assert_lists_close(gx, wx, f"result {k}")
    _assert_lists_close(dm, m, "exp_avgs left as they were")

    out_ref, out_dev = [torch.zeros(s) for s in SHAPES[:n]], _dev([torch.zeros(s) for s in SHAPES[:n]])
    aten._fused_adamw.out(p, g, m, v, [], steps, **kw, out=out_ref)
    aten._fused_adamw.out(dp, dg, dm, dv, [], dsteps, **kw, out=out_dev)
    _assert_lists_close(out_dev, out_ref, "out")
    for name, got, want in (("params", dp, p), ("grads", dg, g), ("exp_avgs", dm, m), ("exp_avg_sqs", dv, v)):
        _assert_lists_close(got, want, f"{name} (not written)", rtol=0, atol=0)


def test_grad_scaler_kernels_match_torch():
    """``_amp_foreach_non_finite_check_and_unscale_`` and ``_amp_update_scale_`` (growth, back-off,
    growth tracker), on sharded gradients."""
    grads = _make(3, 0)
    grads[1][2] = float("inf")
    for case in (grads[:1], grads):  # finite, then one inf
        ref_g, dev_g = [g.clone() for g in case], _dev(case)
        found, dev_found = torch.zeros(()), torch.zeros((), device=st.device())
        inv = torch.tensor(1 / 8.0)
        torch._amp_foreach_non_finite_check_and_unscale_(ref_g, found, inv)
        torch._amp_foreach_non_finite_check_and_unscale_(dev_g, dev_found, inv.to(st.device()))
        _assert_lists_close(dev_g, ref_g, "unscaled grads")
        assert dev_found.cpu().item() == found.item() == (1.0 if len(case) > 1 else 0.0)
    scale, tracker = torch.tensor(1024.0), torch.tensor(1, dtype=torch.int32)
    dev_scale, dev_tracker = scale.to(st.device()), tracker.to(st.device())
    for found in (0.0, 0.0, 1.0, 0.0):
        f = torch.tensor(found)
        torch._amp_update_scale_(scale, tracker, f, 2.0, 0.5, 2)
        torch._amp_update_scale_(dev_scale, dev_tracker, f.to(st.device()), 2.0, 0.5, 2)
        assert (dev_scale.cpu().item(), dev_tracker.cpu().item()) == (scale.item(), tracker.item())
        assert dev_tracker.dtype == torch.int32


def test_length_mismatch_is_a_clear_error():
    """(In eager mode the op runs at once; in lazy mode the same error comes at the sync.)"""
    p = _dev(_make(2, 0))
    steps = [torch.tensor(1.0, device=st.device())] * 2
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    with st.eager_mode(True), pytest.raises(RuntimeError, match="exp_avgs has 1 tensors but there are 2 parameters"):
        torch._fused_adam_(p, p, p[:1], p, [], steps, **kw)


# --- a real module: three fused optimizers, GradScaler, a learning-rate schedule -----------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 24)
        self.fc2 = nn.Linear(24, 20)
        self.head = nn.Linear(20, 5)

    def forward(self, x):
        return self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


MLP_SPECS = {"fc1.weight": ("model", "data"), "fc1.bias": ("model",), "fc2.weight": ("data", None)}
STEPS = 4
INF_STEP = 2  # a gradient is made inf at this step: GradScaler skips it and backs the scale off


def _optimizers(model, fused, foreach, adamw_only=False):
    """SGD (nesterov) on fc1, Adam (amsgrad, tensor lr) on fc2, AdamW (with a schedule) on head; or
    AdamW with a schedule on everything (Hugging Face Trainer's default)."""
    kw = dict(fused=True) if fused else dict(foreach=foreach)
    if adamw_only:
        adamw = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, **kw)
        return [adamw], torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: 1.0 / (1 + s))
    sgd_kw = dict(kw, foreach=False) if fused else kw  # fused=True with foreach=False: the same path
    sgd = torch.optim.SGD(model.fc1.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, **sgd_kw)
    # Adam takes a tensor lr with fused=True or foreach=False (foreach=True would need capturable=True)
    lr = torch.tensor(1e-3) if fused or not foreach else 1e-3
    adam = torch.optim.Adam(model.fc2.parameters(), lr=lr, amsgrad=True, **kw)
    adamw = torch.optim.AdamW(model.head.parameters(), lr=2e-3, weight_decay=0.1, **kw)
    schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: 1.0 / (1 + s))  # lr changes every step
    return [sgd, adam, adamw], schedule


def _data():
    """(x, y, poison) per step; poison (0 or inf) is added to one gradient: the same program each step."""
    g = torch.Generator().manual_seed(5)
    return [
        (
            torch.randn(16, 16, generator=g),
            torch.randint(0, 5, (16,), generator=g),
            torch.tensor(float("inf") if i == INF_STEP else 0.0),
        )
        for i in range(STEPS)
    ]


def _step_fn(model, opts, schedule, scaler):
    def train_step(x, y, poison):
        loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        with torch.no_grad():
            model.fc2.weight.grad[0, 0] += poison
        for o in opts:
            scaler.step(o)
        scaler.update()
        schedule.step()
        for o in opts:
            o.zero_grad()
        return loss.detach()

    return train_step


def _train_cpu(model, fused, foreach, adamw_only):
    opts, schedule = _optimizers(model, fused, foreach, adamw_only)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    step = _step_fn(model, opts, schedule, scaler)
    return [step(*batch).item() for batch in _data()], opts


@pytest.mark.parametrize("mode", ["lazy", "eager", "compile"])
def test_mlp_with_fused_optimizers_and_grad_scaler(mode):
    """Against CPU fused, foreach=False and foreach=True: losses, parameters, optimizer state (the
    step counters too: the inf step is not counted); lazy mode runs one program per step and
    compiles nothing after step 2 although the learning rate changes. (st.compile: AdamW only, to
    keep the test's compile time down.)"""
    adamw_only = mode == "compile"
    torch.manual_seed(0)
    ref = MLP()
    dev = copy.deepcopy(ref).to(st.device())
    named = dict(dev.named_parameters())
    for name, spec in MLP_SPECS.items():
        st.mark_sharding(named[name], MESH, spec)
    references = {}
    for fused, foreach in ((True, None), (False, False), (False, True)):
        trained = copy.deepcopy(ref)
        references["fused" if fused else f"foreach={foreach}"] = (
            trained,
            *_train_cpu(trained, fused, foreach, adamw_only),
        )

    opts, schedule = _optimizers(dev, True, None, adamw_only)
    scaler = torch.amp.GradScaler(st.device().type, init_scale=2.0**10, growth_interval=2)
    step = _step_fn(dev, opts, schedule, scaler)
    data = [(st.shard(x, MESH, ("data", None)), st.shard(y, MESH, ("data",)), p.to(st.device())) for x, y, p in _data()]
    fresh_executable_cache()
    losses, compiles, runs = [], [], []
    run = st.compile(step) if mode == "compile" else step
    with st.eager_mode(mode == "eager"):
        for batch in data:
            before = st.counter_value("ExecuteReplicated") or 0
            if mode == "lazy":
                with st.step():
                    loss = run(*batch)
            else:
                loss = run(*batch)
            runs.append((st.counter_value("ExecuteReplicated") or 0) - before)
            losses.append(loss.item())
            compiles.append(st.counter_value("UncachedCompile") or 0)

    for what, (trained, ref_losses, ref_opts) in references.items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5, msg=what)
        for (name, p_ref), p_dev in zip(trained.named_parameters(), dev.parameters()):
            torch.testing.assert_close(
                p_dev.cpu(), p_ref, rtol=1e-4, atol=1e-5, msg=lambda m, n=name, w=what: f"{w} {n}: {m}"
            )
        for o_ref, o_dev in zip(ref_opts, opts):
            for p_ref, p_dev in zip(o_ref.param_groups[0]["params"], o_dev.param_groups[0]["params"]):
                for k, v in o_ref.state[p_ref].items():
                    torch.testing.assert_close(
                        o_dev.state[p_dev][k].cpu(), v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k, w=what: f"{w} {k}: {m}"
                    )
    # the inf step is not counted by the optimizer holding the inf gradient (GradScaler checks each one)
    poisoned = next(o for o in opts if any(p is dev.fc2.weight for p in o.param_groups[0]["params"]))
    assert poisoned.state[dev.fc2.weight]["step"].cpu().item() == STEPS - 1
    assert scaler.get_scale() == 2.0**10  # grew after two clean steps, backed off at the inf
    for o in opts:  # the optimizer state of a sharded parameter is laid out as the parameter
        for p in o.param_groups[0]["params"]:
            for k, v in o.state[p].items():
                if k != "step" and p.partition_spec is not None:
                    assert v.sharding_spec == p.sharding_spec, (k, v.sharding_spec, p.sharding_spec)
    if mode == "lazy":
        assert runs == [1] * STEPS, f"programs run per step: {runs}"
    if mode in ("lazy", "compile"):
        # step 1 creates the state, step 2 uses it; steps 3 and 4 are step 2 again (with a new lr)
        assert compiles[1] == compiles[-1], f"UncachedCompile after each step: {compiles}"
