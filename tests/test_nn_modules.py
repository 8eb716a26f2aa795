"""The stock ``torch.nn`` layers, sharded, forward and backward, against eager torch: the module-level
counterpart of the OpInfo sweep (tests/ops/test_opinfo.py).

Every class in ``torch.nn.modules.__all__`` is either swept (``CASES``) or listed in ``EXCLUDED`` with
the reason (``test_every_module_is_swept_or_excluded`` keeps the two complete). A case is built on
CPU with a fixed seed: from torch's ``module_db`` (its first ``ModuleInput``: constructor and forward
arguments) or, for the modules ``module_db`` lacks, from ``EXTRA`` below. Then, per kind:

* ``train``      ``module.train()``: forward, and backward of a random-weighted sum of the float
                 outputs; outputs, input gradients, parameter gradients and buffers (BatchNorm's
                 running statistics) are compared with the same module run in eager torch on CPU;
* ``eval``       the same in ``module.eval()``, for modules whose train and eval differ (BatchNorm,
                 dropout, RNNs, attention);
* ``inference`` / ``inference_masked``  ``eval()`` under ``torch.no_grad()``, forward only, for the
                 modules with inference fast paths (``nn.MultiheadAttention``,
                 ``nn.TransformerEncoderLayer``, ``nn.TransformerEncoder``: ``aten._native_multi_head_attention``,
                 ``aten._transformer_encoder_layer_fwd``, the nested-tensor path), without and with a
                 key padding mask;

each in lazy mode (tensor inputs sharded on their first, batch, dimension over the (4, 2) mesh's 'x'
axis; forward and backward record one graph, read back after one sync) and in eager mode (over the
(8,) mesh; forward and backward, not for every kind, to keep the time budget: see LAZY_ONLY). Batch
sizes that don't divide the axis (2, 3, 15 over 4 or 8) give padded, uneven shards. Parameters are
copied to ``st.device()`` (replicated). Test ids: ``<module>-<kind>-<mode>``.

Modules that draw random numbers in the forward (dropout, RReLU in training; found by watching for an
aten op tagged ``nondeterministic_seeded``) can't match torch's generator: their outputs and gradients
are compared by shape and dtype, and for nn.Dropout / Dropout1d-3d by their form (each element 0 or
x / (1 - p), the gradient likewise); their ``eval`` kind compares values (the identity / a fixed
slope). Dropout's masks are tested in tests/test_random.py.

Expected failures live in nn_modules_expected_failures.txt, as in the OpInfo sweep: listed and failing
-> xfail; listed and passing -> FAIL (remove the line: the file only shrinks); not listed and failing
-> FAIL. ``python tests/test_nn_modules.py --write-expected`` runs the sweep and rewrites the file.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import pathlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.testing._internal.common_modules import module_db
from torch.utils._pytree import tree_flatten, tree_map

import shardtensor as st
from tensor_helpers import RandomProbe

EXPECTED_FILE = pathlib.Path(__file__).with_name("nn_modules_expected_failures.txt")
SEED = 0
# float32: XLA's CPU kernels (exp, tanh, dot and convolution accumulation order) differ from ATen's
# in the last bits; a wrong result misses by far more.
RTOL, ATOL = 1e-5, 1e-5
# Eager mode runs every op as a program of its own: ~25 ms of XLA compile each, 10-150 a case, most
# of them in the backward (each backward op, the gradient accumulation), so the eager runs cover
# fewer kinds than the lazy ones (LAZY_ONLY).

MESHES = {
    False: (st.Mesh(range(8), (4, 2), ("x", "y")), "x"),  # lazy
    True: (st.Mesh(range(8), (8,), ("x",)), "x"),  # eager
}


# ---- the cases ----------------------------------------------------------------------------------


Build = Callable[[bool], tuple[nn.Module, tuple, dict]]


@dataclasses.dataclass(frozen=True)
class Case:
    """One module: ``builds[kind](training)`` gives a CPU module (seeded) and its forward args and
    kwargs for that kind (``train``, ``eval``, ``inference``, ``inference_masked``)."""

    name: str
    builds: dict[str, Build]


_DB = {info.module_cls: info for info in module_db}


@functools.cache
def _db_input(cls, training):
    """The first ModuleInput of ``cls`` in module_db (cached: some inputs funcs build a hundred)."""
    info = _DB[cls]
    torch.manual_seed(SEED)
    return info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True, training=training)[0]


def _materialise_lazy(module, args, kwargs):
    """A lazy module (``nn.LazyLinear``...) gets its shapes from one forward on CPU, so that the CPU
    and the device copy start from the same parameters."""
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters()):
        with torch.no_grad():
            module(*_map_once(_clone_leaf, args), **_map_once(_clone_leaf, kwargs))


def _from_db(cls):
    def build(training):
        mi = _db_input(cls, training)
        torch.manual_seed(SEED)
        # .to(float32) as torch's own module tests do (FractionalMaxPool's samples come as float64)
        module = cls(*mi.constructor_input.args, **mi.constructor_input.kwargs).to(torch.float32)
        fwd = mi.forward_input
        args, kwargs = _map_once(_clone_leaf, (tuple(fwd.args), dict(fwd.kwargs)))
        _materialise_lazy(module, args, kwargs)
        return module, args, kwargs

    return build


def _extra(make_module, make_args):
    """A case built from ``make_module()`` and the forward args ``make_args()`` (a tuple), seeded."""

    def build(training):
        torch.manual_seed(SEED)
        module = make_module()
        args = tuple(make_args())
        _materialise_lazy(module, args, {})
        return module, args, {}

    return build


def _randn(*shape):
    return torch.randn(*shape, requires_grad=True)


def _unpool_inputs(dims):
    """(pooled, indices) of a kernel-2 max pool: MaxUnpoolNd's inputs."""
    x = torch.randn(3, 2, *([4] * dims))
    pool = [nn.functional.max_pool1d, nn.functional.max_pool2d, nn.functional.max_pool3d][dims - 1]
    out, idx = pool(x, 2, return_indices=True)
    return out.requires_grad_(), idx


