"""Recording one aten op: its arguments become a static template (the plan's key) and value
references; the plan (memoised per op and template) holds the lowering's caller and the output
metadata; the op becomes a graph node whose outputs are new pending tensors. Ops with no lowering go
through torch's decompositions.
"""

from __future__ import annotations

import dataclasses

import jax
import torch
from jax._src.lax.lax import _convert_element_type

from shardtensor import metrics as counters
from shardtensor import runtime
from shardtensor.dispatch.meta import (
    flat_results,
    has_empty_tensor,
    meta_outputs,
    outputs_from_lowering,
    regroup,
    torch_cpu_error,
)
from shardtensor.dtypes import to_jax
from shardtensor.graph import rng, views
from shardtensor.graph.execute import run_cells, run_single_node
from shardtensor.graph.ir import Cell, Node, Pending, ScalarLeaf
from shardtensor.graph.state import STATE, new_pending_cell, set_pending
from shardtensor.ops import bakes_scalar, checks, lookup, precision
from shardtensor.ops.schema import facts
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.geometry import contiguous_strides

aten = torch.ops.aten


# --- turning arguments into a template (static, hashable) and dynamic references ------------------
_NONE = ("X", None)
# static values of these types skip the torch.Generator test (its metaclass runs Python: ~0.3 us)
_PLAIN = frozenset((int, float, bool, complex, str, torch.dtype, torch.device, torch.layout, torch.memory_format))


def _encode(value, is_scalar_slot, static_scalars, refs):
    if value is None:  # an optional tensor or argument left out (LayerNorm's weight, a bias)
        return _NONE
    if isinstance(value, ShardedTensor):
        refs.append(views.read(value))
        return value._sig or signature(value)
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and value.device.type == "cpu":
            refs.append(ScalarLeaf(value.item()))
            return ("C", value.dtype)
        raise device_mismatch(value)
    if isinstance(value, (list, tuple)):
        if not is_scalar_slot or static_scalars is True:
            for v in value:  # sizes and dims (view, sum, permute): the commonest list, static ints
                if type(v) is not int:
                    break
            else:
                return ("X", tuple(value))
        if any(isinstance(v, torch.Tensor) for v in value):
            return ("L", tuple(_encode(v, False, False, refs) for v in value))
        if is_scalar_slot and static_scalars is not True and value and not isinstance(value[0], (list, tuple)):
            refs.extend(ScalarLeaf(v) for v in value)
            return ("SL", len(value), tuple(map(type, value)))
        return _static(tuple(value))
    if (
        is_scalar_slot
        and isinstance(value, (int, float, bool, complex))
        and not (static_scalars and bakes_scalar(static_scalars, value))  # (most ops: no call)
    ):
        refs.append(ScalarLeaf(value))
        return ("S", type(value))
    if type(value) in _PLAIN:
        return _static(value)
    if isinstance(value, torch.Generator):
        return ("X", None)
    return _static(value)


# 8 == 8.0 == True in Python, but arange(8.0) is float and full(s, True) bool: a static number that is
# not an int carries its type in the template, so plans (keyed by templates) never mix them up
_TYPED = (float, bool, complex)


def _static(value):
    if type(value) in _TYPED or (type(value) is tuple and _has_typed(value)):
        return ("X", value, _types(value))
    return ("X", value)


def _has_typed(values: tuple) -> bool:
    return any(type(v) in _TYPED or (type(v) is tuple and _has_typed(v)) for v in values)


def _types(value):
    return tuple(map(_types, value)) if type(value) is tuple else type(value)


def signature(t: ShardedTensor) -> tuple:
    """A ShardedTensor's template entry ("T", shape, dtype, strides, storage offset), read from torch
    and kept on the tensor (``ShardedTensor._sig``) until its geometry changes.

    Example: ``signature(x.t())[3] == x.t().stride()``.
    """
    sig = t._sig = ("T", tuple(t.shape), t.dtype, t.stride(), t.storage_offset())
    return sig


def device_mismatch(value):
    """torch's error for a CPU tensor where a device tensor is needed."""
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


