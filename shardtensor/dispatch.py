"""What ``ShardedTensor.__torch_dispatch__`` does with one aten op.

Functional ops are looked up in the lowering table and recorded as a graph node (run at once in eager
mode); in-place and ``out=`` ops run their functional twin and write the result back; view ops add a
step to the view chain; a few ops (device copies, ``.item()``, data-dependent shapes) are special.
Output shapes and dtypes come from torch's meta kernels, memoised per op signature.
"""
from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np
import torch
from jax._src.lax.lax import _convert_element_type

from shardtensor import lazy, rng, views
from shardtensor import metrics as counters
from shardtensor.dtypes import to_jax, to_torch
from shardtensor.ops import lookup
from shardtensor.ops.registry import register
from shardtensor.storage import Cell, Failed, Node, Pending, ScalarLeaf
from shardtensor.tensor import ShardedTensor, contiguous_strides

aten = torch.ops.aten


# --- schema facts, memoised per overload ----------------------------------------------------------
@dataclasses.dataclass
class OpFacts:
    scalar_slots: frozenset  # positions / names of Scalar, Scalar[] or Tensor arguments
    mutated: tuple  # names of arguments the op writes (a!)
    out_names: tuple  # names of out= arguments
    arg_names: tuple
    is_view: bool
    functional: object = None  # the overload to run for a mutating op
    functional_by_name: bool = False  # its arguments come in another order: pass them by name


_FACTS: dict = {}


def facts(func) -> OpFacts:
    f = _FACTS.get(func)
    if f is None:
        f = _FACTS[func] = _make_facts(func)
    return f


def _make_facts(func) -> OpFacts:
    schema = func._schema
    slots, mutated, outs, names = set(), [], [], []
    for i, a in enumerate(schema.arguments):
        names.append(a.name)
        kind = str(a.type)  # a Scalar prints as "number"
        if "number" in kind or "Scalar" in kind or "Tensor" in kind:
            # a Python number in a Scalar or Tensor slot (x / 0.93 reaches us as div.Tensor) is a
            # runtime input, so a value that changes each step does not recompile
            slots.update((i, a.name))
        if a.alias_info is not None and a.alias_info.is_write:
            mutated.append(a.name)
            if a.is_out:
                outs.append(a.name)
    f = OpFacts(frozenset(slots), tuple(mutated), tuple(outs), tuple(names), bool(func.is_view) and not mutated)
    if mutated:
        f.functional = _functional_twin(func, f)
        if f.functional is not None:
            mine = [n for n in f.arg_names if n not in f.out_names]
            theirs = [a.name for a in f.functional._schema.arguments]
            f.functional_by_name = theirs[:len(mine)] != mine[:len(theirs)]
    return f


def _functional_twin(func, f: OpFacts):
    """``add_.Tensor`` -> ``add.Tensor``; ``sum.IntList_out`` -> ``sum.dim_IntList``;
    ``_native_batch_norm_legit`` -> ``_native_batch_norm_legit_functional``."""
    name = func._schema.name.split("::")[1]
    inplace = name.endswith("_") and not name.endswith("__")
    candidates = []
    if inplace:
        candidates += [name[:-1], name[:-1] + "_functional"]
    elif not f.out_names:
        candidates.append(name + "_functional")
    else:
        candidates.append(name)
    wanted = sorted(_signature_of(a) for a in func._schema.arguments if not a.is_out)
    for cand in candidates:
        packet = getattr(aten, cand, None)
        if packet is None:
            continue
        overloads = [func._overloadname] + [o for o in packet.overloads() if o != func._overloadname]
        for o in overloads:
            op = getattr(packet, o, None)
            if op is None:
                continue
            args = op._schema.arguments
            if any(a.alias_info is not None and a.alias_info.is_write for a in args):
                continue
            if sorted(_signature_of(a) for a in args) == wanted:  # same names and types, any order
                return op
    return None


def _signature_of(arg):
    return arg.name, str(arg.type).replace("Optional[", "").replace("]", "")


