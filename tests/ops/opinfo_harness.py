"""The OpInfo sweep, shared by ``tests/ops/test_opinfo.py`` and ``bench/op_coverage.py``.

For every entry of torch's OpInfo database that has float32 CPU samples, run its first samples (two
for ``forward``, ``backward`` and ``inplace``, one for the variant kinds) with every tensor input
sharded over a (4, 2) mesh and compare with eager torch: values with OpInfo's tolerances, dtypes
exactly. One check per *kind* (see ``KINDS``):

* ``forward``          float32, lazy mode, inputs sharded on their first dimension divisible by 4;
* ``backward``         input gradients of ``sum of float outputs``.backward(), float32, lazy mode;
* ``forward_eager``    as ``forward``, in eager mode (every op runs at once);
* ``forward_uneven``   float32, lazy, inputs sharded on their first dimension *not* divisible by 4
                       (padded storage);
* ``forward_int64`` / ``forward_bool`` / ``forward_bfloat16``  samples of that dtype, where the OpInfo
                       declares it;
* ``inplace``          the in-place variant (``x.add_``…) on a sharded input and on a view of a
                       sharded base; the mutated tensors are compared, and the op must return ``self``.

Ops that draw random numbers (an aten op tagged ``nondeterministic_seeded`` runs) can't match torch's
generator: their results are compared by shape and dtype only.

Example::

    from opinfo_harness import OPS, check_forward
    check_forward(OPS["abs"])   # raises AssertionError / the op's exception on a mismatch
"""

from __future__ import annotations

import os
import pathlib
import random

import numpy as np
import torch
from torch.testing._internal import common_utils
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import shardtensor as st
from tensor_helpers import RandomProbe

SAMPLES = int(os.environ.get("SHARDTENSOR_OPINFO_SAMPLES", "2"))
# The variant kinds (eager mode, uneven shards, int64/bool/bfloat16) re-check an op that ``forward``
# already ran on SAMPLES samples along one more axis: their first sample is enough for that axis.
VARIANT_SAMPLES = int(os.environ.get("SHARDTENSOR_OPINFO_VARIANT_SAMPLES", "1"))
EXPECTED_FILE = pathlib.Path(__file__).with_name("opinfo_expected_failures.txt")
# Floors under OpInfo's tolerances, per result dtype: XLA's CPU kernels (exp, log, tanh, dot
# reductions) differ from ATen's in the last bits, more than torch's default float32 rtol of 1.3e-6;
# bfloat16 chains round at different points (XLA keeps excess precision between fused ops).
BASE_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-5, 1e-5),
    torch.complex64: (1e-5, 1e-5),
    torch.complex128: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}

_MESH = None


def mesh():
    global _MESH
    if _MESH is None:
        _MESH = st.Mesh(range(8), (4, 2), ("x", "y"))
    return _MESH


def op_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _has_f32(op) -> bool:
    try:
        return torch.float32 in op.supported_dtypes("cpu")
    except Exception:
        return False


# jiterator_* entries claim CPU dtypes but are CUDA-only (eager torch raises on CPU).
OPS = {op_id(op): op for op in op_db if _has_f32(op) and not op.name.startswith("jiterator_")}


# ---- expected failures --------------------------------------------------------------------------


def load_expected(path=EXPECTED_FILE) -> dict[str, tuple[str, str]]:
    """test id -> (kind, reason); kind is 'xfail' (run, must fail) or 'skip' (not run: slow/hangs).

    File format, one entry a line: ``<test id> | xfail | <reason>``; '#' starts a comment.
    """
    out = {}
    if not pathlib.Path(path).exists():
        return out
    for line in pathlib.Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tid, kind, reason = (p.strip() for p in line.split("|", 2))
        assert kind in ("xfail", "skip"), line
        out[tid] = (kind, reason)
    return out


def write_expected(entries: dict[str, tuple[str, str]], path=EXPECTED_FILE):
    lines = [
        "# Expected failures of tests/ops/test_opinfo.py, one a line: <test id> | xfail|skip | <reason>.",
        "# xfail: the test runs and must fail (if it passes, the run fails until the line is removed).",
        "# skip: not run at all (slow or hangs). This file only shrinks.",
        "# Regenerate with: .venv/bin/python bench/op_coverage.py --write-expected",
    ]
    for tid in sorted(entries):
        kind, reason = entries[tid]
        reason = " ".join(reason.split())[:200].replace("|", "/")
        lines.append(f"{tid} | {kind} | {reason}")
    pathlib.Path(path).write_text("\n".join(lines) + "\n")


