"""Issue 48 §6: ``torch.autocast`` on the device, bfloat16 and float16, in every mode.

**Which lists the device follows: PyTorch/XLA's** (``torch.autocast('xla')`` on a TPU, see
``shardtensor/tensor/autocast.py``): torch's CPU lists with PyTorch/XLA's changes — ``relu``,
``max_pool2d`` and ``einsum`` in the lower precision, ``softmax``, ``log_softmax``, ``batch_norm`` and
``pow(Tensor, Scalar)`` in float32 — without the CPU-only entries that exist for CPU kernels' limits.
They are the lists the code users bring from PyTorch/XLA was tuned with, on the chip shardtensor runs
on; CUDA's lists (torch's other family) cast far more ops to float32 (exp, log, sum, layer_norm ...).

**The reference** is eager torch on the CPU under ``torch.autocast("cpu", dtype=...)``; for the eight
ops PyTorch/XLA changes, the CPU's autocast is given the same policy for the test
(``cpu_autocast_like_the_device``: the op's CPU tensors cast as the policy says, then torch's own CPU
op), so every op's output dtype is compared exactly and its value at the autocast dtype's tolerance.
Gradients and trained parameters are compared by their norm (``assert_close_in_norm``): through a
model, two bf16 implementations round at different places, and a gradient element that is a sum
cancelling to near zero has no meaningful relative error (CPU float32 and CPU bf16 autocast differ
from each other by as much as the device and CPU autocast do).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardtensor as st
from _training_helpers import reset_state
from shardtensor.tensor import autocast as device_autocast

DEV = st.device()
LOW = (torch.bfloat16, torch.float16)

# PyTorch/XLA's changes to torch's CPU lists, and the CPU entries it (and the device) leaves out
XLA_CHANGES = {
    "relu": "lower",
    "max_pool2d": "lower",
    "einsum": "lower",
    "batch_norm": "fp32",
    "_softmax": "fp32",
    "softmax.int": "fp32",
    "log_softmax.int": "fp32",
    "pow.Tensor_Scalar": "fp32",
}
CPU_ONLY = {  # for CPU kernels' limits (bfloat16 3-d pooling, mkldnn), or CPU-internal ops
    "_addmm_activation",
    "_convolution.deprecated",
    "_grid_sampler_2d_cpu_fallback",
    "_native_multi_head_attention",
    "adaptive_avg_pool3d",
    "adaptive_max_pool3d",
    "avg_pool3d",
    "fractional_max_pool2d",
    "fractional_max_pool3d",
    "linalg_vecdot",
    "max_pool3d",
    "max_unpool2d",
    "max_unpool3d",
    "mkldnn_rnn_layer",
}


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    yield
    reset_state()


def _cpu_kernel(op, policy):
    off = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def kernel(*args, **kwargs):
        to = torch.get_autocast_dtype("cpu") if policy == "lower" else torch.float32

        def cast(a):
            if isinstance(a, (list, tuple)):
                return type(a)(cast(t) for t in a)
            if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype is not torch.float64:
                return a.to(to)
            return a

        with torch._C._ExcludeDispatchKeyGuard(off):
            return op(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})

    return kernel


@contextlib.contextmanager
def cpu_autocast_like_the_device(dtype):
    """``torch.autocast("cpu", dtype)`` with PyTorch/XLA's eight changes, for this block only."""
    with torch.library._scoped_library("aten", "IMPL") as lib:
        for name, policy in XLA_CHANGES.items():
            base, _, overload = name.partition(".")
            lib.impl(
                name, _cpu_kernel(getattr(getattr(torch.ops.aten, base), overload or "default"), policy), "AutocastCPU"
            )
        with torch.autocast("cpu", dtype=dtype):
            yield


def autocast_on(device, dtype):
    return cpu_autocast_like_the_device(dtype) if device == "cpu" else torch.autocast(DEV.type, dtype=dtype)


RTOL = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3}  # torch's own tolerances for the dtype


def assert_like(actual, expected, what=""):
    """Same dtype exactly; values at the tolerance of a low-precision dtype: torch's relative one,
    and as absolute one the same fraction of the largest value (one sum rounded in the low dtype at
    another step — addbmm's batches — moves a small element by an ulp of the large ones)."""
    assert actual.dtype == expected.dtype, f"{what}: {actual.dtype} where torch gives {expected.dtype}"
    actual = actual.cpu()
    if expected.dtype in RTOL:
        rtol = RTOL[expected.dtype]
        atol = rtol * float(expected.abs().max()) if expected.numel() else 0.0
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}")