# --- turning arguments into a template (static, hashable) and dynamic references ------------------
def _encode(value, is_scalar_slot, static_scalars, refs):
    if isinstance(value, ShardedTensor):
        refs.append(views.read(value))
        return ("T", value.shape, value.dtype, value.stride(), value.storage_offset())
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and value.device.type == "cpu":
            refs.append(ScalarLeaf(value.item()))
            return ("C", value.dtype)
        raise _device_mismatch(value)
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, torch.Tensor) for v in value):
            return ("L", tuple(_encode(v, False, False, refs) for v in value))
        if is_scalar_slot and not static_scalars and value and not isinstance(value[0], (list, tuple)):
            refs.extend(ScalarLeaf(v) for v in value)
            return ("SL", len(value))
        return ("X", tuple(value))
    if is_scalar_slot and not static_scalars and isinstance(value, (int, float, bool, complex)):
        refs.append(ScalarLeaf(value))
        return ("S", type(value))
    if isinstance(value, torch.Generator):
        return ("X", None)
    return ("X", value)


def _device_mismatch(value):
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{value.device} and shardtensor:0! Move the {value.device} tensor with .to(st.device()) "
        "or st.shard(t, mesh, spec) first."
    )


def _decode(entry, it):
    kind = entry[0]
    if kind == "T" or kind == "S":
        return next(it)
    if kind == "X":
        v = entry[1]
        return list(v) if isinstance(v, tuple) else v
    if kind == "C":
        return _convert_element_type(next(it), to_jax(entry[1]), weak_type=True)
    if kind == "L":
        return [None if e == ("X", None) else _decode(e, it) for e in entry[1]]
    if kind == "SL":
        return [next(it) for _ in range(entry[1])]
    raise AssertionError(entry)


def _flatten(func, args, kwargs, static_scalars=False):
    f = facts(func)
    refs = []
    slots = f.scalar_slots
    pos = tuple(_encode(a, i in slots, static_scalars, refs) for i, a in enumerate(args))
    kw = tuple((k, _encode(v, k in slots, static_scalars, refs)) for k, v in kwargs.items())
    return (pos, kw), refs


# --- plans: everything about an op signature that does not depend on values ------------------------
@dataclasses.dataclass
class Plan:
    caller: object
    key: tuple
    outs: tuple  # (shape, dtype) or None per flat output
    structure: str  # "one" | "tuple" | "list"
    random: bool


_PLANS: dict = {}


def plan_for(func, template, args, kwargs, lowering) -> Plan:
    key = (func, template)
    p = _PLANS.get(key)
    if p is None:
        p = _PLANS[key] = _make_plan(func, template, args, kwargs, lowering)
    return p


def _meta(value):
    if isinstance(value, ShardedTensor):
        return meta_like(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v) for v in value)
    if isinstance(value, torch.device) and value.type != "cpu":
        return torch.device("meta")
    return value


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with the shape, dtype, strides and storage offset of ``t``."""
    shape, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
    size = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if all(shape) else offset
    storage = torch.empty(max(size, 0), dtype=t.dtype, device="meta")
    return storage.as_strided(shape, stride, offset)


def meta_outputs(func, args, kwargs):
    """Run torch's meta kernel: the shapes and dtypes torch gives, and the output structure."""
    margs = [_meta(a) for a in args]
    mkw = {k: _meta(v) for k, v in kwargs.items()}
    with torch._C._DisableTorchDispatch():
        out = func(*margs, **mkw)
    if out is None:
        return (), "none"
    if isinstance(out, torch.Tensor):
        return (_describe(out),), "one"
    structure = "list" if isinstance(out, list) else "tuple"
    return tuple(None if o is None else _describe(o) for o in out), structure


def _describe(t):
    """(shape, dtype, strides, storage offset) of a meta result."""
    return tuple(t.shape), t.dtype, t.stride(), t.storage_offset()


class _TensorSlot:
    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index


def _outputs_from_lowering(func, lowering, args, kwargs):
    """Output metadata from the lowering itself (``jax.eval_shape``), for the few ops torch has no
    meta kernel for (geqrf, linalg_lstsq): contiguous results of the shapes and dtypes it returns."""

    tensors = []  # only tensors are traced: ints, bools and floats stay Python values, as in a real call

    def abstract(v):
        if isinstance(v, ShardedTensor):
            tensors.append(jax.ShapeDtypeStruct(tuple(v.shape), to_jax(v.dtype)))
            return _TensorSlot(len(tensors) - 1)
        if isinstance(v, (list, tuple)):
            return type(v)(abstract(x) for x in v)
        return v

    def fill(v, values):
        if isinstance(v, _TensorSlot):
            return values[v.index]
        if isinstance(v, (list, tuple)):
            return type(v)(fill(x, values) for x in v)
        return v

    a, k = [abstract(x) for x in args], {n: abstract(v) for n, v in kwargs.items()}

    def run(*values):
        pos, kw = fill(a, values), {n: fill(v, values) for n, v in k.items()}
        return lowering.fn(jax.random.key(0), *pos, **kw) if lowering.random else lowering.fn(*pos, **kw)

    out = jax.eval_shape(run, *tensors)
    structure = "tuple" if isinstance(out, (tuple, list)) else "one"
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple((tuple(o.shape), to_torch(o.dtype), contiguous_strides(tuple(o.shape)), 0) for o in outs), structure