def failure_reason(exc: BaseException) -> str:
    """Exception type and the first line of its message, without the boilerplate tails."""
    msg = str(exc).strip().splitlines()
    first = next((m.strip() for m in msg if m.strip()), "")
    for tail in (" (and torch has no decomposition", " This could be because the operator"):
        first = first.split(tail)[0]
    first = first.replace("shardtensor has no lowering for the aten op ", "no lowering for ")
    return f"{type(exc).__name__}: {first}"


# ---- running one op -----------------------------------------------------------------------------


def _seed_cpu(seed):
    """``torch.manual_seed`` for the CPU generator only (plus ``random``/numpy, as torch's
    ``set_rng_seed``): ``torch.manual_seed`` also queues a lazy seed call for every accelerator
    module, each with a formatted stack, ~3 ms a call, a tenth of the sweep's time."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _sample_inputs(op, dtype, requires_grad):
    """``op.sample_inputs(...)``'s samples, made the same way (torch's seed before each one) without
    its tracking wrapper, which walks the whole call stack per call (a quarter of the sweep's time)."""
    samples = iter(op.sample_inputs_func(op, "cpu", dtype, requires_grad))
    while True:
        _seed_cpu(common_utils.SEED)
        try:
            yield next(samples)
        except StopIteration:
            return


def _samples(op, requires_grad=False, dtype=torch.float32, where=lambda s: True, count=SAMPLES):
    """The first ``count`` samples of ``op`` (among its first 12) for which ``where`` holds."""
    out = []
    for i, s in enumerate(_sample_inputs(op, dtype, requires_grad)):
        if i >= 12:
            break
        if where(s):
            out.append(s)
        if len(out) >= count:
            break
    return out


def _spec(t: torch.Tensor, uneven=False):
    """Shard the first dimension that divides by 4 over 'x' (``uneven``: the first that doesn't)."""
    for d, n in enumerate(t.shape):
        if (n > 1 and n % 4 != 0) if uneven else (n > 0 and n % 4 == 0):
            return tuple("x" if i == d else None for i in range(t.dim()))
    return (None,) * t.dim()


def _to_sharded(x, grad=False, uneven=False):
    if isinstance(x, torch.Tensor):
        leaf = x.requires_grad
        s = st.shard(x.detach().clone(), mesh(), _spec(x, uneven))
        if grad and leaf:
            s.requires_grad_()
        return s
    return x


def _clone_leaf(x):
    if isinstance(x, torch.Tensor):
        c = x.detach().clone()
        if x.requires_grad:
            c.requires_grad_()
        return c
    return x


def _args(sample, fn):
    return tree_map(fn, (sample.input, sample.args, sample.kwargs))


def _sharded_args(op, sample, **kw):
    """(input, args, kwargs) of ``sample`` with every tensor sharded (see ``_to_sharded``)."""
    inp = tree_map(lambda x: _to_sharded(x, **kw), sample.input)
    args = [tree_map(lambda x: _to_sharded(x, **kw), a) for a in sample.args]
    return inp, args, tree_map(lambda x: _to_sharded(x, **kw), sample.kwargs)


def _to_cpu(x):
    if isinstance(x, st.ShardedTensor):
        return x.cpu()
    return x


def _tolerances(op, dtype):
    """(rtol, atol) for results of ``dtype``: exact for integers and bools, else the floor above
    raised to OpInfo's own tolerance override for that dtype."""
    if dtype not in BASE_TOL:
        return 0.0, 0.0
    rtol, atol = BASE_TOL[dtype]
    for dec in getattr(op, "decorators", ()) or ():
        decs = getattr(dec, "decorators", (dec,))
        if not isinstance(decs, (list, tuple)):
            decs = (decs,)
        for d in decs:
            table = getattr(d, "d", None)
            if isinstance(table, dict) and dtype in table:
                tol = table[dtype]
                if hasattr(tol, "atol") and hasattr(tol, "rtol"):
                    atol, rtol = max(atol, tol.atol), max(rtol, tol.rtol)
    return rtol, atol


def _compare(got, want, op, what, values=True, exact=None):
    """Compare ``got`` (sharded results) with torch's ``want``. ``exact``: for low-precision dtypes,
    the same op computed in float64 (see ``_exact_reference``); an element then also passes when it
    is within the tolerance of that exact value rounded to the result dtype, because torch's own
    bf16/f16 kernels round differently on each CPU (AVX2, AVX-512, AMX) and are no fixed standard."""
    got_l, _ = tree_flatten(tree_map(_to_cpu, got))
    want_l, _ = tree_flatten(want)
    exact_l = tree_flatten(exact)[0] if exact is not None else [None] * len(want_l)
    if len(exact_l) != len(want_l):
        exact_l = [None] * len(want_l)
    assert len(got_l) == len(want_l), f"{what}: {len(got_l)} outputs, torch gives {len(want_l)}"
    for i, (g, w, e) in enumerate(zip(got_l, want_l, exact_l)):
        if isinstance(w, torch.Tensor):
            rtol, atol = _tolerances(op, w.dtype)
            assert isinstance(g, torch.Tensor), f"{what}[{i}]: got {type(g).__name__}, torch gives a tensor"
            assert g.dtype == w.dtype, f"{what}[{i}]: dtype {g.dtype}, torch gives {w.dtype}"
            if w.layout != torch.strided:
                assert g.layout == w.layout, f"{what}[{i}]: layout {g.layout}, torch gives {w.layout}"
                g, w = g.to_dense(), w.to_dense()
            if not values:  # random or uninitialised results: shape and dtype only
                assert g.shape == w.shape, f"{what}[{i}]: shape {tuple(g.shape)}, torch gives {tuple(w.shape)}"
                continue
            w = _closer_of(g.detach(), w.detach(), e, rtol, atol)
            torch.testing.assert_close(
                g.detach(), w, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m, i=i: f"{what}[{i}]: {m}"
            )
        elif isinstance(w, float) and isinstance(g, float):
            if values:
                torch.testing.assert_close(
                    g, w, rtol=BASE_TOL[torch.float32][0], atol=BASE_TOL[torch.float32][1], equal_nan=True
                )
        elif w is not None and values:
            assert g == w, f"{what}[{i}]: {g!r} != {w!r}"


LOW_PRECISION = (torch.bfloat16, torch.float16)


def _closer_of(got, want, exact, rtol, atol):
    """``want``, except where ``got`` misses it but ``exact`` (a float64 reference) rounded to
    ``want``'s dtype is a valid target for that element."""
    if (
        not isinstance(exact, torch.Tensor)
        or want.dtype not in LOW_PRECISION
        or exact.shape != want.shape
        or not exact.dtype.is_floating_point
    ):
        return want
    near_torch = torch.isclose(got.double(), want.double(), rtol=rtol, atol=atol, equal_nan=True)
    return torch.where(near_torch, want, exact.to(want.dtype))


def _widened(sample, dtype):
    """The sample with its ``dtype`` input widened to float64, as ``_exact_reference`` runs it."""
    inp = sample.input
    if isinstance(inp, torch.Tensor) and inp.dtype == dtype:
        inp = inp.detach().double()
    return type("Widened", (), {"input": inp, "args": sample.args, "kwargs": sample.kwargs})()


def _exact_reference(op, sample, dtype):
    """The op on the sample with its ``dtype`` tensors widened to float64 (None if torch refuses)."""

    def widen(x):
        if isinstance(x, torch.Tensor) and x.dtype == dtype:
            return x.detach().double()
        return x

    try:
        with torch.random.fork_rng(devices=[]):
            _seed_cpu(0)
            inp, args, kwargs = _args(sample, widen)
            return op(inp, *args, **kwargs)
    except Exception:  # noqa: BLE001  (an op without float64 kernels: torch's result is the reference)
        return None


# Results not determined by the inputs: only shapes and dtypes are compared.
UNINITIALISED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}