# --- the lists ------------------------------------------------------------------------------------
def test_lists_are_torchs_cpu_lists_with_pytorch_xlas_changes():
    names = torch._C._dispatch_get_all_op_names()
    cpu = {n.removeprefix("aten::") for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCPU")}
    device = {
        n.removeprefix("aten::")
        for n in names
        if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastPrivateUse1")
    }
    assert device == (cpu - CPU_ONLY) | set(XLA_CHANGES)
    assert all(device_autocast.POLICIES[name] == policy for name, policy in XLA_CHANGES.items())
    # every other op falls through: it runs in the dtypes it is given
    x = torch.randn(4, 4, device=DEV)
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        assert (x.bfloat16() + x).dtype == torch.float32 and F.gelu(x.bfloat16()).dtype == torch.bfloat16


# --- torch's autocast API on the device -----------------------------------------------------------
def test_torchs_autocast_state_nesting_and_names_on_the_device():
    x = torch.randn(4, 4, device=DEV)
    assert not torch.is_autocast_enabled(DEV.type)
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        assert torch.is_autocast_enabled(DEV.type) and torch.get_autocast_dtype(DEV.type) == torch.bfloat16
        assert not torch.is_autocast_enabled("cpu")
        assert (x @ x).dtype == torch.bfloat16
        with torch.autocast(DEV.type, enabled=False):  # a float32 island
            assert (x @ x).dtype == torch.float32
        with torch.amp.autocast("shardtensor", dtype=torch.float16):
            assert (x @ x).dtype == torch.float16
        assert (x @ x).dtype == torch.bfloat16
    assert (x @ x).dtype == torch.float32 and not torch.is_autocast_enabled(DEV.type)
    with st.autocast():  # PyTorch/XLA's default: bfloat16
        assert torch.get_autocast_dtype(DEV.type) == torch.bfloat16 and (x @ x).dtype == torch.bfloat16

    @torch.autocast(DEV.type, dtype=torch.float16)
    def product(a):
        return a @ a

    assert product(x).dtype == torch.float16
    with pytest.warns(UserWarning, match="not supported"), torch.autocast(DEV.type, dtype=torch.float64):
        assert not torch.is_autocast_enabled(DEV.type)  # (as on CPU: the region is disabled)


def _casts_in(t):
    """The autograd nodes that cast (``.to(dtype)``) in ``t``'s graph."""
    seen, casts, todo = set(), set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__.startswith("ToCopyBackward"):
            casts.add(node)
        todo.extend(f for f, _ in node.next_functions)
    return casts


@pytest.mark.parametrize("cache_enabled", [True, False])
def test_a_weight_used_twice_is_cast_once_while_the_cache_is_on(cache_enabled):
    """As torch: with the cache one cast of the weight serves both uses (its gradient flows through
    one cast), without it each use casts; the cache is emptied when the region exits."""
    counts = {}
    for device in ("cpu", DEV):
        w = torch.randn(4, 4, device=device, requires_grad=True)
        x = torch.randn(3, 4, device=device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, cache_enabled=cache_enabled):
            y = F.linear(F.linear(x, w), w)
        counts[str(device)] = len(_casts_in(y))
    assert counts == {"cpu": 1 if cache_enabled else 2, str(DEV): 1 if cache_enabled else 2}
    assert not device_autocast._cache


# --- one op at a time -----------------------------------------------------------------------------
def _op_cases(low):
    """name -> (function, inputs): CPU float32 inputs, and ``low`` ones where the op's input is
    usually an autocast result."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    a, b, v = r(6, 5), r(5, 7), r(5)
    a3, b3 = r(2, 6, 5), r(2, 5, 4)
    img, w = r(2, 3, 8, 8), r(4, 3, 3, 3)
    logits, target = r(6, 5), torch.randint(0, 5, (6,), generator=g)
    q, k, val = r(2, 2, 4, 8), r(2, 2, 4, 8), r(2, 2, 4, 8)
    mean, var = r(3), r(3).abs() + 0.5
    bf = r(6, 5, dtype=low)
    return {
        # lower precision
        "mm": (torch.mm, a, b),
        "matmul @": (lambda x, y: x @ y, a, b),
        "addmm": (torch.addmm, r(7), a, b),
        "bmm": (torch.bmm, a3, b3),
        "baddbmm": (torch.baddbmm, r(2, 6, 4), a3, b3),
        "addbmm": (torch.addbmm, r(6, 4), a3, b3),
        "linear": (F.linear, a, r(3, 5), r(3)),
        "conv1d": (F.conv1d, r(2, 3, 9), r(4, 3, 3)),
        "conv2d": (F.conv2d, img, w, r(4)),
        "conv2d same": (lambda x, y: F.conv2d(x, y, padding="same"), img, w),
        "conv_transpose2d": (F.conv_transpose2d, img, r(3, 2, 3, 3)),
        "prelu": (F.prelu, a, r(1)),
        "relu (PyTorch/XLA)": (F.relu, a),
        "max_pool2d (PyTorch/XLA)": (lambda x: F.max_pool2d(x, 2), img),
        "einsum (PyTorch/XLA)": (lambda x, y: torch.einsum("ij,jk->ik", x, y), a, b),
        "sdpa": (F.scaled_dot_product_attention, q, k, val),
        # float32
        "softmax (PyTorch/XLA)": (lambda x: x.softmax(-1), bf),
        "log_softmax (PyTorch/XLA)": (lambda x: F.log_softmax(x, -1), bf),
        "softmax dtype=": (lambda x: x.softmax(-1, dtype=torch.float64), bf),
        "batch_norm (PyTorch/XLA)": (lambda x, m, s: F.batch_norm(x, m, s), r(4, 3, dtype=low), mean, var),
        "pow (PyTorch/XLA)": (lambda x: x**2, bf),
        "prod": (lambda x: x.prod(-1), bf),
        "cdist": (torch.cdist, bf, r(4, 5)),
        "cross_entropy": (F.cross_entropy, logits.to(low), target),
        "nll_loss": (F.nll_loss, logits.to(low), target),
        "mse_loss": (F.mse_loss, bf, a),
        "l1_loss": (F.l1_loss, bf, a),
        "smooth_l1_loss": (F.smooth_l1_loss, bf, a),
        "kl_div": (lambda x, y: F.kl_div(x, y, reduction="batchmean"), bf, a.softmax(-1)),
        "bce_with_logits": (F.binary_cross_entropy_with_logits, bf, a.sigmoid()),
        "binary_cross_entropy": (F.binary_cross_entropy, bf.sigmoid(), a.sigmoid()),
        "trace": (torch.trace, bf),
        "reflection pad": (lambda x: F.pad(x, (1, 1, 1, 1), mode="reflect"), img.to(low)),
        # promote: the widest floating type
        "cat bf16+fp32": (lambda x, y: torch.cat([x, y]), bf, a),
        "cat bf16+bf16": (lambda x, y: torch.cat([x, y]), bf, bf),
        "stack": (lambda x, y: torch.stack([x, y]), bf, a),
        "index_copy": (lambda x, s: x.index_copy(0, torch.tensor([1, 3]).to(x.device), s), a, r(2, 5, dtype=low)),
        # not cast: float64, integers, in-place and unlisted ops
        "mm float64": (torch.mm, a.double(), b.double()),
        "mm integers": (torch.mm, torch.ones(2, 3, dtype=torch.long), torch.ones(3, 2, dtype=torch.long)),
        "addmm_ in place": (lambda x, y, z: x.clone().addmm_(y, z), r(6, 7), a, b),
        "layer_norm": (lambda x, w_, b_: F.layer_norm(x, (5,), w_, b_), bf, r(5), r(5)),
        "gelu": (F.gelu, bf),
        "matvec": (torch.mv, a, v),
    }


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_each_op_as_torch_autocast_casts_it(dtype):
    """Output dtypes exactly as torch's CPU autocast (with PyTorch/XLA's changes), values at the
    dtype's tolerance; all cases record into one lazy program."""
    cases = _op_cases(dtype)
    expected, outputs = {}, {}
    with cpu_autocast_like_the_device(dtype):
        for name, (fn, *args) in cases.items():
            expected[name] = fn(*args)
    with torch.autocast(DEV.type, dtype=dtype):
        for name, (fn, *args) in cases.items():
            outputs[name] = fn(*[t.to(DEV) for t in args])
    for name in cases:
        assert_like(outputs[name], expected[name], name)