def _make_plan(func, template, args, kwargs, lowering) -> Plan:
    try:
        outs, structure = meta_outputs(func, args, kwargs)
    except NotImplementedError:  # no meta kernel in torch
        outs, structure = _outputs_from_lowering(func, lowering, args, kwargs)
    if getattr(lowering.fn, "dtypes_from_lowering", False):
        # torch's CPU kernel gives other dtypes than its meta kernel (bf16 norms' statistics)
        mine, _ = _outputs_from_lowering(func, lowering, args, kwargs)
        outs = tuple(o if o is None else (o[0], m[1]) + tuple(o[2:]) for o, m in zip(outs, mine))
    expected = tuple(None if o is None else to_jax(o[1]) for o in outs)
    fn, random = lowering.fn, lowering.random
    pos_t, kw_t = template

    def caller(*values):
        it = iter(values)
        if random:
            key, sub = jax.random.split(next(it))
        a = [_decode(e, it) for e in pos_t]
        k = {name: _decode(e, it) for name, e in kw_t}
        out = fn(sub, *a, **k) if random else fn(*a, **k)
        if not isinstance(out, (tuple, list)):
            out = (out,)
        out = tuple(None if d is None else (o if o.dtype == d else o.astype(d)) for o, d in zip(out, expected))
        return out + (key,) if random else out

    return Plan(caller, (func, template), outs, structure, random)


# --- the entry point ------------------------------------------------------------------------------
def handle(func, args, kwargs):
    try:
        special = _SPECIAL.get(func)
        if special is not None:
            return special(func, args, kwargs)
        f = facts(func)
        if f.is_view:
            return _view_op(func, args, kwargs)
        if f.mutated:
            return _mutating_op(func, f, args, kwargs)
        return _record_and_wrap(func, args, kwargs)
    except BaseException as e:
        from shardtensor import torch_device

        if torch_device.CPP_GUARD or torch._C._current_autograd_node() is None:
            raise
        # Only without the C++ device guard: an exception leaving __torch_dispatch__ inside
        # backward would abort the process (torch's Python guard runs with the error still set).
        # Keep it, finish backward with zeros, and let the engine wrapper raise it afterwards.
        _remember_for_backward(e)
        return _placeholder(func, args, kwargs)


def record(func, args, kwargs):
    """Record ``func`` on these arguments; returns (output references, plan)."""
    lowering = lookup(func)
    if lowering is None:
        return _fallback(func, args, kwargs)
    template, refs = _flatten(func, args, kwargs, lowering.static_scalars)
    plan = plan_for(func, template, args, kwargs, lowering)
    if plan.random:
        refs.insert(0, rng.current())
    node = Node(plan.caller, plan.key, tuple(refs))
    n = len(plan.outs)
    out_refs = [None if o is None else Pending(node, i) for i, o in enumerate(plan.outs)]
    if plan.random:
        rng.advance(Pending(node, n))
    return out_refs, plan


class _Decomposed(Exception):
    def __init__(self, result):
        self.result = result


_DECOMPOSITIONS = None


def _decomposition(func):
    global _DECOMPOSITIONS
    if _DECOMPOSITIONS is None:
        import torch._decomp

        # torch's whole table, with the core-aten choices winning. core_aten_decompositions() is a
        # lazily filled CustomDecompTable whose .get() misses entries that [] finds: copy it out.
        table = dict(torch._decomp.decomposition_table)
        table.update(torch._decomp.core_aten_decompositions().items())
        _DECOMPOSITIONS = table
    return _DECOMPOSITIONS.get(func)