def _eager(fn, sample, seed=0):
    """Run ``fn`` on CPU copies of the sample: (result, whether it drew random numbers)."""
    probe = RandomProbe()
    with torch.random.fork_rng(devices=[]):
        _seed_cpu(seed)
        inp, args, kwargs = _args(sample, _clone_leaf)
        with probe:
            out = fn(inp, *args, **kwargs)
    return out, probe.random


def _deterministic(op, sample, want) -> bool:
    """False for ops whose result is random (a second eager run with another seed differs) or garbage."""
    if op.name in UNINITIALISED:
        return False
    again, _ = _eager(op, sample, seed=12345)
    a, _ = tree_flatten(again)
    b, _ = tree_flatten(want)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.layout == torch.strided:
            try:
                torch.testing.assert_close(x.detach(), y.detach(), rtol=0, atol=0, equal_nan=True)
            except AssertionError:
                return False
            except Exception:  # noqa: BLE001  (dtype without comparison kernels: assume deterministic)
                pass
    return True


# ---- outputs torch leaves open -------------------------------------------------------------------
# Where torch does not define an output, both sides are mapped to what it does define before they are
# compared: the indices of tied values (sort, argsort, topk, kthvalue, median, mode; torch's CPU sort
# and selection kernels differ per instruction set) become the values they point at; eigenvectors and
# singular vectors (any sign or phase, any basis of a repeated value) become the matrix they multiply
# back to; QR's factors get R's diagonal made real and positive (unique for a full-rank input). The
# maps are differentiable where they apply to float outputs, so the backward check's loss is one that
# does not depend on the choice either. argmax / argmin and max / min with a dim are not here: torch
# documents that they return the first of tied values.