def test_a_promoting_op_refuses_the_other_low_dtype_as_torch_does():
    """float16 met before any float32 in a bfloat16 region: torch raises (float32 first wins)."""
    half, full = torch.randn(2, 3).half(), torch.randn(2, 3)
    for device, region in (("cpu", torch.autocast("cpu", dtype=torch.bfloat16)), (DEV, st.autocast())):
        with region:
            with pytest.raises(RuntimeError):
                torch.cat([half.to(device), full.to(device)])
            assert torch.cat([full.to(device), half.to(device)]).dtype == torch.float32


# --- small models in every mode -------------------------------------------------------------------
class Mixed(nn.Module):
    """Conv → BatchNorm → ReLU → max-pool, Linear → LayerNorm → GELU, a matmul chain through a softmax
    (attention over the batch), a cat of a low and a float32 value, and a cross-entropy head: every
    policy, and ops off the lists between them. Returns the loss and each stage's value."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(64, 16)
        self.ln = nn.LayerNorm(16)
        self.q = nn.Linear(16, 16)
        self.k = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(32, 5)

    def forward(self, x, y):
        seen = {"conv": self.conv(x)}
        seen["batch_norm"] = self.bn(seen["conv"])
        seen["relu"] = F.relu(seen["batch_norm"])
        seen["pool"] = F.max_pool2d(seen["relu"], 2)
        seen["linear"] = self.fc(seen["pool"].flatten(1))
        h = seen["gelu"] = F.gelu(self.ln(seen["linear"]))
        seen["scores"] = self.q(h) @ self.k(h).t() / 4
        seen["softmax"] = seen["scores"].softmax(-1)
        seen["attend"] = seen["softmax"] @ h
        seen["cat"] = torch.cat([seen["attend"], h.float()], -1)
        seen["logits"] = self.head(seen["cat"])
        seen["loss"] = F.cross_entropy(seen["logits"], y)
        return seen["loss"], seen


# calls per mode: a compiled step is called until it runs what it compiled (st.compile freezes at
# its third call); gradients accumulate and running statistics move in each
CALLS = {"lazy": 1, "eager": 1, "st.compile": 3, "torch.compile": 2}


def _data():
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)


def _on_device(x, mode):
    """The batch on the device; in lazy mode sharded over the 8 devices (SPMD: casts are elementwise,
    the program keeps the layout)."""
    if mode != "lazy":
        return x.to(DEV)
    return st.shard(x, st.Mesh(range(8), (8,), ("data",)), ("data", None, None, None))


def _step(model, device, dtype):
    def step(x, y):
        with autocast_on(device, dtype):
            loss, seen = model(x, y)
        loss.backward()
        return {k: v.detach() for k, v in seen.items()}

    return step


def assert_close_in_norm(actual, expected, rtol, what=""):
    """``‖actual − expected‖ ≤ rtol·‖expected‖``: a gradient through low-precision products, whose
    small elements are sums that cancel (their relative error is not the measure)."""
    assert actual.dtype == expected.dtype, f"{what}: {actual.dtype} where torch gives {expected.dtype}"
    error = (actual.cpu().double() - expected.double()).norm()
    assert error <= rtol * expected.double().norm(), f"{what}: relative error {error / expected.double().norm():.2e}"


@pytest.mark.parametrize(
    "mode, dtype",
    [(mode, dtype) for mode in ("lazy", "st.compile", "torch.compile") for dtype in LOW]
    + [("eager", torch.bfloat16)],  # (eager mode compiles each op: float16 adds nothing new there)
    ids=str,
)
def test_a_model_under_autocast_in_each_mode(mode, dtype):
    torch.manual_seed(0)
    reference = Mixed()
    model = copy.deepcopy(reference).to(DEV)
    x, y = _data()
    step_on_cpu = _step(reference, "cpu", dtype)
    expected = [step_on_cpu(x, y) for _ in range(CALLS[mode])]

    step = _step(model, DEV, dtype)
    if mode == "st.compile":
        step = st.compile(step)
    elif mode == "torch.compile":
        torch._dynamo.reset()
        step = torch.compile(step, backend="shardtensor")
    frozen = st.counter_value("CompileFrozen") or 0
    with st.eager_mode(mode == "eager"):
        got = [step(_on_device(x, mode), y.to(DEV)) for _ in range(CALLS[mode])]
    if mode == "st.compile":  # its last call ran the program frozen with autocast's casts in it
        assert (st.counter_value("CompileFrozen") or 0) == frozen + 1
    got, expected = got[-1], expected[-1]
    for name in expected:
        assert_like(got[name], expected[name], f"{mode}: {name}")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close_in_norm(p.grad, q.grad, 4 * RTOL[dtype], f"{mode}: {name}.grad")
    for name, buffer in reference.bn.named_buffers():
        torch.testing.assert_close(
            getattr(model.bn, name).cpu(), buffer, msg=lambda m, name=name: f"{mode}: bn.{name}: {m}"
        )


@pytest.mark.parametrize("compiler", ["st.compile", "torch.compile"])
def test_a_region_around_a_compiled_call_is_part_of_what_it_runs(compiler):
    """A compiled call made under bfloat16 autocast, then outside the region and under float16: the
    bfloat16 program must not run again (both check torch's global state, autocast's included, with
    Dynamo's GlobalStateGuard: st.compile's frozen replay re-runs the Python, torch.compile recompiles)."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 4).to(DEV)
    x = torch.randn(6, 8, device=DEV)
    if compiler == "torch.compile":
        torch._dynamo.reset()
        step = torch.compile(lambda x: layer(x).detach(), backend="shardtensor")
    else:
        step = st.compile(lambda x: layer(x).detach())
    regions = [torch.bfloat16] * 3 + [None, torch.float16]  # frozen at the third call, then other regions
    frozen = st.counter_value("CompileFrozen") or 0
    dtypes = []
    for dtype in regions:
        with torch.autocast(DEV.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            dtypes.append(step(x).dtype)
        if compiler == "st.compile" and len(dtypes) == 3:  # (the bfloat16 program did freeze)
            assert (st.counter_value("CompileFrozen") or 0) > frozen
    assert dtypes == [torch.bfloat16] * 3 + [torch.float32, torch.float16]


# --- a Hugging Face model trained under autocast --------------------------------------------------
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


LLAMA_STEPS = 3


def _llama_training(model, device):
    """``LLAMA_STEPS`` AdamW steps under bfloat16 autocast (forward and loss in the region, backward
    and update after it, as torch's AMP recipe has it), one lazy program each: each step's loss, and
    the parameters at the end. (Autocast in st.compile: ``test_a_model_under_autocast_in_each_mode``.)"""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if device != "cpu":
        st.prime_optimizer(optimizer)  # (step 1 is then the program the others replay)

    def step(ids):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(LLAMA_STEPS):
        ids = torch.randint(3, 128, (2, 8), generator=g).to(device)
        with st.step() if device != "cpu" else contextlib.nullcontext():
            losses.append(step(ids))
    return torch.stack([loss.cpu() for loss in losses]), [p.detach().cpu() for p in model.parameters()]


def test_a_hugging_face_llama_trains_under_bfloat16_autocast_as_on_cpu():
    """Each step's loss within 1e-3 (relative; 7e-5 here), the final parameters within bf16's
    tolerance as a norm (7e-3 here; CPU float32 training differs from CPU autocast by as much: bf16
    rounding. One AdamW step skipped moves them by 6.6e-2). Elementwise, AdamW's first steps are
    lr·sign(gradient): a near-zero gradient element whose sign a rounding flips moves by 2·lr in
    any two bf16 implementations."""
    base = _tiny_llama()
    ref_losses, ref_params = _llama_training(copy.deepcopy(base), "cpu")
    model = copy.deepcopy(base).to(DEV)
    losses, params = _llama_training(model, DEV)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-3, atol=0)
    for (name, _), p, q in zip(model.named_parameters(), params, ref_params):
        assert_close_in_norm(p, q, RTOL[torch.bfloat16], name)


# --- float16 training with torch's GradScaler ------------------------------------------------------
def _scaled_training(model, device):
    """float16 autocast with ``torch.amp.GradScaler`` (unscale, clip, step, update): the scale grows
    after each good step, and step 1's batch overflows, so that step is skipped and the scale halves."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=2.0**14, growth_interval=1)
    g = torch.Generator().manual_seed(3)
    losses, scales = [], []
    for i in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
        if i == 1:
            x[0, 0] = float("inf")
        with torch.autocast(torch.device(device).type, dtype=torch.float16):
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.detach().cpu())
        scales.append(scaler.get_scale())
    return torch.stack(losses), scales


def test_float16_training_with_torchs_grad_scaler():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 5))
    model = copy.deepcopy(reference).to(DEV)
    ref_losses, ref_scales = _scaled_training(reference, "cpu")
    losses, scales = _scaled_training(model, DEV)
    assert scales == ref_scales == [2.0**15, 2.0**14, 2.0**15]  # grown, halved at the overflow, grown
    assert torch.isnan(losses[1]) and torch.isnan(ref_losses[1])
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL[torch.float16], atol=0, equal_nan=True)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close_in_norm(p.detach(), q.detach(), RTOL[torch.float16], name)