def _fallback(func, args, kwargs):
    decomp = _decomposition(func)
    if decomp is not None:
        counters.increment(f"Decomposition::{func}")
        raise _Decomposed(decomp(*args, **kwargs))
    out = func.decompose(*args, **kwargs)
    if out is not NotImplemented:
        counters.increment(f"Decomposition::{func}")
        raise _Decomposed(out)
    raise NotImplementedError(
        f"shardtensor has no lowering for the aten op {func} (and torch has no decomposition for it). "
        "Please report it; as a workaround move the tensors to CPU with .cpu() for this op."
    )


def _wrap(func, out_refs, plan=None):
    if plan is None:
        return out_refs  # a decomposition already produced the result
    cells, outs = _new_tensors(out_refs, plan.outs)
    if lazy.STATE.eager:
        if plan.random or len(cells) != len(out_refs):
            lazy.run_cells(cells + rng.pending_cells())
        else:
            lazy.run_single_node(out_refs[0].node, cells)
    if plan.structure == "one":
        return outs[0]
    return list(outs) if plan.structure == "list" else tuple(outs)


def _record_and_wrap(func, args, kwargs):
    try:
        return _wrap(func, *record(func, args, kwargs))
    except _Decomposed as d:
        return d.result


def _view_op(func, args, kwargs):
    base, lowering = args[0], lookup(func)
    if not isinstance(base, ShardedTensor) or lowering is None:
        return _record_and_wrap(func, args, kwargs)
    template, refs = _flatten(func, args, kwargs, lowering.static_scalars)
    if len(refs) != 1:  # a view with other dynamic inputs: compute it as a copy
        return _record_and_wrap(func, args, kwargs)
    plan = plan_for(func, template, args, kwargs, lowering)
    outs = []
    for i, meta in enumerate(plan.outs):
        step = views.ViewStep(func, tuple(args[1:]), kwargs, plan.caller, i, (plan.key, i), base.shape, meta[0])
        outs.append(ShardedTensor(base._cell, meta[0], meta[1], chain=base._chain + (step,),
                                  strides=meta[2], storage_offset=meta[3]))
    if plan.structure == "one":
        return outs[0]
    return list(outs) if plan.structure == "list" else tuple(outs)


def _alias(func, args, kwargs):
    t = args[0]
    return ShardedTensor(t._cell, t.shape, t.dtype, chain=t._chain, strides=t.stride(),
                         storage_offset=t.storage_offset())


_CHECKED: set = set()  # (mutating op, functional signature) pairs torch's meta kernel accepted


def _mutating_op(func, f: OpFacts, args, kwargs):
    if f.functional is None:
        return _record_and_wrap(func, args, kwargs)
    bound = dict(zip(f.arg_names, args))
    bound.update(kwargs)
    targets = [bound[name] for name in f.mutated]
    flat_targets = []
    for t in targets:
        flat_targets.extend(t if isinstance(t, (list, tuple)) else [t])
    for x in flat_targets:
        if isinstance(x, torch.Tensor) and not isinstance(x, ShardedTensor):
            raise _device_mismatch(x)
    args = _with_defaults(func, args, kwargs)  # torch drops trailing arguments equal to their default
    fargs = [a for name, a in zip(f.arg_names, args) if name not in f.out_names]
    fkw = {k: v for k, v in kwargs.items() if k not in f.out_names}
    if f.functional_by_name:  # e.g. polygamma_(self, n) vs polygamma(n, self)
        fkw.update({name: a for name, a in zip(f.arg_names, args) if name not in f.out_names})
        fargs = []
    meta_ran = True  # torch's meta kernel ran now (and gave its warnings)
    try:
        refs, plan = record(f.functional, fargs, fkw)
        metas = plan.outs
        checked = (func, plan.key, tuple((x.shape, x.dtype) for x in flat_targets))
        meta_ran = checked not in _CHECKED
        if meta_ran:  # torch's own checks (broadcast into self, casts), once
            meta_outputs(func, args, kwargs)
            _CHECKED.add(checked)
    except _Decomposed as d:
        meta_outputs(func, args, kwargs)
        result = d.result
        flat = [result] if isinstance(result, torch.Tensor) else list(result)
        refs = [views.read(r) for r in flat]
        metas = [(tuple(r.shape), r.dtype, r.stride(), 0) for r in flat]
    functional_variant = not (_is_inplace(func) or f.out_names)  # e.g. _native_batch_norm_legit
    n_returned = len(refs) - len(flat_targets) if functional_variant else 0
    written, written_metas = refs[n_returned:], metas[n_returned:]
    cells = []
    outs = {id(x) for name in f.out_names for x in (bound[name] if isinstance(bound[name], (list, tuple))
                                                    else [bound[name]])}
    for t, ref, meta in zip(flat_targets, written, written_metas):
        if tuple(meta[0]) != tuple(t.shape):
            if id(t) not in outs:
                raise RuntimeError(f"{func}: result of shape {tuple(meta[0])} cannot be written into a tensor "
                                   f"of shape {tuple(t.shape)}")
            # out= tensors of another shape are resized, as torch does (it warns if they were not empty)
            shape = tuple(meta[0])
            if t.numel() and not meta_ran:
                warnings.warn(f"An output with one or more elements was resized since it had shape {list(t.shape)}, "
                              f"which does not match the required output shape {list(shape)}. This behavior is "
                              "deprecated, and in a future PyTorch release outputs will not be resized unless they "
                              "have zero elements. You can explicitly reuse an out tensor t by resizing it, "
                              "inplace, to zero elements with t.resize_(0).", UserWarning, stacklevel=3)
            geometry.resize_to(func, t, shape, meta[2] if len(meta) > 2 and meta[2] else contiguous_strides(shape), 0)
        if meta[1] != t.dtype:
            ref = _cast(ref, t.dtype)
        views.write(t, ref)
        cells.append(t._cell)
    returned = []
    if functional_variant:
        new_cells, returned = _new_tensors(refs[:n_returned], metas[:n_returned])
        cells += [c for c in new_cells if c is not None]
    if lazy.STATE.eager:  # one run: a second would find the rng key donated by the first
        lazy.run_cells(cells + rng.pending_cells())
    if functional_variant:  # e.g. rrelu_with_noise: writes `noise`, returns one tensor
        return returned[0] if len(func._schema.returns) == 1 else tuple(returned)
    returns = func._schema.returns
    if not returns:
        return None
    if len(returns) == 1:
        return targets[0]
    return tuple(targets)