def flatten(func, args, kwargs, static_scalars=False, runtime_floats=frozenset()):
    """(static template, dynamic value references) of a call: the template keys the plan.
    ``runtime_floats``: names of ``float`` arguments that enter as runtime scalars too (a learning rate)."""
    f = facts(func)
    refs: list = []
    slots = f.scalar_slots | runtime_floats if runtime_floats else f.scalar_slots
    pos = []
    for i, a in enumerate(args):
        if isinstance(a, ShardedTensor) and not a._chain:  # the commonest argument, inline
            v = a._cell.value
            refs.append(v if type(v) is Pending else views.base_ref(a._cell))
            pos.append(a._sig or signature(a))
        elif type(a) is list and a and isinstance(a[0], ShardedTensor):
            pos.append(_tensor_list(a, refs))
        else:
            pos.append(_encode(a, i in slots, static_scalars, refs))
    kw = tuple([(k, _encode(v, k in slots, static_scalars, refs)) for k, v in kwargs.items()]) if kwargs else ()
    return (tuple(pos), kw), refs


def _tensor_list(values: list, refs: list) -> tuple:
    """``_encode`` of a list of tensors (a foreach op's: an optimizer's ~100 parameters, a dozen such
    ops a step), with its commonest element inline."""
    entries = []
    for v in values:
        if type(v) is ShardedTensor and not v._chain:
            value = v._cell.value
            refs.append(value if type(value) is Pending else views.base_ref(v._cell))
            entries.append(v._sig or signature(v))
        else:
            entries.append(_encode(v, False, False, refs))
    return ("L", tuple(entries))


def view_template(func, args, kwargs, static_scalars=False):
    """``flatten`` of a view op on the ShardedTensor ``args[0]``, without reading the base's value (a
    view records no node): (template, references of the other arguments' dynamic values)."""
    slots = facts(func).scalar_slots
    refs: list = []
    base = args[0]
    pos = [base._sig or signature(base)]
    for i in range(1, len(args)):
        pos.append(_encode(args[i], i in slots, static_scalars, refs))
    kw = tuple([(k, _encode(v, k in slots, static_scalars, refs)) for k, v in kwargs.items()]) if kwargs else ()
    return (tuple(pos), kw), refs


# --- plans: everything about an op signature that does not depend on values ------------------------
@dataclasses.dataclass
class Plan:
    caller: object
    key: tuple
    outs: tuple  # (shape, dtype) or None per flat output
    structure: str | tuple  # "one" | "tuple" | "list" | group sizes of a tuple of lists (meta.regroup)
    random: bool
    single: bool = False  # one tensor result, no random key: the commonest op, with a short path
    # id(in-place op) -> that op, for the in-place ops whose meta kernel accepted this plan's arguments
    checked: dict = dataclasses.field(default_factory=dict)
    # id(foreach in-place op) -> (that op, per target: the dtype its result is cast into, or None),
    # for the ops whose results were checked against this plan's targets (dispatch.mutation)
    list_casts: dict = dataclasses.field(default_factory=dict)
    # a view op's (step, template entry, contiguous?) per result (dispatch.view_ops), made on its first call
    view_steps: tuple | None = None
    # per result: its template entry ("T", shape, dtype, strides, 0) if it is contiguous (else None),
    # shared by every tensor this plan makes (so the next op's template compares it by identity)
    sigs: tuple = ()
    sig: tuple | None = None  # sigs[0] of a single result


_PLANS: dict = {}


def plan_for(func, template, args, kwargs, lowering) -> Plan:
    # keyed by id(func): an OpOverload hashes in Python, and this runs for every op (the plan's own
    # key tells a later op that reuses the id of a deleted custom op apart)
    key = (id(func), template)
    p = _PLANS.get(key)
    if p is None or p.key[0] is not func:
        p = _PLANS[key] = _make_plan(func, template, args, kwargs, lowering)
    return p


