"""What training code checks on sharded tensors, against eager torch on CPU: clip_grad_norm_'s
non-finite check and NaN detectors on gradients (lazy and in an ``st.compile``'d step), the exception
type torch raises for the same mistake (checked indices, empty reductions, bad arguments), and bool
tensors sharded over each dimension."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

import shardtensor as st
from tensor_helpers import MESH_42, isolate_lazy_graph

NAN, INF = math.nan, math.inf
NORMS = (2.0, 1.0, 3.0, INF)
CLIPS = {"torch": torch.nn.utils.clip_grad_norm_, "st": st.clip_grad_norm_}


@pytest.fixture(autouse=True)
def _isolated():
    yield
    isolate_lazy_graph()


def _grads(kind):
    """Gradients of a (8, 6) weight and a (6,) bias: finite, or with a NaN / an inf in one shard."""
    w = torch.linspace(-2, 3, 48).reshape(8, 6)
    b = torch.linspace(1, -1, 6)
    if kind == "nan":
        w[5, 2] = NAN  # in the third of four shards of dim 0
    elif kind == "inf":
        b[4] = -INF
    elif kind == "all_nan":
        w.fill_(NAN)
    return [w, b]


def _params(grads, sharded):
    params = [torch.nn.Parameter(torch.ones_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    if not sharded:
        return params
    out = []
    for p, spec in zip(params, (("x", None), ("y",))):
        q = torch.nn.Parameter(st.shard(p.detach().clone(), MESH_42, spec))
        q.grad = st.shard(p.grad.clone(), MESH_42, spec)
        out.append(q)
    return out


def _raises(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (its type is the answer)
        return type(e)
    return None


def test_clip_grad_norm_non_finite_check():
    """Every norm type: error_if_nonfinite=True raises torch's RuntimeError for a NaN or inf in any
    shard; without it, the total norm and the scaled gradients are torch's (NaN included)."""
    problems = []
    for clip_name, clip in CLIPS.items():
        for kind in ("nan", "inf", "all_nan", "finite"):
            for norm in NORMS:
                for foreach in (None, False):
                    tag = f"{clip_name} {kind} norm_type={norm} foreach={foreach}"
                    ref, got = _params(_grads(kind), False), _params(_grads(kind), True)
                    raised_ref = _raises(clip, ref, 1.0, norm, error_if_nonfinite=True, foreach=foreach)
                    raised = _raises(clip, got, 1.0, norm, error_if_nonfinite=True, foreach=foreach)
                    if raised is not raised_ref:
                        problems.append(f"{tag}: raises {raised}, torch raises {raised_ref}")
                    ref, got = _params(_grads(kind), False), _params(_grads(kind), True)
                    want = clip(ref, 1.0, norm, foreach=foreach)
                    total = clip(got, 1.0, norm, foreach=foreach)
                    try:
                        torch.testing.assert_close(total.cpu(), want, equal_nan=True)
                        for p, q in zip(got, ref):
                            torch.testing.assert_close(p.grad.cpu(), q.grad, equal_nan=True)
                    except AssertionError as e:
                        problems.append(f"{tag}: {str(e).splitlines()[0]}")
    assert not problems, "\n".join(problems)


_DETECTORS = {
    "any(isnan.any)": lambda gs: any(bool(g.isnan().any()) for g in gs),
    "isfinite.all": lambda gs: bool(torch.stack([torch.isfinite(g).all() for g in gs]).all()),
    "abs.max.isnan": lambda gs: [bool(g.abs().max().isnan()) for g in gs],
    "amax.isfinite": lambda gs: [bool(torch.amax(g, 0).isfinite().all()) for g in gs],
    "max.dim.isnan": lambda gs: [bool(g.max(0).values.isnan().any()) for g in gs],
    "min.isinf": lambda gs: [bool(g.min().isinf()) for g in gs],
    "inf_norm.isnan": lambda gs: [bool(torch.linalg.vector_norm(g, INF).isnan()) for g in gs],
    "isnan.sum": lambda gs: [int(g.isnan().sum()) for g in gs],
}


def _detect(grads):
    return {name: fn(grads) for name, fn in _DETECTORS.items()}


