"""NaN, infinity and signed zeros through reductions, sorts, searches and comparisons, sharded.

Beside the OpInfo sweep (``opinfo_harness``), whose samples hold finite numbers: a table of calls
on float32 inputs full of NaN, all-NaN rows and columns, +-inf and +-0.0, sharded over the OpInfo
harness's (4, 2) mesh and compared with eager torch on CPU (NaN where torch gives NaN, the same
indices where torch defines them).

The five (8, 6) inputs (``INPUTS``) are stacked into one (5, 8, 6) tensor, so that one op along
dim 1 or 2 checks all five at once; ``SPECS`` shard its dims 1 and 2 (evenly, unevenly and both).
Everything of one spec is recorded into one lazy program (or one ``st.compile`` trace): a program
costs XLA ~50 ms per op to compile, so the table says which cases need every spec (reductions,
scans and sorts along a sharded dim: what crosses shards) and which one spec (elementwise
comparisons: each element on its own device). Where a batch fails as a whole, each case runs
alone so that the report names the failing ones.

Example::

    from nonfinite_harness import run_sweep
    run_sweep((None, "x", None), compiled=False)   # AssertionError listing every case that differs
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten, tree_map

import opinfo_harness as h
import shardtensor as st

NAN, INF = math.nan, math.inf

# Rows and columns built so that every reduction direction meets one NaN, several NaNs, all NaN,
# +-inf together, a row of -inf, signed zeros and plain numbers.
_ROWS = [
    [0.5, -1.25, 3.0, 2.0, -0.75, 1.5],  # plain numbers
    [0.25, 1.0, NAN, -2.0, 4.0, -3.5],  # one NaN
    [NAN, NAN, NAN, NAN, NAN, NAN],  # all NaN
    [NAN, 2.5, INF, -1.0, 0.75, NAN],  # NaN first and last, +inf
    [INF, -INF, 1.75, -0.5, 2.25, -2.5],  # +-inf
    [-INF, -INF, -INF, -INF, -INF, -INF],  # all -inf
    [0.0, -0.0, 1.25, -0.0, 0.0, -1.5],  # signed zeros
    [NAN, -INF, INF, -0.0, 0.0, 3.25],  # a bit of everything
]
_COLS = [  # column patterns (transposed below)
    [1.0, -2.0, 0.5, 3.5, -0.25, 2.75, -1.75, 4.5],
    [1.5, NAN, -0.5, 2.0, 0.25, -3.0, 5.0, -4.0],
    [NAN] * 8,
    [INF, NAN, -INF, 0.0, -0.0, 1.0, NAN, -1.0],
    [-0.0, 0.0, -0.0, 0.0, 2.0, -2.0, 0.0, -0.0],
    [INF, 3.0, INF, -5.0, -INF, 0.125, 6.0, -6.5],
]
_NO_NAN = [
    [INF, -1.0, 0.0, 2.5, -INF, 1.0],
    [-0.0, 3.0, -2.25, INF, 0.5, -1.5],
    [4.0, -INF, -0.0, 0.0, 1.25, -3.0],
    [-0.5, 0.75, INF, -4.0, 2.0, -INF],
    [5.5, 0.0, -0.0, -5.0, 3.75, 6.0],
    [-INF, -INF, 2.75, 1.75, INF, 0.25],
    [0.0, -6.0, 7.0, -0.0, -7.5, 8.0],
    [1.0, 9.0, -8.5, INF, -9.5, -0.0],
]


def _one_nan():
    x = torch.arange(48, dtype=torch.float32).reshape(8, 6).mul(0.37).sin().mul(10)
    x[7, 5] = NAN  # in the last shard of either dimension (the padded one of the uneven spec)
    return x


INPUTS = {
    "rows": torch.tensor(_ROWS),
    "cols": torch.tensor(_COLS).T.contiguous(),
    "no_nan": torch.tensor(_NO_NAN),
    "all_nan": torch.full((8, 6), NAN),
    "one_nan": _one_nan(),
}
NAMES = tuple(INPUTS)
# the second operand of the binary cases: NaN meets NaN, numbers, infinities and zeros
PARTNER = {"rows": "cols", "cols": "no_nan", "no_nan": "rows", "all_nan": "no_nan", "one_nan": "rows"}
X = torch.stack([INPUTS[n] for n in NAMES])  # (5, 8, 6)
Y = torch.stack([INPUTS[PARTNER[n]] for n in NAMES])
WHOLE_INPUTS = ("no_nan", "all_nan", "one_nan")  # whole-tensor reductions: one input at a time

# the (4, 2) mesh over the stack's dims 1 and 2: 8 over 'x', 6 over 'x' (uneven, padded), both. The
# cases along a dim run where that dim alone is sharded; the whole-tensor reductions on every spec.
SPECS = [(None, "x", None), (None, None, "x"), (None, "x", "y")]
LAST_DIM_SPEC = (None, None, "x")


def _q(x):
    return torch.tensor([0.0, 0.25, 0.5, 1.0], device=x.device)


def _finite_mean(x, out):
    """var_mean / std_mean: torch's Welford pass gives inf or NaN for the mean of values holding an
    infinity depending on where it sits (torch defines neither): compared only where finite."""
    spread, mean = out
    return spread, torch.where(mean.isfinite(), mean, NAN)


def _nan_free(x):
    """torch.mode sorts with ``<``, which NaN makes undefined: its inputs have no NaN."""
    return torch.nan_to_num(x, nan=7.0)


# Along a dim: f(x, d) for d in (1, 2) of the stack. ``ties``: int64 outputs are indices along d
# whose choice among equal values torch leaves open, compared by the values they point at.
ALONG = {
    "max.dim": lambda x, d: torch.max(x, d),
    "min.dim": lambda x, d: torch.min(x, d, keepdim=True),
    "amax": lambda x, d: torch.amax(x, d),
    "amin": lambda x, d: torch.amin(x, d),
    "aminmax": lambda x, d: torch.aminmax(x, dim=d),
    "argmax": lambda x, d: torch.argmax(x, d),
    "argmin": lambda x, d: torch.argmin(x, d, keepdim=True),
    "sum": lambda x, d: torch.sum(x, d),
    "prod": lambda x, d: torch.prod(x, d),
    "mean": lambda x, d: torch.mean(x, d),
    "nansum": lambda x, d: torch.nansum(x, d),
    "nanmean": lambda x, d: torch.nanmean(x, d),
    "std": lambda x, d: torch.std(x, d),
    "var": lambda x, d: torch.var(x, d, correction=0),
    "var_mean": lambda x, d: torch.var_mean(x, d),
    "norm2": lambda x, d: torch.linalg.vector_norm(x, 2, d),
    "norm1": lambda x, d: torch.norm(x, 1, d),
    "norm_inf": lambda x, d: torch.linalg.vector_norm(x, INF, d),
    "norm_-inf": lambda x, d: torch.linalg.vector_norm(x, -INF, d),
    "norm0": lambda x, d: torch.linalg.vector_norm(x, 0, d),
    "norm3": lambda x, d: torch.linalg.vector_norm(x, 3, d),
    "logsumexp": lambda x, d: torch.logsumexp(x, d),
    "softmax": lambda x, d: torch.softmax(x, d),
    "log_softmax": lambda x, d: torch.log_softmax(x, d),
    "cummax": lambda x, d: torch.cummax(x, d),
    "cummin": lambda x, d: torch.cummin(x, d),
    "cumsum": lambda x, d: torch.cumsum(x, d),
    "cumprod": lambda x, d: torch.cumprod(x, d),
    "logcumsumexp": lambda x, d: torch.logcumsumexp(x, d),
    "median": lambda x, d: torch.median(x, d),
    "nanmedian": lambda x, d: torch.nanmedian(x, d),
    "mode": lambda x, d: torch.mode(_nan_free(x), d),
    "kthvalue": lambda x, d: torch.kthvalue(x, 2, d),
    "quantile": lambda x, d: torch.quantile(x, _q(x), d).movedim(0, -1),
    "quantile_lower": lambda x, d: torch.quantile(x, 0.5, d, interpolation="lower"),
    "nanquantile": lambda x, d: torch.nanquantile(x, _q(x), d).movedim(0, -1),
    "nanquantile_midpoint": lambda x, d: torch.nanquantile(x, 0.5, d, interpolation="midpoint"),
    "sort": lambda x, d: torch.sort(x, d),
    "sort_descending": lambda x, d: torch.sort(x, d, descending=True),
    "sort_stable": lambda x, d: torch.sort(x, dim=d, stable=True),
    "argsort_descending": lambda x, d: torch.argsort(x, d, descending=True),
    "topk": lambda x, d: torch.topk(x, 3, d),
    "topk_smallest": lambda x, d: torch.topk(x, 2, d, largest=False),
    "count_nonzero": lambda x, d: torch.count_nonzero(x, d),
    "any": lambda x, d: torch.any(x, d),
    "all": lambda x, d: torch.all(x, d),
    "isnan.any": lambda x, d: x.isnan().any(d),
    "isfinite.all": lambda x, d: x.isfinite().all(d),
}
TIES = {"median", "nanmedian", "mode", "kthvalue", "sort", "sort_descending", "argsort_descending", "topk"}
TIES |= {"topk_smallest"}
CANON = {"var_mean": _finite_mean}

# Reductions of a whole tensor (no dim), one input at a time.
WHOLE = {
    "max": lambda x: torch.max(x),
    "min": lambda x: torch.min(x),
    "amax": lambda x: torch.amax(x),
    "amin": lambda x: torch.amin(x, (0, 1)),
    "aminmax": lambda x: torch.aminmax(x),
    "argmax": lambda x: torch.argmax(x),
    "argmin": lambda x: torch.argmin(x),
    "sum": lambda x: torch.sum(x),
    "prod": lambda x: torch.prod(x),
    "mean": lambda x: torch.mean(x),
    "nansum": lambda x: torch.nansum(x),
    "nanmean": lambda x: torch.nanmean(x),
    "std": lambda x: torch.std(x),
    "norm": lambda x: torch.norm(x),
    "norm_inf": lambda x: torch.norm(x, INF),
    "norm_-inf": lambda x: torch.linalg.vector_norm(x, -INF),
    "logsumexp": lambda x: torch.logsumexp(x, (0, 1)),
    "median": lambda x: torch.median(x),
    "nanmedian": lambda x: torch.nanmedian(x),
    "any": lambda x: torch.any(x),
    "all": lambda x: torch.all(x),
    "isnan.any": lambda x: x.isnan().any(),
    "isfinite.all": lambda x: torch.isfinite(x).all(),
    "abs.max.isnan": lambda x: x.abs().max().isnan(),
}

# Elementwise, and a few ops of the last dim, on the stack sharded by one spec (each element is
# computed where it lies; the last dim is the sharded one).
LAST_DIM = {
    "cdist_inf": lambda x, y: torch.cdist(x, y, p=INF),
    "max_pool1d": lambda x, y: torch.nn.functional.max_pool1d(x, 3, 1, 1, return_indices=True),
    "adaptive_max_pool1d": lambda x, y: torch.nn.functional.adaptive_max_pool1d(x, 2),
    "msort": lambda x, y: torch.msort(x.transpose(0, 1)),
    "isnan": lambda x, y: torch.isnan(x),
    "isinf": lambda x, y: torch.isinf(x),
    "isfinite": lambda x, y: torch.isfinite(x),
    "isposinf": lambda x, y: torch.isposinf(x),
    "isneginf": lambda x, y: torch.isneginf(x),
    "signbit": lambda x, y: torch.signbit(x),
    "sign": lambda x, y: torch.sign(x),
    "sgn": lambda x, y: torch.sgn(x),
    "nan_to_num": lambda x, y: torch.nan_to_num(x),
    "nan_to_num_values": lambda x, y: torch.nan_to_num(x, nan=1.5, posinf=2.5, neginf=-2.5),
    "clamp": lambda x, y: torch.clamp(x, -1.0, 1.0),
    "clamp_nan_bound": lambda x, y: torch.clamp(x, min=NAN),
    "clamp_min": lambda x, y: torch.clamp_min(x, 0.0),
    "clamp_max": lambda x, y: torch.clamp_max(x, -0.0),
    "eq_self": lambda x, y: x == x,
    "ne_self": lambda x, y: x != x,
    "lt_inf": lambda x, y: x < INF,
    "eq_nan": lambda x, y: x == NAN,
    "le_-0": lambda x, y: x <= -0.0,
    "isclose_self_equal_nan": lambda x, y: torch.isclose(x, x, equal_nan=True),
    "eq": lambda x, y: torch.eq(x, y),
    "ne": lambda x, y: torch.ne(x, y),
    "lt": lambda x, y: torch.lt(x, y),
    "le": lambda x, y: torch.le(x, y),
    "gt": lambda x, y: torch.gt(x, y),
    "ge": lambda x, y: torch.ge(x, y),
    "maximum": lambda x, y: torch.maximum(x, y),
    "minimum": lambda x, y: torch.minimum(x, y),
    "max.binary": lambda x, y: torch.max(x, y),
    "min.binary": lambda x, y: torch.min(x, y),
    "fmax": lambda x, y: torch.fmax(x, y),
    "fmin": lambda x, y: torch.fmin(x, y),
    "clamp_tensor": lambda x, y: torch.clamp(x, min=y, max=y + 1),
    "clamp_min_tensor": lambda x, y: torch.clamp(x, min=y),
    "clamp_max_tensor": lambda x, y: torch.clamp(x, max=y),
    "isclose": lambda x, y: torch.isclose(x, y),
    "isclose_equal_nan": lambda x, y: torch.isclose(x, y, rtol=0.5, atol=0.5, equal_nan=True),
    "heaviside": lambda x, y: torch.heaviside(x, y),
    "where": lambda x, y: torch.where(x > y, x, y),
    "searchsorted": lambda x, y: torch.searchsorted(torch.sort(y, -1).values, x),
    "searchsorted_right": lambda x, y: torch.searchsorted(torch.sort(y, -1).values, x, right=True),
    "bucketize": lambda x, y: torch.bucketize(x, torch.sort(y[:, 0].flatten()).values),
    "isin": lambda x, y: torch.isin(x, y[:, :2]),
    "isin_invert": lambda x, y: torch.isin(x, y, invert=True),
}

# Cases that read a value back to the host while they run (a data-dependent shape or a Python bool):
# each is a small program of its own, run before the batch so that they do not split it.
HOST = {
    "unique": lambda x, y: torch.unique(x, return_inverse=True, return_counts=True),
    "unique_consecutive": lambda x, y: torch.unique_consecutive(x, return_counts=True),
    "nonzero_isnan": lambda x, y: torch.isnan(x).nonzero(),
    "allclose": lambda x, y: torch.allclose(x, y),
    "allclose_self_equal_nan": lambda x, y: torch.allclose(x, x, equal_nan=True),
    "equal": lambda x, y: torch.equal(x, y),
    "equal_self": lambda x, y: torch.equal(x, x),
}
HOST_INPUTS = ("rows", "all_nan")
HOST_SPECS = SPECS[1:]  # sharded unevenly, and over both dims


class Case:
    """One call: ``fn(x, y)`` of the sharded (or CPU) stacks; ``canon`` maps a result (got and torch's
    alike) to what torch defines of it; ``per_input``: the result's dim 0 is the stack's (a
    mismatch then names the inputs that differ)."""

    def __init__(self, name, fn, canon=None, per_input=True):
        self.name, self.fn, self.per_input = name, fn, per_input
        self.canon = canon or (lambda out: out)


def cases(spec) -> list[Case]:
    """The cases run with the stack sharded by ``spec``."""
    out = []
    for op, fn in ALONG.items():
        for d in (d for d in (1, 2) if spec[d] is not None and spec[3 - d] is None):  # (module doc)
            out.append(Case(f"{op}(dim={d})", _along(fn, d), _along_canon(op, d)))
    for name in WHOLE_INPUTS:
        i = NAMES.index(name)
        for op, fn in WHOLE.items():
            out.append(Case(f"{op}[{name}]", _whole(fn, i), per_input=False))
    if spec == LAST_DIM_SPEC:
        out += [Case(op, fn) for op, fn in LAST_DIM.items()]
    return out


def host_cases() -> list[Case]:
    out = []
    for name in HOST_INPUTS:
        i = NAMES.index(name)
        for op, fn in HOST.items():
            out.append(Case(f"{op}[{name}]", _pick(fn, i), per_input=False))
    return out


def _along(fn, d):
    return lambda x, y: fn(x, d)


def _whole(fn, i):
    return lambda x, y: fn(x[i])


def _pick(fn, i):
    return lambda x, y: fn(x[i], y[i])


def _along_canon(op, d):
    extra = CANON.get(op)

    def canon(out):
        if op in TIES:
            out = _indices_as_values(out, d)
        return extra(X, out) if extra else out

    return canon


def _indices_as_values(out, d):
    """int64 outputs (indices along ``d`` of the stack) replaced by the values they point at."""

    def values_at(i):
        if not isinstance(i, torch.Tensor) or i.dtype != torch.int64:
            return i
        return X.take_along_dim(i if i.dim() == X.dim() else i.unsqueeze(d), d).reshape(i.shape)

    return tree_map(values_at, out)


def _cpu(out):
    return tree_map(lambda v: v.cpu() if isinstance(v, st.ShardedTensor) else v, out)


def _differs(g, w) -> str | None:
    if isinstance(w, torch.Tensor):
        if not isinstance(g, torch.Tensor) or g.dtype != w.dtype or g.shape != w.shape:
            return f"got {_describe(g)}, torch gives {_describe(w)}"
        try:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
        except AssertionError:
            return f"got {_short(g)}, torch gives {_short(w)}"
        return None
    return None if g == w else f"got {g!r}, torch gives {w!r}"


def _mismatches(case, got, want) -> list[str]:
    """What differs between ``got`` and torch's ``want``, one line per input (or one per case)."""
    try:
        got_l, want_l = tree_flatten(case.canon(_cpu(got)))[0], tree_flatten(case.canon(want))[0]
    except Exception as e:  # noqa: BLE001  (reported with the others)
        return [f"{case.name}: {type(e).__name__}: {_first_lines(e)}"]
    if len(got_l) != len(want_l):
        return [f"{case.name}: {len(got_l)} outputs, torch gives {len(want_l)}"]
    lines = []
    for k, (g, w) in enumerate(zip(got_l, want_l)):
        problem = _differs(g, w)
        if problem is None:
            continue
        if not case.per_input or not isinstance(w, torch.Tensor) or not isinstance(g, torch.Tensor):
            lines.append(f"{case.name} output {k}: {problem}")
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            lines.append(f"{case.name} output {k}: {problem}")
            continue
        for i, name in enumerate(NAMES):
            problem = _differs(g[i], w[i])
            if problem:
                lines.append(f"{case.name}[{name}] output {k}: {problem}")
    return lines