def _make_plan(func, template, args, kwargs, lowering) -> Plan:
    if lowering.validate is not None:
        lowering.validate(*args, **kwargs)
    if has_empty_tensor(args, kwargs):  # torch's CPU kernels check empty inputs its meta kernels pass
        error = torch_cpu_error(func, args, kwargs)
        if error is not None:
            raise error
    try:
        outs, structure = _output_metadata(func, args, kwargs, lowering)
    except Exception as error:
        # a mistake in the arguments: raised as torch's CPU kernel raises it (the meta kernel's or the
        # lowering's exception type may differ: RuntimeError for IndexError, ValueError...)
        cpu_error = torch_cpu_error(func, args, kwargs)
        if cpu_error is None or type(cpu_error) is type(error):
            raise
        raise cpu_error from None
    if lowering.dtypes_from_lowering:
        # torch's CPU kernel gives other dtypes than its meta kernel (bf16 norms' statistics)
        mine, _ = outputs_from_lowering(func, lowering, args, kwargs)
        outs = tuple(o if o is None else (o[0], m[1]) + tuple(o[2:]) for o, m in zip(outs, mine))
    for o in outs:  # (once per plan: each op's first call with these arguments)
        if o is not None:
            runtime.warn_float64_on_tpu(o[1])
    expected = tuple(None if o is None else to_jax(o[1]) for o in outs)
    fn, random = lowering.for_platform(runtime.platform()), lowering.random
    pos_t, kw_t = template[:2]
    if len(template) == 3:  # a product: torch's float32 matmul precision when it was recorded
        fn = _at_precision(fn, template[2])
    nested = isinstance(structure, tuple)

    def caller(*values):
        it = iter(values)
        if random:
            key, sub = jax.random.split(next(it))
        a = [_decode(e, it) for e in pos_t]
        k = {name: _decode(e, it) for name, e in kw_t}
        out = fn(sub, *a, **k) if random else fn(*a, **k)
        if nested:
            out = flat_results(out, structure)
        elif not isinstance(out, (tuple, list)):
            out = (out,)
        out = tuple(None if d is None else (o if o.dtype == d else o.astype(d)) for o, d in zip(out, expected))
        return out + (key,) if random else out

    single = structure == "one" and not random and outs[0] is not None and len(outs[0]) > 2
    sigs = tuple(_contiguous_sig(o) for o in outs)
    sig = sigs[0] if single else None
    return Plan(caller, (func, template), outs, structure, random, single, sigs=sigs, sig=sig)


def _output_metadata(func, args, kwargs, lowering):
    """(output metadata, structure) of ``func`` on these arguments (see ``meta.meta_outputs``)."""
    if lowering.meta_from_lowering:  # torch's meta kernel follows another device's rules
        return outputs_from_lowering(func, lowering, args, kwargs)
    try:
        return meta_outputs(func, args, kwargs)
    except NotImplementedError:  # no meta kernel in torch
        return outputs_from_lowering(func, lowering, args, kwargs)


def _contiguous_sig(meta):
    """The template entry of a result described by ``meta`` (shape, dtype, strides, offset) if it is
    contiguous, else None."""
    if meta is None or len(meta) < 3 or tuple(meta[2]) != contiguous_strides(meta[0]) or (len(meta) > 3 and meta[3]):
        return None
    return ("T", tuple(meta[0]), meta[1], tuple(meta[2]), 0)


def _at_precision(fn, name):
    def at_precision(*args, **kwargs):
        with precision.lowering_at(name):
            return fn(*args, **kwargs)

    return at_precision


def record(func, args, kwargs):
    """Record ``func`` on these arguments; returns (output references, plan), or (result, None) when
    ``func`` has no lowering and torch's decomposition computed the result from other ops."""
    lowering = lookup(func)
    if lowering is None:
        return _fallback(func, args, kwargs)
    template, refs = flatten(func, args, kwargs, lowering.static_scalars, lowering.runtime_floats)
    if lowering.products:  # read now: a later change makes another op (another plan, program, cache key)
        template = (*template, precision.recorded())
    plan = plan_for(func, template, args, kwargs, lowering)
    if plan.random:
        refs.insert(0, rng.current())
    site = checks.user_site() if lowering.checked and checks.checks_enabled() else None
    node = Node(plan.caller, plan.key, tuple(refs), site)
    if plan.single:
        return [Pending(node, 0)], plan
    n = len(plan.outs)
    out_refs = [None if o is None else Pending(node, i) for i, o in enumerate(plan.outs)]
    if plan.random:
        rng.advance(Pending(node, n))
    return out_refs, plan


_DECOMPOSITIONS = None
_ANY_DEVICE = torch._C.DispatchKey.CompositeExplicitAutograd  # where torch.library puts device-free kernels