TRAIN, BOTH = ("train",), ("train", "eval")
R = _randn


def _leaf(t):
    return t.detach().requires_grad_()


# Modules module_db has no entry for: name -> (module, forward args, kinds), small and seeded.
EXTRA: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple], tuple[str, ...]]] = {
    "AdaptiveLogSoftmaxWithLoss": (
        lambda: nn.AdaptiveLogSoftmaxWithLoss(8, 10, cutoffs=[4, 8], div_value=2.0),
        lambda: (R(6, 8), torch.tensor([0, 3, 4, 7, 8, 9])),
        TRAIN,
    ),
    "AlphaDropout": (lambda: nn.AlphaDropout(0.5), lambda: (R(6, 5),), BOTH),
    "ChannelShuffle": (lambda: nn.ChannelShuffle(2), lambda: (R(3, 4, 2, 2),), TRAIN),
    "CosineSimilarity": (lambda: nn.CosineSimilarity(), lambda: (R(6, 8), R(6, 8)), TRAIN),
    "CrossMapLRN2d": (lambda: nn.CrossMapLRN2d(3), lambda: (R(3, 4, 3, 3),), TRAIN),
    "Dropout": (lambda: nn.Dropout(0.5), lambda: (R(6, 5),), BOTH),
    "Dropout1d": (lambda: nn.Dropout1d(0.5), lambda: (R(6, 4, 3),), BOTH),
    "Dropout2d": (lambda: nn.Dropout2d(0.5), lambda: (R(6, 4, 3, 3),), BOTH),
    "Dropout3d": (lambda: nn.Dropout3d(0.5), lambda: (R(6, 4, 2, 2, 2),), BOTH),
    "EmbeddingBag": (lambda: nn.EmbeddingBag(10, 3, mode="mean"), lambda: (torch.randint(0, 10, (6, 4)),), TRAIN),
    "FeatureAlphaDropout": (lambda: nn.FeatureAlphaDropout(0.5), lambda: (R(6, 4, 3, 3),), BOTH),
    "Flatten": (lambda: nn.Flatten(), lambda: (R(3, 2, 4),), TRAIN),
    "Fold": (lambda: nn.Fold((3, 4), (2, 2)), lambda: (R(3, 8, 6),), TRAIN),
    "Hardsigmoid": (lambda: nn.Hardsigmoid(), lambda: (_leaf(torch.randn(3, 2, 5) * 4),), TRAIN),
    "Identity": (lambda: nn.Identity(), lambda: (R(3, 4),), TRAIN),
    "LazyBatchNorm1d": (lambda: nn.LazyBatchNorm1d(), lambda: (R(6, 3),), BOTH),
    "LazyBatchNorm2d": (lambda: nn.LazyBatchNorm2d(), lambda: (R(6, 3, 2, 2),), BOTH),
    "LazyBatchNorm3d": (lambda: nn.LazyBatchNorm3d(), lambda: (R(6, 3, 2, 2, 2),), BOTH),
    "LazyInstanceNorm1d": (
        lambda: nn.LazyInstanceNorm1d(affine=True, track_running_stats=True),
        lambda: (R(6, 3, 4),),
        BOTH,
    ),
    "LazyInstanceNorm2d": (
        lambda: nn.LazyInstanceNorm2d(affine=True, track_running_stats=True),
        lambda: (R(6, 3, 2, 3),),
        BOTH,
    ),
    "LazyInstanceNorm3d": (
        lambda: nn.LazyInstanceNorm3d(affine=True, track_running_stats=True),
        lambda: (R(6, 3, 2, 2, 2),),
        BOTH,
    ),
    "LazyLinear": (lambda: nn.LazyLinear(4), lambda: (R(6, 5),), TRAIN),
    "MaxUnpool1d": (lambda: nn.MaxUnpool1d(2), lambda: _unpool_inputs(1), TRAIN),
    "MaxUnpool2d": (lambda: nn.MaxUnpool2d(2), lambda: _unpool_inputs(2), TRAIN),
    "MaxUnpool3d": (lambda: nn.MaxUnpool3d(2), lambda: _unpool_inputs(3), TRAIN),
    "NLLLoss2d": (
        lambda: nn.NLLLoss2d(),
        lambda: (_leaf(torch.randn(3, 4, 2, 2).log_softmax(1)), torch.randint(0, 4, (3, 2, 2))),
        TRAIN,
    ),
    "PairwiseDistance": (lambda: nn.PairwiseDistance(), lambda: (R(6, 8), R(6, 8)), TRAIN),
    "PixelShuffle": (lambda: nn.PixelShuffle(2), lambda: (R(3, 8, 2, 3),), TRAIN),
    "PixelUnshuffle": (lambda: nn.PixelUnshuffle(2), lambda: (R(3, 2, 4, 6),), TRAIN),
    "RReLU": (lambda: nn.RReLU(), lambda: (R(6, 5),), BOTH),
    "Sequential": (lambda: nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), lambda: (R(6, 5),), TRAIN),
    "SyncBatchNorm": (lambda: nn.SyncBatchNorm(3), lambda: (R(6, 3, 4),), BOTH),
    "TransformerDecoder": (
        lambda: nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16, 0.0, batch_first=True), 1),
        lambda: (R(3, 4, 8), R(3, 5, 8)),
        TRAIN,
    ),
    "TripletMarginLoss": (lambda: nn.TripletMarginLoss(), lambda: (R(6, 8), R(6, 8), R(6, 8)), TRAIN),
    "TripletMarginWithDistanceLoss": (
        lambda: nn.TripletMarginWithDistanceLoss(),
        lambda: (R(6, 8), R(6, 8), R(6, 8)),
        TRAIN,
    ),
    "Unflatten": (lambda: nn.Unflatten(1, (2, 3)), lambda: (R(3, 6),), TRAIN),
    "Unfold": (lambda: nn.Unfold((2, 3)), lambda: (R(3, 2, 4, 5),), TRAIN),
    "Upsample": (lambda: nn.Upsample(scale_factor=2, mode="nearest"), lambda: (R(3, 2, 3, 2),), TRAIN),
    "UpsamplingBilinear2d": (lambda: nn.UpsamplingBilinear2d(scale_factor=2), lambda: (R(3, 2, 3, 2),), TRAIN),
    "UpsamplingNearest2d": (lambda: nn.UpsamplingNearest2d(scale_factor=2), lambda: (R(3, 2, 3, 2),), TRAIN),
}