def _with_defaults(func, args, kwargs):
    """``args`` with the positional arguments torch left out (equal to their defaults) filled in, so a
    functional twin whose argument has no default (``bernoulli.p``) gets it."""
    schema_args = [a for a in func._schema.arguments if not a.kwarg_only]
    if len(args) >= len(schema_args):
        return args
    missing = schema_args[len(args):]
    if any(a.name in kwargs or not a.has_default_value() for a in missing):
        return args
    return tuple(args) + tuple(a.default_value for a in missing)


def _is_inplace(func):
    name = func._schema.name
    return name.endswith("_") and not name.endswith("__")


def _wrap_refs(refs, metas):
    cells, outs = _new_tensors(refs, metas)
    if lazy.STATE.eager:
        lazy.run_cells(cells)
    return tuple(outs)


def _new_tensors(refs, metas):
    """A fresh pending Cell and ShardedTensor per output reference (None stays None)."""
    cells, outs = [], []
    for ref, meta in zip(refs, metas):
        if ref is None:
            outs.append(None)
            continue
        cell = Cell(ref, meta[0], meta[1])
        lazy.set_pending(cell, ref)
        cells.append(cell)
        outs.append(ShardedTensor(cell, strides=meta[2] if len(meta) > 2 else None))
    return cells, outs


def zeros(shape, dtype) -> ShardedTensor:
    """A lazily created zero tensor (what ``torch.empty`` gives on st.device())."""
    jd = to_jax(dtype)
    node = Node(lambda: (jax.numpy.zeros(shape, jd),), ("zeros", shape, dtype), ())
    ref = Pending(node, 0)
    cell = Cell(ref, shape, dtype)
    lazy.set_pending(cell, ref)
    if lazy.STATE.eager:
        lazy.run_cells([cell])
    return ShardedTensor(cell)


def _cast(ref, dtype):
    jd = to_jax(dtype)
    node = Node(lambda x: (x.astype(jd),), ("cast", dtype), (ref,))
    return Pending(node, 0)


# --- materialising values -------------------------------------------------------------------------
def materialize(t: ShardedTensor):
    """The concrete stored jax array of ``t`` (computing what is pending)."""
    cell = t._cell
    if t._chain:
        ref = views.read(t)
        tmp = Cell(ref, t.shape, t.dtype)
        lazy.set_pending(tmp, ref)
        cell = tmp
    if cell.is_pending():
        lazy.check_execution_allowed(f"a value of a {tuple(t.shape)} tensor was needed")
        try:
            lazy.run_cells(lazy.pending_cells() + [cell])
        except Exception as error:
            if cell.is_pending() or isinstance(cell.value, Failed):
                raise
            # another pending tensor failed; it keeps its error for whoever reads it
            warnings.warn(f"a pending computation failed ({error}); reading that tensor raises the error",
                          RuntimeWarning, stacklevel=3)
    if isinstance(cell.value, Failed):
        cell.value.reraise()
    return cell.value