def _decomposition(func):
    global _DECOMPOSITIONS
    if _DECOMPOSITIONS is None:
        import torch._decomp  # heavy: only when an op has no lowering

        # torch's whole table, with the core-aten choices winning. core_aten_decompositions() is a
        # lazily filled CustomDecompTable whose .get() misses entries that [] finds: copy it out.
        table = dict(torch._decomp.decomposition_table)
        table.update(torch._decomp.core_aten_decompositions().items())
        _DECOMPOSITIONS = table
    return _DECOMPOSITIONS.get(func)


def _fallback(func, args, kwargs):
    """(torch's decomposition of ``func`` run on these arguments, None), or a clear error."""
    decomp = _decomposition(func)
    if decomp is not None:
        counters.increment(f"Decomposition::{func}")
        return decomp(*args, **kwargs), None
    out = func.decompose(*args, **kwargs)
    if out is not NotImplemented:
        counters.increment(f"Decomposition::{func}")
        return out, None
    if func.namespace not in ("aten", "prims") and torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), _ANY_DEVICE
    ):
        # a library's custom op with a device-independent implementation in torch ops (e.g.
        # transformers' grouped_mm_fallback): run it, its ops come back here one by one
        counters.increment(f"Decomposition::{func}")
        return func.redispatch(torch._C.DispatchKeySet(_ANY_DEVICE), *args, **kwargs), None
    raise NotImplementedError(
        f"shardtensor has no lowering for the aten op {func} (and torch has no decomposition for it). "
        "Please report it; as a workaround move the tensors to CPU with .cpu() for this op."
    )


def wrap(func, out_refs, plan=None):
    """ShardedTensors for the outputs of a recorded op (run at once in eager mode)."""
    if plan is None:
        return out_refs  # a decomposition already produced the result
    cells, outs = new_tensors(out_refs, plan.outs, plan.sigs)
    if STATE.eager:
        if plan.random or len(cells) != len(out_refs):
            run_cells(cells + rng.pending_cells())
        else:
            run_single_node(out_refs[0].node, cells)
    return regroup(outs, plan.structure)


def record_and_wrap(func, args, kwargs):
    """Record ``func`` and return its results as ShardedTensors (or a decomposition's results)."""
    out_refs, plan = record(func, args, kwargs)
    if plan is not None and plan.single and not STATE.eager:  # wrap()'s work for one lazy result
        ref = out_refs[0]
        shape, dtype, strides = plan.outs[0][:3]
        cell = new_pending_cell(ref, shape, dtype)
        sig = plan.sig
        return ShardedTensor(cell, strides=strides) if sig is None else ShardedTensor._result(cell, sig)
    return wrap(func, out_refs, plan)


def new_tensors(refs, metas, sigs=()):
    """A fresh pending Cell and ShardedTensor per output reference (None stays None); ``sigs``: the
    plan's template entries of its contiguous results (``Plan.sigs``), if known."""
    cells: list[Cell] = []
    outs: list[ShardedTensor | None] = []
    for i, (ref, meta) in enumerate(zip(refs, metas)):
        if ref is None:
            outs.append(None)
            continue
        cell = new_pending_cell(ref, meta[0], meta[1])
        cells.append(cell)
        sig = sigs[i] if sigs else None
        if sig is not None:
            outs.append(ShardedTensor._result(cell, sig))
        else:
            outs.append(ShardedTensor(cell, strides=meta[2] if len(meta) > 2 else None))
    return cells, outs


def zeros(shape, dtype) -> ShardedTensor:
    """A lazily created zero tensor (what ``torch.empty`` gives on st.device())."""
    jd = to_jax(dtype)
    node = Node(lambda: (jax.numpy.zeros(shape, jd),), ("zeros", shape, dtype), ())
    ref = Pending(node, 0)
    cell = Cell(ref, shape, dtype)
    set_pending(cell, ref)
    if STATE.eager:
        run_cells([cell])
    return ShardedTensor(cell)


def cast(ref, dtype):
    """Reference to ``ref``'s value converted to the torch ``dtype``."""
    jd = to_jax(dtype)
    node = Node(lambda x: (x.astype(jd),), ("cast", dtype), (ref,))
    return Pending(node, 0)