# Inference fast paths (kinds ``inference`` and ``inference_masked``; eval() under no_grad):
# batch_first self-attention, the inputs that take ``aten._native_multi_head_attention`` /
# ``aten._transformer_encoder_layer_fwd`` (module_db's first inputs don't: they add bias_kv, or are
# unbatched); masked: with a key padding mask (nn.TransformerEncoder's nested-tensor path).
def _tokens():
    return torch.randn(3, 5, 8)


def _padding_mask():
    return torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])


def _encoder_layer():
    return nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True)


def _self_attention(masked):
    x = _tokens()
    return (x, x, x, _padding_mask()) if masked else (x, x, x)


INFERENCE: dict[str, tuple[Callable[[], nn.Module], Callable[[bool], tuple]]] = {
    "MultiheadAttention": (lambda: nn.MultiheadAttention(8, 2, batch_first=True), _self_attention),
    "TransformerEncoderLayer": (
        _encoder_layer,
        lambda masked: (_tokens(), None, _padding_mask()) if masked else (_tokens(),),
    ),
    "TransformerEncoder": (
        lambda: nn.TransformerEncoder(_encoder_layer(), 1),
        lambda masked: (_tokens(), None, _padding_mask()) if masked else (_tokens(),),
    ),
}


# Not swept, with the reason.
EXCLUDED = {
    "Module": "the abstract base class: no computation of its own",
    "Container": "deprecated alias of the base class: no computation of its own",
    "ModuleDict": "a container: no forward; its children are swept",
    "ModuleList": "a container: no forward; its children are swept",
    "ParameterDict": "a container of parameters: no forward",
    "ParameterList": "a container of parameters: no forward",
    "RNNBase": "the base class of nn.RNN / nn.LSTM / nn.GRU, which are swept",
    "RNNCellBase": "the base class of nn.RNNCell / nn.LSTMCell / nn.GRUCell, which are swept",
    "LinearCrossEntropyOptions": "not a module: the options object of nn.LinearCrossEntropyLoss (swept)",
}