def logical_array(t: ShardedTensor):
    """The concrete jax array of ``t`` without padding."""
    a = materialize(t)
    if tuple(a.shape) != tuple(t.shape):
        a = a[tuple(slice(0, n) for n in t.shape)]
    return a


def to_cpu(t: ShardedTensor) -> torch.Tensor:
    """A torch CPU tensor with the value of ``t``."""
    from shardtensor.tensor import numpy_to_torch

    a = materialize(t)
    with counters.timed("TransferFromDeviceTime"):
        if a.is_fully_addressable:
            host = np.asarray(a)
        else:
            from jax.experimental import multihost_utils

            host = np.asarray(multihost_utils.process_allgather(a, tiled=True))
    counters.increment("TransferFromDevice")
    host = host[tuple(slice(0, n) for n in t.shape)]
    return numpy_to_torch(host)


# --- special ops ----------------------------------------------------------------------------------
def _to_copy(func, args, kwargs):
    t = args[0]
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        out = to_cpu(t)
        dtype = kwargs.get("dtype")
        return out.to(dtype) if dtype is not None else out
    kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory", "non_blocking")}
    if kwargs.get("dtype") in (None, t.dtype) and kwargs.get("memory_format") is None:
        return _keep_sharding(t, _record_and_wrap(aten.clone.default, (t,), {}))
    kwargs.pop("memory_format", None)
    # .to(dtype) keeps the sharding (model.to(torch.bfloat16) must not un-shard the parameters)
    return _keep_sharding(t, _record_and_wrap(aten._to_copy.default, (t,), kwargs))


def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(src, torch.Tensor) and not isinstance(src, ShardedTensor):
        from shardtensor import transfer

        src = transfer.upload_like(src.to(dst.dtype).expand(dst.shape), dst)
    return _mutating_op(func, facts(func), (dst, src), {})


def _local_scalar_dense(func, args, kwargs):
    return to_cpu(args[0]).item()


def _equal(func, args, kwargs):
    a, b = args
    if a.shape != b.shape:
        return False
    return bool(to_cpu(aten.eq.Tensor(a, b).all()).item())


def _is_nonzero(func, args, kwargs):
    return bool(to_cpu(args[0]).item())


def _allclose(func, args, kwargs):
    """A Python bool: the values are needed on the host (as for ``equal``)."""
    return bool(to_cpu(aten.isclose.default(*args, **kwargs).all()).item())


def _sparse(func, args, kwargs):
    layout = kwargs.get("layout") or {"_to_sparse_csr": "torch.sparse_csr", "_to_sparse_csc": "torch.sparse_csc",
                                      "_to_sparse_bsr": "torch.sparse_bsr", "_to_sparse_bsc": "torch.sparse_bsc"
                                      }.get(func._schema.name.split("::")[1], "torch.sparse_coo")
    raise NotImplementedError(
        f"{func}: shardtensor holds dense (torch.strided) tensors only; a tensor of layout {layout} cannot live "
        "on st.device(). Convert on the host instead, e.g. t.cpu().to_sparse()")


def _linalg_check_errors(func, args, kwargs):
    """``_linalg_check_errors(info, api_name, is_matrix)`` raises torch's error when a factorization
    failed (a singular matrix for inv/solve, not positive-definite for cholesky). It needs the values
    of ``info``: like torch on CUDA, read them (a sync) and run torch's own check on the host, so the
    messages are torch's. The ``*_ex`` variants skip the check and do not sync."""
    lazy.check_execution_allowed(f"{args[1]} checks its result for errors; use the *_ex variant "
                                 "(e.g. torch.linalg.inv_ex) to keep the program whole")
    return func(to_cpu(args[0]), *args[1:], **kwargs)


@register(aten.nonzero_static.default)
def _nonzero_static(x, *, size, fill_value=-1):
    """``nonzero`` padded (with ``fill_value`` rows) or cut to ``size`` rows: a fixed shape, so no host
    round trip (unlike ``nonzero``)."""
    if x.ndim == 0:
        return jax.numpy.zeros((size, 0), jax.numpy.int64)
    idx = jax.numpy.nonzero(x, size=size, fill_value=fill_value)
    return jax.numpy.stack(idx, axis=1).astype(jax.numpy.int64)