def _dim_arg(position, default=-1):
    """The ``dim`` of a sample: ``kwargs['dim']``, else ``args[position]`` if it is an int."""

    def dim(sample):
        if "dim" in sample.kwargs:
            return sample.kwargs["dim"]
        args = sample.args
        if len(args) > position and isinstance(args[position], int) and not isinstance(args[position], bool):
            return args[position]
        return default

    return dim


def _pointed_at(dim_of):
    """Integer outputs (indices into the input along ``dim``) replaced by the input's values there."""

    def canon(sample, out):
        inp = sample.input.detach()
        dim = dim_of(sample)

        def values_at(t):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
                return t
            if inp.dim() == 0:
                return inp.expand(t.shape)
            index = t if t.dim() == inp.dim() else t.unsqueeze(dim)
            return inp.take_along_dim(index, dim).reshape(t.shape)

        return tree_map(values_at, out)

    return canon


def _mH(a):
    return a.mH if a.is_complex() else a.mT


def _eigh(sample, out):
    values, vectors = out
    return values, (vectors * values.unsqueeze(-2).to(vectors.dtype)) @ _mH(vectors)


def _eig(sample, out):
    values, vectors = out
    order = values.imag.argsort(dim=-1, stable=True)  # by real part, then imaginary part
    order = order.gather(-1, values.real.gather(-1, order).argsort(dim=-1, stable=True))
    return values.gather(-1, order), (vectors * values.unsqueeze(-2)) @ torch.linalg.inv(vectors)


def _eigvals(sample, out):
    order = out.imag.argsort(dim=-1, stable=True)
    order = order.gather(-1, out.real.gather(-1, order).argsort(dim=-1, stable=True))
    return out.gather(-1, order)


def _svd(vh_is_v):
    def canon(sample, out):
        u, s, v = out
        k = s.shape[-1]
        vh = _mH(v) if vh_is_v else v
        return s, (u[..., :k] * s.unsqueeze(-2).to(u.dtype)) @ vh[..., :k, :]

    return canon


def _qr(sample, out):
    q, r = out
    k = min(r.shape[-2], r.shape[-1])
    diag = r.diagonal(dim1=-2, dim2=-1)[..., :k].detach()
    phase = torch.where(diag == 0, torch.ones_like(diag), diag / diag.abs())
    r = r[..., :k, :] * phase.conj().unsqueeze(-1) if r.is_complex() else r[..., :k, :] * phase.unsqueeze(-1)
    if q.numel() == 0:  # mode='r'
        return q, r
    return q[..., :k] * phase.unsqueeze(-2), r