def _cases() -> dict[str, Case]:
    cases: dict[str, dict[str, Build]] = {}
    for cls, info in _DB.items():
        kinds = ("train", "eval") if info.train_and_eval_differ else ("train",)
        cases[cls.__name__] = {kind: _from_db(cls) for kind in kinds}
    for name, (make_module, make_args, kinds) in EXTRA.items():
        cases[name] = {kind: _extra(make_module, make_args) for kind in kinds}
    for name, (make_module, make_inputs) in INFERENCE.items():
        cases[name]["inference"] = _extra(make_module, lambda f=make_inputs: f(False))
        cases[name]["inference_masked"] = _extra(make_module, lambda f=make_inputs: f(True))
    return {f"nn.{name}": Case(f"nn.{name}", builds) for name, builds in sorted(cases.items())}


CASES = _cases()


# ---- running one case ---------------------------------------------------------------------------


def _map_once(fn, tree):
    """``tree_map(fn, tree)`` that maps a tensor passed twice once: MultiheadAttention's self-attention
    fast path needs ``query is key is value``."""
    done: dict[int, Any] = {}

    def once(x):
        if isinstance(x, torch.Tensor):
            if id(x) not in done:
                done[id(x)] = fn(x)
            return done[id(x)]
        return fn(x)

    return tree_map(once, tree)