def _det_factors(func, args, kwargs):
    """``_linalg_det`` / ``_linalg_slogdet`` also return LU factors, which backward reads as factors of
    A^T when A is contiguous and real (torch's CPU kernel factors the column-major view) and of A
    otherwise. The lowering always factors its input's transpose, so a non-contiguous A goes in as
    the contiguous values of A^T: the same determinant, and the factors of A that backward expects."""
    a = args[0]
    if isinstance(a, ShardedTensor) and not a.is_contiguous() and not a.is_complex():
        args = (a.mT.contiguous(), *args[1:])
    return _record_and_wrap(func, args, kwargs)


def _ctc_loss_tensor(func, args, kwargs):
    """``_ctc_loss.Tensor`` takes the lengths as tensors, and its output shape depends on their values
    (torch has no meta kernel for it): read them on the host and record ``_ctc_loss.default``."""
    bound = dict(zip(facts(func).arg_names, args))
    bound.update(kwargs)
    lazy.check_execution_allowed("ctc_loss with tensor lengths needs their values")
    for name in ("input_lengths", "target_lengths"):
        v = bound[name]
        bound[name] = (to_cpu(v) if isinstance(v, ShardedTensor) else v).tolist()
    return _record_and_wrap(aten._ctc_loss.default, (), bound)


def _sdp_choice(func, args, kwargs):
    return 0  # SDPBackend.math: attention decomposes into ops we lower


def _data_dependent(func, args, kwargs):
    """Ops whose output shape depends on values (nonzero, masked_select, unique...): they need the
    values anyway, so run torch's own kernel on the host and upload the (replicated) result."""
    lazy.check_execution_allowed(f"{func} has a data-dependent output shape")
    from shardtensor import transfer, torch_device

    def host(v):
        if isinstance(v, ShardedTensor):
            return to_cpu(v)
        if isinstance(v, (list, tuple)):
            return type(v)(host(x) for x in v)
        if isinstance(v, torch.device) and v.type != "cpu":
            return torch.device("cpu")
        return v

    out = func(*[host(a) for a in args], **{k: host(v) for k, v in kwargs.items()})
    mesh = torch_device.default_mesh()

    def upload(t):
        return ShardedTensor(transfer.cell_from_host(transfer.torch_to_numpy(t), mesh, None, t.dtype))

    if isinstance(out, torch.Tensor):
        return upload(out)
    return type(out)(upload(o) if isinstance(o, torch.Tensor) else o for o in out)


def _on_device(i):
    """CPU index tensors are allowed with device tensors (as with CUDA): upload them."""
    if isinstance(i, torch.Tensor) and not isinstance(i, ShardedTensor):
        from shardtensor import torch_device

        return i.to(torch_device.device())
    return i