def test_nan_detectors_on_sharded_gradients():
    """The usual NaN/inf detectors on gradients sharded over the mesh, lazily and inside an
    st.compile'd function, say what they say in eager torch."""
    compiled = st.compile(lambda gs: [fn(gs) for fn in _DETECTORS.values()])
    problems = []
    for kind in ("nan", "inf", "all_nan", "finite"):
        want = _detect(_grads(kind))
        grads = [p.grad for p in _params(_grads(kind), True)]
        got = _detect(grads)
        got_compiled = dict(zip(_DETECTORS, compiled(grads)))
        for name in _DETECTORS:
            if got[name] != want[name]:
                problems.append(f"{kind} {name} lazy: {got[name]}, torch: {want[name]}")
            if got_compiled[name] != want[name]:
                problems.append(f"{kind} {name} st.compile: {got_compiled[name]}, torch: {want[name]}")
    assert not problems, "\n".join(problems)


class _Head(torch.nn.Module):
    """``x @ w + tanh(x) @ v``, both weights sharded over the outputs."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 4) / 3)
        self.v = torch.nn.Parameter(torch.randn(8, 4) / 3)

    def forward(self, x):
        return x @ self.w + torch.tanh(x) @ self.v


_PARAM_SPECS = {"w": (None, "x"), "v": (None, "x")}


def _model(sharded):
    torch.manual_seed(0)
    model = _Head()
    if sharded:
        model = model.to(st.device())
        for name, spec in _PARAM_SPECS.items():
            st.mark_sharding(getattr(model, name), MESH_42, spec)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model, opt, x, y, norm_type):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    if isinstance(x, st.ShardedTensor):  # gradients sharded like their parameters, as FSDP keeps them
        for name, spec in _PARAM_SPECS.items():
            st.mark_sharding(getattr(model, name).grad, MESH_42, spec)
    grads = [p.grad for p in model.parameters()]
    found = torch.stack([g.isnan().any() | g.isinf().any() for g in grads]).any()
    largest = torch.stack([g.abs().max() for g in grads]).max()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type, error_if_nonfinite=True)
    opt.step()
    return found, largest


def test_non_finite_check_in_a_training_step():
    """A training step with NaN detectors and clip_grad_norm_(error_if_nonfinite=True), lazily and
    st.compile'd: a batch with a NaN target raises torch's RuntimeError (the max-based norm too);
    finite batches train as in torch, before and after it."""
    for compiled in (False, True):
        for norm_type in (INF, 2.0):
            ref_model, ref_opt = _model(False)
            model, opt = _model(True)
            step = st.compile(_step) if compiled else _step
            torch.manual_seed(1)
            for i in range(4):
                x, y = torch.randn(8, 8), torch.randn(8, 4)
                if i == 2:  # one target: NaN in one column of each weight's gradient (in one shard)
                    y[5, 2] = NAN
                xs, ys = st.shard(x, MESH_42, ("x", None)), st.shard(y, MESH_42, ("x", None))
                try:
                    found_ref, largest_ref = _step(ref_model, ref_opt, x, y, norm_type)
                except RuntimeError:
                    with pytest.raises(RuntimeError, match="non-finite"):
                        step(model, opt, xs, ys, norm_type)
                    continue
                assert i != 2, "torch raises for the NaN batch"
                found, largest = step(model, opt, xs, ys, norm_type)
                assert bool(found) == bool(found_ref)
                torch.testing.assert_close(largest.cpu(), largest_ref)
                for p, q in zip(model.parameters(), ref_model.parameters()):
                    torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


# ---- the exception torch raises for the same mistake ----------------------------------------------

_I = torch.tensor
_X = torch.linspace(-1, 1, 32).reshape(8, 4)
_EMPTY = torch.zeros(0, 4)
ERRORS = {
    # checked on the device: the type depends on torch's kernel path
    "index_add_ 1-d": lambda c: c(torch.zeros(8)).index_add_(0, c(_I([0, 9])), c(torch.ones(2))),
    "index_add_ 2-d dim 0": lambda c: c(_X).index_add_(0, c(_I([0, 9])), c(torch.ones(2, 4))),
    "index_add_ int32": lambda c: c(_X).index_add_(0, c(_I([0, 9], dtype=torch.int32)), c(torch.ones(2, 4))),
    "index_select dim 0": lambda c: c(_X).index_select(0, c(_I([0, 8]))),
    "index_select dim 1": lambda c: c(_X).index_select(1, c(_I([0, 4]))),
    "index_copy_": lambda c: c(_X).index_copy_(0, c(_I([0, 8])), c(torch.ones(2, 4))),
    "index_copy_ int32": lambda c: c(_X).index_copy_(0, c(_I([0, 1], dtype=torch.int32)), c(torch.ones(2, 4))),
    "index_fill_ int32": lambda c: c(_X).index_fill_(0, c(_I([0, -1], dtype=torch.int32)), 2.0),
    "index_reduce_": lambda c: c(_X).index_reduce_(0, c(_I([0, 8])), c(torch.ones(2, 4)), "amax"),
    "gather": lambda c: torch.gather(c(_X), 1, c(torch.full((8, 4), 4))),
    "embedding": lambda c: F.embedding(c(_I([0, 8])), c(_X)),
    "cross_entropy": lambda c: F.cross_entropy(c(_X), c(torch.full((8,), 4))),
    # arguments torch's meta kernels let pass
    "index_add_ source shape": lambda c: c(_X).index_add_(0, c(_I([0, 1])), c(torch.ones(2, 3))),
    "masked_scatter byte mask": lambda c: c(_X).masked_scatter(c(torch.ones(8, 4, dtype=torch.uint8)), c(_X)),
    "multinomial too many": lambda c: torch.multinomial(c(torch.ones(8, 2)), 3),
    "multinomial int64": lambda c: torch.multinomial(c(torch.ones(8, 2, dtype=torch.int64)), 1),
    "uniform_ from > to": lambda c: c(torch.empty(8)).uniform_(2, 1),
    "random_ from >= to": lambda c: c(torch.empty(8)).random_(5, 2),
    "sub of a bool": lambda c: c(_X > 0) - c(_X),
    "add with a bool alpha": lambda c: torch.add(c(_X), c(_X), alpha=True),
    "conv2d dilation 0": lambda c: F.conv2d(c(torch.ones(4, 1, 4, 4)), c(torch.ones(1, 1, 2, 2)), dilation=0),
    "conv2d padding -1": lambda c: F.conv2d(c(torch.ones(4, 1, 4, 4)), c(torch.ones(1, 1, 2, 2)), padding=-1),
    # reductions of nothing
    "max()": lambda c: c(_EMPTY).max(),
    "min()": lambda c: torch.min(c(_EMPTY)),
    "max(dim)": lambda c: c(_EMPTY).max(0),
    "amax(dim)": lambda c: c(_EMPTY).amax(0),
    "argmax()": lambda c: c(_EMPTY).argmax(),
    "aminmax(dim)": lambda c: torch.aminmax(c(_EMPTY), dim=0),
    "median(dim)": lambda c: c(_EMPTY).median(0),
    "kthvalue": lambda c: c(_EMPTY).kthvalue(1, 0),
    "max of 1-d": lambda c: c(torch.zeros(0)).max(),
    "logsumexp": lambda c: c(_EMPTY).logsumexp(0),
    "softmax": lambda c: torch.softmax(c(_EMPTY), 0),
    "sum": lambda c: c(_EMPTY).sum(0),
    "amax(dim 1)": lambda c: c(_EMPTY).amax(1),
}


def _shard(t):
    spec = tuple("x" if i == 0 and n and n % 4 == 0 else None for i, n in enumerate(t.shape))
    return st.shard(t.clone(), MESH_42, spec)


def _outcome(fn, convert, mode):
    """The exception type ``fn`` raises (or its result) in ``mode``: 'torch', 'lazy', 'eager', 'compiled'."""
    try:
        if mode == "compiled":
            out = st.compile(lambda: fn(convert))()
        else:
            with st.eager_mode(mode == "eager"):
                out = fn(convert)
        out = [o.cpu() if isinstance(o, st.ShardedTensor) else o for o in (out if isinstance(out, tuple) else (out,))]
        st.sync(wait=True)
    except Exception as e:  # noqa: BLE001  (its type is the answer)
        return type(e)
    return out


@pytest.mark.parametrize("mode", ["lazy", "eager", "compiled"])
def test_errors_have_torch_exception_types(mode):
    problems = []
    for name, fn in ERRORS.items():
        want = _outcome(fn, lambda t: t, "torch")
        got = _outcome(fn, _shard, mode)
        if isinstance(want, type) or isinstance(got, type):
            if got is not want:
                problems.append(
                    f"{name}: {getattr(got, '__name__', 'no error')}, torch: {getattr(want, '__name__', 'none')}"
                )
            continue
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, equal_nan=True, msg=lambda m, name=name: f"{name}: {m}")
    assert not problems, "\n".join(problems)


# ---- bool tensors -----------------------------------------------------------------------------------

_MASK = torch.tensor([[(i * 7 + j * 3) % 5 < 2 for j in range(6)] for i in range(8)])
_VALUES = torch.linspace(-3, 3, 48).reshape(8, 6)
BOOL_OPS = {
    "sum": lambda m, x: m.sum(),
    "sum(dim)": lambda m, x: (m.sum(0), m.sum(1, keepdim=True)),
    "sum(dtype)": lambda m, x: m.sum(dtype=torch.float32),
    "count_nonzero": lambda m, x: torch.count_nonzero(m, 0),
    "any/all": lambda m, x: (m.any(), m.all(), m.any(1), m.all(0)),
    "masked_fill": lambda m, x: x.masked_fill(m, 0.5),
    "masked_fill cpu scalar": lambda m, x: x.masked_fill(m, torch.tensor(-1.5)),
    "masked_fill_ cpu scalar": lambda m, x: x.clone().masked_fill_(~m, torch.tensor(2.0)),
    "where": lambda m, x: (torch.where(m, x, 0.0), torch.where(m, x, torch.tensor(1.0)), torch.where(m, 1, 0)),
    "logical": lambda m, x: (m & (x > 0), m | (x > 0), m ^ (x > 0), ~m, torch.logical_not(m)),
    "logical with cpu scalar": lambda m, x: (m & torch.tensor(True), torch.logical_xor(m, torch.tensor(False))),
    "arithmetic promotion": lambda m, x: (m + m, m * x, m + 1, m * 2.5, m - x, m.int() + m),
    "to float": lambda m, x: (m.float(), m.to(torch.float64), m.long(), m.to(torch.bfloat16)),
    "cumsum": lambda m, x: (m.cumsum(0), m.cumsum(1), m.cumsum(0, dtype=torch.float32)),
    "mean": lambda m, x: (m.float().mean(), m.float().mean(0)),
    "comparison": lambda m, x: (m == (x > 0), m != m.t().t(), m.eq(True)),
    "argmax/max": lambda m, x: (m.max(), m.int().argmax(0), m.max(1)),
    "sort": lambda m, x: torch.sort(m.int(), 0, stable=True),
    "copysign": lambda m, x: torch.copysign(x, torch.tensor(-1.0)),
}
BOOL_HOST = {  # data-dependent shapes: read back while they run
    "nonzero": lambda m, x: m.nonzero(),
    "x[mask]": lambda m, x: x[m],
    "masked_select": lambda m, x: torch.masked_select(x, m),
    "argwhere": lambda m, x: torch.argwhere(m),
}
BOOL_SPECS = [("x", None), (None, "x"), ("y", "x"), ("x", "y")]


def _compare_all(got, want, what):
    problems = []
    for name, w in want.items():
        g = got[name]
        if isinstance(w, Exception) or isinstance(g, Exception):
            if type(g) is not type(w):
                problems.append(f"{what} {name}: {g!r:.200}, torch: {w!r:.200}")
            continue
        g = [t.cpu() if isinstance(t, st.ShardedTensor) else t for t in tree_flatten(g)[0]]
        try:
            assert len(g) == len(tree_flatten(w)[0]), "another number of results"
            for a, b in zip(g, tree_flatten(w)[0]):
                torch.testing.assert_close(a, b)
        except AssertionError as e:
            problems.append(f"{what} {name}: {str(e).splitlines()[0][:200]}")
    return problems


def _run_bool_ops(ops, m, x):
    out = {}
    for name, fn in ops.items():
        try:
            out[name] = fn(m, x)
        except Exception as e:  # noqa: BLE001  (collected)
            out[name] = e
    return out


@pytest.mark.parametrize("spec", BOOL_SPECS, ids=lambda s: "-".join(str(a) for a in s))
def test_sharded_bool_tensors(spec):
    """A bool tensor sharded over either dim (8 over 'x', 6 over 'x' unevenly, over both) behaves as
    torch's: reductions, masks, promotion, conversion, cumsum, CPU scalars beside it; lazily and
    under st.compile."""
    want = {**_run_bool_ops(BOOL_OPS, _MASK, _VALUES), **_run_bool_ops(BOOL_HOST, _MASK, _VALUES)}
    m, x = st.shard(_MASK.clone(), MESH_42, spec), st.shard(_VALUES.clone(), MESH_42, spec)
    problems = []
    host = _run_bool_ops(BOOL_HOST, m, x)
    lazy = _run_bool_ops(BOOL_OPS, m, x)
    compiled = st.compile(lambda m, x: _run_bool_ops(BOOL_OPS, m, x))(m, x)
    problems += _compare_all(host, {k: want[k] for k in BOOL_HOST}, "lazy")
    problems += _compare_all(lazy, {k: want[k] for k in BOOL_OPS}, "lazy")
    problems += _compare_all(compiled, {k: want[k] for k in BOOL_OPS}, "st.compile")
    assert not problems, "\n".join(problems)