def _clone_leaf(x):
    if isinstance(x, torch.Tensor):
        c = x.detach().clone()
        if x.requires_grad:
            c.requires_grad_()
        return c
    return x


def _float_outputs(out):
    return [
        o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad
    ]


def _shard(x, eager):
    """A tensor sharded on its first dimension over the mode's mesh (0-d tensors replicated)."""
    if not isinstance(x, torch.Tensor):
        return x
    mesh, axis = MESHES[eager]
    spec = tuple(axis if d == 0 else None for d in range(x.dim()))
    s = st.shard(x.detach().clone(), mesh, spec)
    if x.requires_grad:
        s.requires_grad_()
    return s


@dataclasses.dataclass
class Run:
    outputs: list
    grads: dict[str, Any]
    buffers: dict[str, torch.Tensor]


def _run(module, args, kwargs, kind, backward, weights=None, probe=None):
    """Forward (under no_grad for ``inference``; watched by ``probe``) and, with ``backward``, the
    backward of a weighted sum of the float outputs; the outputs, gradients and buffers."""
    module.train(kind == "train")
    leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    grad_mode = torch.no_grad() if kind.startswith("inference") else contextlib.nullcontext()
    with grad_mode, probe or contextlib.nullcontext():
        out = module(*args, **kwargs)
    if not backward:
        return Run(tree_flatten(out)[0], {}, dict(module.named_buffers())), None
    outs = _float_outputs(out)
    if weights is None:
        gen = torch.Generator().manual_seed(SEED + 1)
        weights = [torch.randn(o.shape, generator=gen) for o in outs]
    if outs:
        dev = outs[0].device
        # the backward of sum(out * w), w random (a plain sum would miss softmax-like gradients), with
        # w as the output gradients: no loss ops of its own to compile in eager mode
        torch.autograd.backward(outs, [w.to(dev) for w in weights])
    grads = {f"input {i}": t.grad for i, t in enumerate(leaves)}
    grads.update({f"param {n}": p.grad for n, p in module.named_parameters()})
    return Run(tree_flatten(out)[0], grads, dict(module.named_buffers())), weights


def _compare(got, want, what, values, tol):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}, torch gives a tensor"
        got = got.cpu() if isinstance(got, st.ShardedTensor) else got
        assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, torch gives {want.dtype}"
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, torch gives {tuple(want.shape)}"
        if values:
            # a sum's rounding error scales with its largest terms, not with its (maybe small) result:
            # atol is relative to the tensor's largest magnitude (a conv weight gradient sums many products)
            scale = want.detach().abs().max().item() if want.is_floating_point() and want.numel() else 1.0
            atol = tol[1] * max(1.0, scale) if math.isfinite(scale) else tol[1]
            torch.testing.assert_close(
                got.detach(), want.detach(), rtol=tol[0], atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}"
            )
    elif want is None:
        assert got is None, f"{what}: got {type(got).__name__}, torch gives None"
    elif values:
        assert got == want, f"{what}: {got!r} != {want!r}"


def _random_result(case, kind, probe, outputs) -> bool:
    """Whether the forward's result depends on torch's generator: an op tagged
    ``nondeterministic_seeded`` ran (dropout, RReLU) and a second run, built afresh, under another
    seed gives other ``outputs`` (dropout with p=0 and RReLU in eval run such ops, and don't)."""
    if not probe.random:
        return False
    module, args, kwargs = case.builds[kind](kind == "train")
    torch.manual_seed(SEED + 3)
    again = _run(module, args, kwargs, kind, backward=False)[0].outputs
    return any(not torch.equal(a, b) for a, b in zip(again, outputs) if isinstance(a, torch.Tensor))