OPEN_OUTPUTS = {
    "sort": _pointed_at(_dim_arg(0)),
    "argsort": _pointed_at(_dim_arg(0)),
    "topk": _pointed_at(_dim_arg(1)),
    "kthvalue": _pointed_at(_dim_arg(1)),
    "median": _pointed_at(_dim_arg(0)),
    "nanmedian": _pointed_at(_dim_arg(0)),
    "mode": _pointed_at(_dim_arg(0)),
    "linalg.eigh": _eigh,
    "linalg.eig": _eig,
    "linalg.eigvals": _eigvals,
    "linalg.svd": _svd(vh_is_v=False),
    "svd": _svd(vh_is_v=True),
    "linalg.qr": _qr,
    "qr": _qr,
}


_INDICES = {"sort", "argsort", "topk", "kthvalue", "median", "nanmedian", "mode"}


def _defined(op, sample, out, for_loss=False):
    """``out`` mapped to what torch defines of it (see ``OPEN_OUTPUTS``); other ops' results as they
    are. ``for_loss``: only the maps of float outputs (indices never enter the backward's loss)."""
    canon = OPEN_OUTPUTS.get(op.name)
    if canon is None or out is None or (for_loss and op.name in _INDICES):
        return out
    return canon(sample, out)


def _run_sharded(op, fn, sample, uneven=False, eager=False):
    inp, args, kwargs = _sharded_args(op, sample, uneven=uneven)
    with st.eager_mode(eager):
        return fn(inp, *args, **kwargs)


def check_forward(op, dtype=torch.float32, eager=False, uneven=False):
    """Compare the op on sharded inputs with eager torch; returns how many samples were compared."""

    def has_uneven_dim(sample):
        return any(_spec(t, True) != (None,) * t.dim() for t in _tensors(sample))

    variant = eager or uneven or dtype != torch.float32
    samples = _samples(
        op,
        dtype=dtype,
        where=has_uneven_dim if uneven else lambda s: True,
        count=VARIANT_SAMPLES if variant else SAMPLES,
    )
    checks = []
    for k, sample in enumerate(samples):
        want, drew_random = _eager(op, sample)
        values = not drew_random and _deterministic(op, sample, want)
        exact = _exact_reference(op, sample, dtype) if dtype in LOW_PRECISION and values else None
        got = _run_sharded(op, op, sample, uneven=uneven, eager=eager)
        checks.append((sample, got, want, f"sample {k} output", values, exact))
    # compared after every sample ran: in lazy mode all samples compile and run as one program
    for sample, got, want, what, values, exact in checks:
        got, want = _defined(op, sample, tree_map(_to_cpu, got)), _defined(op, sample, want)
        if exact is not None:
            exact = _defined(op, _widened(sample, dtype), exact)
        _compare(got, want, op, what, values=values, exact=exact)
    return len(samples)


def _tensors(sample):
    return [t for t in tree_flatten(_args(sample, lambda x: x))[0] if isinstance(t, torch.Tensor)]


def check_inplace(op):
    """The in-place variant on a sharded input and on a view of a sharded base, against torch."""
    fn = op.inplace_variant
    ran, checks = 0, []
    for k, sample in enumerate(_samples(op)):
        if sample.broadcasts_input or not isinstance(sample.input, torch.Tensor):
            continue
        try:
            want, drew_random = _eager(fn, sample)
        except Exception as torch_error:  # noqa: BLE001  (torch refuses this sample in place: so must we)
            try:
                _run_sharded(op, fn, sample)
            except Exception:  # noqa: BLE001
                continue
            raise AssertionError(f"sample {k}: torch raises in place, shardtensor does not") from torch_error
        values = not drew_random
        inp, args, kwargs = _sharded_args(op, sample)
        got = fn(inp, *args, **kwargs)
        assert got is inp, f"sample {k}: the in-place variant must return its input"
        checks.append((inp, want, f"sample {k} input", values))
        if sample.input.dim() >= 1:  # the same through a view: the base sees the write
            base_ref = torch.stack([sample.input.detach().clone()] * 2)
            base = st.shard(base_ref.clone(), mesh(), _spec(base_ref))
            _, ref_args, ref_kwargs = _args(sample, _clone_leaf)
            with torch.random.fork_rng(devices=[]):
                _seed_cpu(0)
                fn(base_ref[1], *ref_args, **ref_kwargs)
            fn(base[1], *args, **kwargs)
            checks.append((base, base_ref, f"sample {k} base of the view", values))
        ran += 1
    for got, want, what, values in checks:  # one program for every sample
        _compare(got, want, op, what, values=values)
    return ran