def _describe(v):
    if isinstance(v, torch.Tensor):
        return f"{tuple(v.shape)} {v.dtype}"
    return repr(v)


def _short(v):
    return " ".join(repr(v.tolist() if isinstance(v, torch.Tensor) else v).split())[:240]


def _first_lines(e):
    return " ".join(str(e).strip().splitlines()[:3])[:300]


def run_sweep(spec, compiled: bool, items=None) -> int:
    """Run ``items`` (default: ``cases(spec)``) on the stacks sharded by ``spec``, all in one lazy
    program (``compiled``: one ``st.compile`` trace), and compare each with eager torch; raises an
    AssertionError listing every case that differs. Returns how many cases were compared."""
    items = cases(spec) if items is None else items
    wants = {}
    for c in items:
        try:
            wants[c.name] = ("ok", c.fn(X, Y))
        except Exception as e:  # noqa: BLE001  (torch raises on this case: so must shardtensor)
            wants[c.name] = ("raises", type(e))

    def run(fns):
        x, y = (st.shard(t.clone(), h.mesh(), spec) for t in (X, Y))
        if compiled:
            out = st.compile(lambda x, y: [f(x, y) for f in fns])(x, y)
        else:
            out = [f(x, y) for f in fns]
        st.sync()
        return _cpu(out)

    runnable = [c for c in items if wants[c.name][0] == "ok"]
    errors, results = [], []
    try:
        results = list(zip(runnable, run([c.fn for c in runnable])))
    except Exception:  # noqa: BLE001  (the batch failed as a whole: find the cases that fail)
        for c in runnable:
            try:
                results.append((c, run([c.fn])[0]))
            except Exception as e:  # noqa: BLE001
                errors.append(f"{c.name}: raises {type(e).__name__}: {_first_lines(e)}")
    for c, got in results:
        errors += _mismatches(c, got, wants[c.name][1])
    for c in items:
        if wants[c.name][0] == "raises":
            expected = wants[c.name][1]
            try:
                run([c.fn])
            except Exception as e:  # noqa: BLE001
                if not isinstance(e, expected):
                    errors.append(f"{c.name}: raises {type(e).__name__}, torch raises {expected.__name__}")
            else:
                errors.append(f"{c.name}: torch raises {expected.__name__}, shardtensor does not")
    mode = "st.compile" if compiled else "lazy"
    assert not errors, f"{len(errors)} mismatches in {len(items)} cases ({mode}, spec {spec}):\n  " + "\n  ".join(
        errors
    )
    return len(items)