def check(case: Case, kind: str, eager: bool) -> None:
    """Run ``case`` in ``kind`` on CPU and sharded (lazy or ``eager``); raise on any difference."""
    module, args, kwargs = case.builds[kind](kind == "train")
    module_dev = copy.deepcopy(module).to(st.device())
    args_dev, kwargs_dev = _map_once(lambda x: _shard(x, eager), (args, kwargs))
    backward = not kind.startswith("inference")
    probe = RandomProbe()
    want, weights = _run(module, args, kwargs, kind, backward, probe=probe)
    values = not _random_result(case, kind, probe, want.outputs)
    with st.eager_mode(eager):
        got, _ = _run(module_dev, args_dev, kwargs_dev, kind, backward, weights)
    st.sync()
    tol = (RTOL, ATOL)
    assert len(got.outputs) == len(want.outputs), f"{len(got.outputs)} outputs, torch gives {len(want.outputs)}"
    for i, (g, w) in enumerate(zip(got.outputs, want.outputs)):
        _compare(g, w, f"output {i}", values, tol)
    assert got.grads.keys() == want.grads.keys()
    for name, w in want.grads.items():
        _compare(got.grads[name], w, f"grad of {name}", values, tol)
    assert got.buffers.keys() == want.buffers.keys()
    for name, w in want.buffers.items():
        _compare(got.buffers[name], w, f"buffer {name}", values, tol)
    if not values and isinstance(module, nn.modules.dropout._DropoutNd) and not isinstance(module, ALPHA_DROPOUT):
        _check_dropout(module.p, args[0], got, weights)


ALPHA_DROPOUT = (nn.AlphaDropout, nn.FeatureAlphaDropout)


def _check_dropout(p, x, got, weights):
    """Dropout's random result has a fixed form: each element is dropped (0) or kept and scaled by
    1 / (1 - p), and its gradient is the output weight scaled the same way where it was kept."""
    out = got.outputs[0].cpu().detach()
    kept = out != 0
    scale = 1 / (1 - p)
    assert 0 < kept.float().mean() < 1, "dropout kept all or none of the elements"
    torch.testing.assert_close(out, torch.where(kept, x.detach() * scale, 0), rtol=RTOL, atol=ATOL)
    if "input 0" in got.grads:
        grad = got.grads["input 0"].cpu()
        torch.testing.assert_close(grad, torch.where(kept, weights[0] * scale, 0), rtol=RTOL, atol=ATOL)


# ---- expected failures --------------------------------------------------------------------------