def _float_leaves(tree):
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _loss(out):
    outs = [
        o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad
    ]
    if not outs:
        return None
    total = outs[0].sum()
    for o in outs[1:]:
        total = total + o.sum()
    return total


def check_backward(op):
    samples = _samples(op, requires_grad=True)
    checks = []
    for k, sample in enumerate(samples):
        probe = RandomProbe()
        ref = _args(sample, _clone_leaf)
        with torch.random.fork_rng(devices=[]), probe:
            _seed_cpu(0)
            loss = _loss(_defined(op, sample, op(ref[0], *ref[1], **ref[2]), for_loss=True))
        if loss is None:
            continue
        leaves_ref = _float_leaves(ref)
        loss.backward()
        sh = _sharded_args(op, sample, grad=True)
        leaves_sh = _float_leaves(sh)
        loss_sh = _loss(_defined(op, sample, op(sh[0], *sh[1], **sh[2]), for_loss=True))
        assert loss_sh is not None, f"sample {k}: no differentiable output"
        loss_sh.backward()
        want = [t.grad for t in leaves_ref]
        got = [t.grad for t in leaves_sh]
        checks.append((got, want, f"sample {k} grad", not probe.random))
    for got, want, what, values in checks:  # one program for every sample's backward
        _compare(got, want, op, what, values=values)
    return len(checks)


def _declares(dtype):
    return lambda op: dtype in op.supported_dtypes("cpu")


# kind -> (does the entry have this check?, the check). Test ids are ``test_<kind>[<op id>]``.
KINDS = {
    "forward": (lambda op: True, check_forward),
    "backward": (lambda op: op.supports_autograd, check_backward),
    "forward_eager": (lambda op: True, lambda op: check_forward(op, eager=True)),
    "forward_uneven": (lambda op: True, lambda op: check_forward(op, uneven=True)),
    "forward_int64": (_declares(torch.int64), lambda op: check_forward(op, dtype=torch.int64)),
    "forward_bool": (_declares(torch.bool), lambda op: check_forward(op, dtype=torch.bool)),
    "forward_bfloat16": (_declares(torch.bfloat16), lambda op: check_forward(op, dtype=torch.bfloat16)),
    "inplace": (lambda op: op.inplace_variant is not None, check_inplace),
}


def ids_of(kind) -> list[str]:
    """The op ids that have a ``kind`` check."""
    applies = KINDS[kind][0]
    return sorted(i for i, op in OPS.items() if applies(op))


# ---- families -----------------------------------------------------------------------------------


def family(op) -> str:
    """Which shardtensor/ops/<family>.py lowers the first aten op the OpInfo entry hits in eager torch;
    'decomposed' if that op has no lowering but a torch decomposition, 'other' otherwise."""
    import torch._decomp

    from shardtensor.ops.registry import lookup

    hits = []

    class Rec(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            hits.append(func)
            return func(*args, **(kwargs or {}))

    try:
        s = next(iter(op.sample_inputs("cpu", torch.float32)))
        with Rec():
            op(s.input, *s.args, **s.kwargs)
    except Exception:
        pass
    skip = {
        "detach",
        "clone",
        "_to_copy",
        "copy_",
        "empty",
        "lift_fresh",
        "alias",
        "view",
        "t",
        "expand",
        "empty_like",
        "zeros",
        "full",
        "scalar_tensor",
        "_local_scalar_dense",
        "new_empty",
        "fill_",
        "zero_",
    }
    primary = next((f for f in hits if f.__name__.split(".")[0] not in skip), hits[0] if hits else None)
    if primary is None:
        return "other"
    entry = lookup(primary)
    if entry is not None:
        return entry.fn.__module__.rsplit(".", 1)[-1]
    if primary in torch._decomp.core_aten_decompositions():
        return "decomposed"
    return "other"