def _index(func, args, kwargs):
    x, indices = args[0], [_on_device(i) for i in args[1]]
    if any(isinstance(i, ShardedTensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
        lazy.check_execution_allowed("boolean-mask indexing has a data-dependent shape")
        expanded = []
        for i in indices:
            if isinstance(i, ShardedTensor) and i.dtype in (torch.bool, torch.uint8):
                expanded.extend(aten.nonzero.default(i).unbind(1))
            else:
                expanded.append(i)
        indices = expanded
    return _record_and_wrap(func, (x, indices), kwargs)


def _placeholder(func, args, kwargs):
    """Zeros shaped like ``func``'s result: what a failed op returns while backward unwinds."""
    if facts(func).mutated:
        return args[0]
    outs, structure = meta_outputs(func, args, kwargs)
    values = [None if o is None else zeros(o[0], o[1]) for o in outs]
    if structure == "one":
        return values[0]
    return values if structure == "list" else tuple(values)


def _same_sharding(func, args, kwargs):
    """``clone`` and ``*_like`` keep the sharding annotation of their source (as in PyTorch/XLA and
    DTensor), so e.g. optimizer state is laid out like its parameter."""
    return _keep_sharding(args[0], _record_and_wrap(func, args, kwargs))


def _keep_sharding(src, out):
    """``out`` annotated with ``src``'s sharding, when ``src`` has one of its own (not a view)."""
    if src._cell.spec is not None and not src._chain and isinstance(out, ShardedTensor):
        out._cell.mesh, out._cell.spec = src._cell.mesh, src._cell.spec
    return out


def _index_put(func, args, kwargs):
    """``x[mask] = v``: a scalar value becomes ``where`` (no data-dependent shape); otherwise the
    masks become index tensors (which needs their values)."""
    bound = dict(zip(facts(func).arg_names, args))
    bound.update(kwargs)
    x, indices, values = bound["self"], [_on_device(i) for i in bound["indices"]], bound["values"]
    bound["indices"] = indices
    accumulate = bound.get("accumulate", False)
    masks = [i for i in indices if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
    if not masks:
        args, kwargs = tuple(bound[n] for n in facts(func).arg_names if n in bound), {}
        return _record_and_wrap(func, args, kwargs) if not facts(func).mutated else _mutating_op(
            func, facts(func), args, kwargs)
    inplace = bool(facts(func).mutated)
    if len(indices) == 1 and values.numel() == 1 and not accumulate and tuple(masks[0].shape) == tuple(
            x.shape[:masks[0].dim()]):
        mask = masks[0].bool().reshape(tuple(masks[0].shape) + (1,) * (x.dim() - masks[0].dim()))
        result = aten.where.self(mask, values.reshape(()).to(x.dtype), x)
    else:
        lazy.check_execution_allowed("indexing with a boolean mask has a data-dependent shape")
        expanded = []
        for i in indices:
            if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
                expanded.extend(aten.nonzero.default(i).unbind(1))
            else:
                expanded.append(i)
        result = aten.index_put.default(x, expanded, values, accumulate)
    if inplace:
        return x.copy_(result)
    return result


def _native_batch_norm(func, args, kwargs):
    """``native_batch_norm`` updates the running statistics in training although its schema does not
    say so: run the functional form and write the new statistics back."""
    bound = dict(zip(facts(func).arg_names, args))
    bound.update(kwargs)
    rm, rv = bound["running_mean"], bound["running_var"]
    if not bound["training"] or rm is None or rv is None:
        return _record_and_wrap(func, args, kwargs)
    out, mean, rstd, new_rm, new_rv = _record_and_wrap(aten._native_batch_norm_legit_functional.default, args, kwargs)
    for target, value in ((rm, new_rm), (rv, new_rv)):
        views.write(target, views.read(value))
    if lazy.STATE.eager:
        lazy.run_cells([rm._cell, rv._cell])
    return out, mean, rstd


def _remember_for_backward(e):
    from shardtensor import torch_device as device

    device.remember_backward_error(e)


_SPECIAL = {
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.equal.default: _equal,
    aten.allclose.default: _allclose,
    aten.is_nonzero.default: _is_nonzero,
    aten._fused_sdp_choice.default: _sdp_choice,
    aten._linalg_check_errors.default: _linalg_check_errors,
    aten._linalg_det.default: _det_factors,
    aten._ctc_loss.Tensor: _ctc_loss_tensor,
    aten._linalg_slogdet.default: _det_factors,
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.lift_fresh.default: _alias,
    aten.index.Tensor: _index,
    aten.native_batch_norm.default: _native_batch_norm,
    aten.clone.default: _same_sharding,
    aten.zeros_like.default: _same_sharding,
    aten.ones_like.default: _same_sharding,
    aten.empty_like.default: _same_sharding,
    aten.full_like.default: _same_sharding,
    aten.rand_like.default: _same_sharding,
    aten.randn_like.default: _same_sharding,
    aten.index_put.default: _index_put,
    aten.index_put_.default: _index_put,
}
for _op in (aten.nonzero.default, aten.masked_select.default, aten._unique.default, aten._unique2.default,
            aten.unique_dim.default, aten.unique_consecutive.default, aten.repeat_interleave.Tensor,
            aten.bincount.default):
    _SPECIAL[_op] = _data_dependent
for _name in ("_to_sparse", "_to_sparse_csr", "_to_sparse_csc", "_to_sparse_bsr", "_to_sparse_bsc"):
    _packet = getattr(aten, _name, None)
    for _o in (_packet.overloads() if _packet is not None else ()):
        _SPECIAL[getattr(_packet, _o)] = _sparse

# in-place ops that change a tensor's shape (that module uses this one, so it comes last)
from shardtensor import geometry

_SPECIAL.update(geometry.HANDLERS)