def load_expected(path=EXPECTED_FILE) -> dict[str, str]:
    """test id -> reason. One entry a line: ``<test id> | <reason>``; '#' starts a comment."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                tid, reason = (p.strip() for p in line.split("|", 1))
                out[tid] = reason
    return out


def failure_reason(exc: BaseException) -> str:
    """Exception type and the first line of its message."""
    first = next((m.strip() for m in str(exc).strip().splitlines() if m.strip()), "")
    return f"{type(exc).__name__}: {first}"[:200].replace("|", "/")


# The eager runs cover the ``train`` kind of every module and the inference fast
# paths; not ``eval`` (the ops of ``train`` with other flags: checked in lazy mode), nor these
# composites of swept layers (each of their layers runs in eager mode; the composition is checked in
# lazy mode), to keep the sweep in its time budget.
LAZY_ONLY = {
    "nn.Transformer",
    "nn.TransformerDecoder",
    "nn.TransformerDecoderLayer",
    "nn.TransformerEncoder",
    "nn.Sequential",
}


def _modes(name, kind):
    if kind == "eval" or (name in LAZY_ONLY and not kind.startswith("inference")):
        return ("lazy",)
    return ("lazy", "eager")


def case_ids() -> list[str]:
    return [
        f"{name}-{kind}-{mode}" for name, case in CASES.items() for kind in case.builds for mode in _modes(name, kind)
    ]


def _split(tid):
    name, kind, mode = tid.rsplit("-", 2)
    return CASES[name], kind, mode == "eager"


EXPECTED = load_expected()


@pytest.mark.parametrize("tid", case_ids())
def test_module(tid):
    case, kind, eager = _split(tid)
    expected = EXPECTED.get(tid)
    failure = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check(case, kind, eager)
    except Exception as e:  # noqa: BLE001
        if expected is None:
            raise
        failure = failure_reason(e)
    finally:
        _isolate()
    if failure is not None:
        pytest.xfail(f"{expected} [got {failure}]")
    if expected is not None:
        pytest.fail(f"{tid} passes now: remove it from {EXPECTED_FILE.name} (listed: {expected})", pytrace=False)


def _isolate():
    """A graph that failed in one case must not fail the next ones."""
    from shardtensor.graph import state

    try:
        st.sync()
    except Exception:  # noqa: BLE001
        state.forget_pending()


class _OffByATenthOfAPercent(nn.Module):
    """Right on CPU, wrong elsewhere: in the output, or (``in_backward``) only in the gradient."""

    def __init__(self, in_backward):
        super().__init__()
        self.in_backward = in_backward

    def forward(self, x):
        factor = 1.0 if x.device.type == "cpu" else 1.001
        if self.in_backward:  # the same values forward, the gradient scaled by factor
            return x * factor + (x * (1 - factor)).detach()
        return x * factor


@pytest.mark.parametrize("in_backward", [False, True], ids=["output", "gradient"])
def test_a_wrong_result_fails_the_check(in_backward):
    # the harness itself: values are compared (not only shapes) for a module that draws no random numbers
    case = Case("wrong", {"train": _extra(lambda: _OffByATenthOfAPercent(in_backward), lambda: (_randn(6, 5),))})
    with pytest.raises(AssertionError, match="grad of input 0" if in_backward else "output 0"):
        check(case, "train", eager=False)


def test_every_module_is_swept_or_excluded():
    import torch.nn.modules as modules

    names = set(modules.__all__)
    swept = {n.removeprefix("nn.") for n in CASES}
    assert not swept & set(EXCLUDED), f"both swept and excluded: {sorted(swept & set(EXCLUDED))}"
    missing = sorted(names - swept - set(EXCLUDED))
    assert not missing, f"torch.nn.modules classes neither swept nor excluded (add a case or a reason): {missing}"
    assert not set(EXCLUDED) - names, f"excluded names that torch.nn.modules lacks: {sorted(set(EXCLUDED) - names)}"


def test_expected_file_names_real_tests():
    stale = sorted(set(EXPECTED) - set(case_ids()))
    assert not stale, f"{EXPECTED_FILE.name} lists tests that do not exist: {stale[:10]}"


def _sweep(write_expected: bool, filters: list[str]) -> None:
    """Run the cases (those whose id contains one of ``filters``), print each one's CPU time and
    result, and with ``write_expected`` rewrite the expected-failures file from the failures."""
    import time

    failures, ran_ids = {}, []
    for tid in case_ids():
        if filters and not any(f in tid for f in filters):
            continue
        ran_ids.append(tid)
        start = time.process_time()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                check(*_split(tid))
            status = "ok"
        except Exception as e:  # noqa: BLE001
            failures[tid] = status = failure_reason(e)
        finally:
            _isolate()
        print(f"{time.process_time() - start:6.2f}s {tid}: {status}", flush=True)
    if write_expected:
        header = [line for line in EXPECTED_FILE.read_text().splitlines() if line.startswith("#")]
        ran = set(ran_ids)
        # listed reasons are kept (hand-written ones say more); cases not run keep their lines
        entries = {tid: reason for tid, reason in EXPECTED.items() if tid not in ran or tid in failures}
        entries.update({tid: reason for tid, reason in failures.items() if tid not in entries})
        lines = [f"{tid} | {reason}" for tid, reason in sorted(entries.items())]
        EXPECTED_FILE.write_text("\n".join(header + lines) + "\n")


if __name__ == "__main__":  # python tests/test_nn_modules.py [--write-expected] [id filter...]
    _sweep("--write-expected" in sys.argv, [a for a in sys.argv[1:] if not a.startswith("--")])
