"""In-place and ``out=`` ops: the functional twin computes the values, which are written back into
the targets through their view chains (``out=`` tensors of another shape are resized, as torch does).
"""

from __future__ import annotations

import operator
import warnings

import torch

from shardtensor.dispatch.meta import meta_outputs
from shardtensor.dispatch.record import (
    cast,
    device_mismatch,
    new_tensors,
    record,
    record_and_wrap,
)
from shardtensor.dispatch.reshape_inplace import resize_to
from shardtensor.graph import rng, views
from shardtensor.graph.execute import run_cells
from shardtensor.graph.ir import Leaf, Pending
from shardtensor.graph.program import describe_mesh, mesh_of
from shardtensor.graph.state import STATE, set_pending_all
from shardtensor.ops.schema import OpFacts, facts, is_inplace
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.geometry import contiguous_strides

_CHECKED: set = set()  # (mutating op, functional signature) pairs torch's meta kernel accepted


def mutating_op(func, f: OpFacts, args, kwargs):
    """An in-place or ``out=`` op: run its functional twin and write the results into the targets."""
    if f.functional is None:
        return record_and_wrap(func, args, kwargs)
    shape = _SHAPES.get((id(func), len(args), tuple(kwargs) if kwargs else ()))
    if shape is None or shape.func is not func:
        shape = _call_shape(func, f, args, kwargs)
    if shape.fast:
        if shape.listed:
            if all(isinstance(t, ShardedTensor) for t in args[0]):
                return _inplace_list(func, shape, args, kwargs)
        else:
            for i in shape.targets:
                if not isinstance(args[i], ShardedTensor):
                    break  # (the general path says what is wrong)
            else:
                return _inplace(func, shape, args, kwargs)
    bound = f.bind(args, kwargs)
    targets = [bound[name] for name, write in f.written if write]
    flat_targets: list = []  # per result of the functional twin: the tensor it is written into, or None
    for name, write in f.written:
        t = bound[name]
        items = t if isinstance(t, (list, tuple)) else [t]
        flat_targets.extend(items if write else [None] * len(items))
    written_targets = [x for x in flat_targets if x is not None]
    for x in written_targets:
        if isinstance(x, torch.Tensor) and not isinstance(x, ShardedTensor):
            raise device_mismatch(x)
    _check_one_mesh(func, written_targets, args, kwargs)
    args = _with_defaults(func, args, kwargs)  # torch drops trailing arguments equal to their default
    fargs = [a for name, a in zip(f.arg_names, args) if name not in f.out_names]
    fkw = {k: v for k, v in kwargs.items() if k not in f.out_names}
    if f.functional_by_name:  # e.g. polygamma_(self, n) vs polygamma(n, self)
        fkw.update({name: a for name, a in zip(f.arg_names, args) if name not in f.out_names})
        fargs = []
    meta_ran = True  # torch's meta kernel ran now (and gave its warnings)
    refs, plan = record(f.functional, fargs, fkw)
    if plan is not None:
        metas = plan.outs
        checked = (func, plan.key, tuple((x.shape, x.dtype) for x in written_targets))
        meta_ran = checked not in _CHECKED
        if meta_ran:  # torch's own checks (broadcast into self, casts), once
            meta_outputs(func, args, kwargs)
            _CHECKED.add(checked)
    else:  # torch's decomposition computed the values
        meta_outputs(func, args, kwargs)
        flat = [refs] if isinstance(refs, torch.Tensor) else list(refs)
        refs = [views.read(r) for r in flat]
        metas = [(tuple(r.shape), r.dtype, r.stride(), 0) for r in flat]
    functional_variant = not (is_inplace(func) or f.out_names)  # e.g. _native_batch_norm_legit
    n_returned = len(refs) - len(flat_targets) if functional_variant else 0
    written, written_metas = refs[n_returned:], metas[n_returned:]
    cells = []
    outs = {
        id(x)
        for name in f.out_names
        for x in (bound[name] if isinstance(bound[name], (list, tuple)) else [bound[name]])
    }
    to_write = []  # (target, value): written together (a fused optimizer op updates all or none)
    for t, ref, meta in zip(flat_targets, written, written_metas):
        if t is None:  # a result torch does not write back (see schema._written)
            continue
        if tuple(meta[0]) != tuple(t.shape):
            if id(t) not in outs:
                raise RuntimeError(
                    f"{func}: result of shape {tuple(meta[0])} cannot be written into a tensor "
                    f"of shape {tuple(t.shape)}"
                )
            # out= tensors of another shape are resized, as torch does (it warns if they were not empty)
            shape = tuple(meta[0])
            if t.numel() and not meta_ran:
                warnings.warn(
                    f"An output with one or more elements was resized since it had shape {list(t.shape)}, "
                    f"which does not match the required output shape {list(shape)}. This behavior is "
                    "deprecated, and in a future PyTorch release outputs will not be resized unless they "
                    "have zero elements. You can explicitly reuse an out tensor t by resizing it, "
                    "inplace, to zero elements with t.resize_(0).",
                    UserWarning,
                    stacklevel=3,
                )
            resize_to(func, t, shape, meta[2] if len(meta) > 2 and meta[2] else contiguous_strides(shape), 0)
        if meta[1] != t.dtype:
            ref = cast(ref, t.dtype)
        to_write.append((t, ref))
    cells += _write_all(to_write)
    returned = []
    if functional_variant:
        new_cells, returned = new_tensors(refs[:n_returned], metas[:n_returned])
        cells += [c for c in new_cells if c is not None]
    if STATE.eager:  # one run: a second would find the rng key donated by the first
        run_cells(cells + rng.pending_cells())
    if functional_variant:  # e.g. rrelu_with_noise: writes `noise`, returns one tensor
        return returned[0] if len(func._schema.returns) == 1 else tuple(returned)
    returns = func._schema.returns
    if not returns:
        return None
    if len(returns) == 1:
        return targets[0]
    return tuple(targets)


class _CallShape:
    """What an in-place op's call looks like, for a given op, number of positional arguments and
    keyword names: memoised, so a repeated op skips binding its arguments by name again.

    ``fast``: a plain in-place op (``mul_``, ``addcdiv_``, ``lerp_``: the optimizer's ops) whose
    written arguments are single tensors passed by position; ``targets``: their positions, in the
    order of the functional twin's results (None: a result not written back); ``fill``: the defaults
    torch left out (``_with_defaults``); ``returns``: how many results the op returns. ``listed``: a
    foreach op (``_foreach_mul_``) writing only its first argument, a list of tensors, one result each.
    """

    __slots__ = ("func", "fast", "targets", "flat", "fill", "returns", "listed")

    def __init__(self, func, fast, targets=(), flat=(), fill=(), returns=0, listed=False):
        self.func, self.fast, self.targets, self.flat, self.fill, self.returns = (
            func,
            fast,
            targets,
            flat,
            fill,
            returns,
        )
        self.listed = listed


_SHAPES: dict = {}  # (id(op), len(args), keyword names) -> _CallShape


def _call_shape(func, f: OpFacts, args, kwargs) -> _CallShape:
    key = (id(func), len(args), tuple(kwargs) if kwargs else ())
    schema = func._schema
    position = {name: i for i, name in enumerate(f.arg_names[: len(args)])}
    single = all(
        name in position and isinstance(schema.arguments[position[name]].type, torch.TensorType)
        for name, _ in f.written
    )
    plain = is_inplace(func) and not f.out_names and not f.functional_by_name
    if plain and not single and args and f.written == ((f.arg_names[0], True),):
        kind = schema.arguments[0].type  # a foreach op: Tensor(a!)[] self, one result per element
        if isinstance(kind, torch.ListType) and isinstance(kind.getElementType(), torch.TensorType):
            filled = _with_defaults(func, args, kwargs)
            shape = _SHAPES[key] = _CallShape(
                func, True, (0,), fill=tuple(filled[len(args) :]), returns=len(schema.returns), listed=True
            )
            return shape
    if not (plain and single):
        shape = _SHAPES[key] = _CallShape(func, False)
        return shape
    filled = _with_defaults(func, args, kwargs)
    flat = tuple(position[name] if write else None for name, write in f.written)
    shape = _SHAPES[key] = _CallShape(
        func,
        True,
        tuple(position[name] for name, write in f.written if write),
        flat,
        tuple(filled[len(args) :]),
        len(schema.returns),
    )
    return shape


def _inplace(func, shape: _CallShape, args, kwargs):
    """``mutating_op`` for a plain in-place op (``shape.fast``): the same steps, without rebinding."""
    targets = [args[i] for i in shape.targets]
    _check_one_mesh(func, targets, args, kwargs)
    f = facts(func)
    refs, plan = record(f.functional, tuple(args) + shape.fill if shape.fill else args, kwargs)
    if plan is not None:
        metas = plan.outs
        if plan.checked.get(id(func)) is not func:  # torch's own checks (broadcast into self, casts), once
            meta_outputs(func, args, kwargs)
            plan.checked[id(func)] = func
    else:  # torch's decomposition computed the values
        meta_outputs(func, args, kwargs)
        flat = [refs] if isinstance(refs, torch.Tensor) else list(refs)
        refs = [views.read(r) for r in flat]
        metas = [(tuple(r.shape), r.dtype, r.stride(), 0) for r in flat]
    cells = []
    for i, ref, meta in zip(shape.flat, refs, metas):
        if i is None:  # a result torch does not write back
            continue
        t = args[i]
        if tuple(meta[0]) != tuple(t.shape):
            raise RuntimeError(
                f"{func}: result of shape {tuple(meta[0])} cannot be written into a tensor of shape {tuple(t.shape)}"
            )
        if meta[1] != t.dtype:
            ref = cast(ref, t.dtype)
        views.write(t, ref)
        cells.append(t._cell)
    if STATE.eager:  # one run: a second would find the rng key donated by the first
        run_cells(cells + rng.pending_cells())
    if not shape.returns:
        return None
    return targets[0] if shape.returns == 1 else tuple(targets)


def _inplace_list(func, shape: _CallShape, args, kwargs):
    """``mutating_op`` for a foreach op writing the list ``args[0]`` (``shape.listed``): the functional
    twin's results, one per element, written into the elements (an optimizer step's commonest op)."""
    targets = args[0]
    if _shares_memory(targets, args):
        # torch updates the elements one after another: an element whose memory another one also
        # holds (overlapping views, a tensor twice, an operand that is an earlier target) sees the
        # earlier updates, which one functional op over all of them would not
        n = len(targets)
        for i in range(n):
            func(*[[a[i]] if isinstance(a, (list, tuple)) and len(a) == n else a for a in args], **kwargs)
        return None if not shape.returns else targets
    _check_one_mesh(func, targets, args, kwargs)
    refs, plan = record(facts(func).functional, tuple(args) + shape.fill if shape.fill else args, kwargs)
    if plan is not None:
        metas = plan.outs
        # the plan's template holds every target's geometry: torch's checks of the in-place op, once
        if plan.checked.get(id(func)) is not func:
            meta_outputs(func, args, kwargs)
            plan.checked[id(func)] = func
    else:  # torch's decomposition computed the values
        meta_outputs(func, args, kwargs)
        flat = list(refs)
        refs = [views.read(r) for r in flat]
        metas = [(tuple(r.shape), r.dtype, r.stride(), 0) for r in flat]
    if len(refs) != len(targets):
        raise RuntimeError(f"{func}: {len(refs)} results for a list of {len(targets)} tensors")
    known = plan.list_casts.get(id(func)) if plan is not None else None
    if known is not None and known[0] is func:
        # the plan's template holds every target's shape and dtype: the checks below passed for it,
        # and ``known[1]`` says which results are cast into their target's dtype
        written = [(t, ref if dtype is None else cast(ref, dtype)) for t, ref, dtype in zip(targets, refs, known[1])]
        return _write_list(written, targets, shape)
    written = []  # every result checked before the first is written: an error leaves all targets as they were
    casts = []
    for t, ref, meta in zip(targets, refs, metas):
        sig = t._sig
        shape_, dtype = (sig[1], sig[2]) if sig is not None else (tuple(t.shape), t.dtype)
        if tuple(meta[0]) != shape_:
            raise RuntimeError(
                f"{func}: result of shape {tuple(meta[0])} cannot be written into a tensor of shape {shape_}"
            )
        if meta[1] != dtype:
            if not torch.can_cast(meta[1], dtype):  # torch's CPU kernel says so (its meta kernel does not)
                raise RuntimeError(
                    f"result type {_name(meta[1])} can't be cast to the desired output type {_name(dtype)}"
                )
            ref = cast(ref, dtype)
            casts.append(dtype)
        else:
            casts.append(None)
        written.append((t, ref))
    if plan is not None:
        plan.list_casts[id(func)] = (func, tuple(casts))
    return _write_list(written, targets, shape)


def _write_all(written) -> list:
    """Each (target, value reference) written; the cells written. Targets without a view chain given
    pending values are set at once (``set_pending_all``: a Ctrl-C lands before or after all of them,
    as torch runs one op whole)."""
    cells = []
    plain, plain_refs = [], []
    for t, ref in written:
        if not t._chain and type(ref) is Pending:
            plain.append(t._cell)
            plain_refs.append(ref)
        else:
            views.write(t, ref)
        cells.append(t._cell)
    set_pending_all(plain, plain_refs)
    return cells


def _write_list(written, targets, shape):
    """The end of ``_inplace_list``: each (target, value reference) written."""
    cells = _write_all(written)
    if STATE.eager:  # one run: a second would find the rng key donated by the first
        run_cells(cells + rng.pending_cells())
    return None if not shape.returns else targets


def _shares_memory(targets, args) -> bool:
    """Whether a foreach op's targets may share memory with each other (views of one cell whose
    element ranges meet, a tensor twice), or an operand at another position of its lists is one of
    them (conservatively: shares its cell). C-level passes and set operations when no cell is shared
    (an optimizer's lists): this runs on every foreach op of every step."""
    ids = list(map(id, map(_CELL, targets)))
    unique = set(ids)
    if len(unique) != len(ids):
        where: dict = {}
        for i, k in enumerate(ids):
            where.setdefault(k, []).append(targets[i])
        if any(len(views) > 1 and _ranges_meet(views) for views in where.values()):
            return True
    for a in args[1:]:
        if (type(a) is list or type(a) is tuple) and a and isinstance(a[0], torch.Tensor):
            try:
                theirs = list(map(id, map(_CELL, a)))
            except AttributeError:  # (a tensor that is not shardtensor's: not one of the targets)
                theirs = [id(getattr(x, "_cell", None)) for x in a]
            if unique.isdisjoint(theirs):
                continue
            if len(unique) != len(ids):
                return True  # (a shared cell that is also an operand: never taken as safe)
            position = {k: i for i, k in enumerate(ids)}
            if any(k in position and position[k] != j for j, k in enumerate(theirs)):
                return True
    return False


_CELL = operator.attrgetter("_cell")


def _ranges_meet(views) -> bool:
    """Whether any two of ``views`` (of one cell) span element ranges that meet."""
    spans = []
    for t in views:
        if t.numel():
            first = t.storage_offset()
            spans.append((first, first + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))))
    spans.sort()
    return any(b[0] <= a[1] for a, b in zip(spans, spans[1:]))


def _name(dtype) -> str:
    """torch's name of a dtype in its casting errors (``Float``, ``Long``, ``BFloat16``)."""
    return torch.empty((), dtype=dtype, device="meta").type().split(".")[-1].removesuffix("Tensor")


def _check_one_mesh(func, targets, args, kwargs) -> None:
    """Refuse, before anything is recorded, to write a value computed from data sharded over another
    mesh: one graph runs on one mesh, so the run would fail and take the target's value with it.

    (DTensor refuses mixed meshes too. Resharding implicitly would move data between device sets
    behind the user's back; the error names both meshes and the explicit way to do it.)
    Runs on every in-place op, hence the plain loops.
    """
    wanted, written = None, set()
    # id(node) -> its recorded mesh: a foreach op's targets are all outputs of the one node before
    # (and its ~100 inputs were walked once per target: 30 us each, 6 ms of an AdamW step)
    walked: dict = {}
    for t in targets:
        cell = t._cell
        written.add(id(cell))
        value = cell.value
        if cell.sharding is None and type(value) is Pending:  # (the commonest target, inline)
            m = walked.get(id(value.node), walked)
            if m is walked:
                m = walked[id(value.node)] = _recorded_mesh(value.node)
        else:
            m = _mesh_of(t, True, walked)
        if m is not None:
            if wanted is None:
                wanted = m
            elif m is not wanted and m != wanted:
                _refuse(func, wanted, m)
    if wanted is None:
        return
    for a in (*args, *kwargs.values()) if kwargs else args:
        for x in a if isinstance(a, (list, tuple)) else (a,):  # foreach ops and index_put_ take lists
            if isinstance(x, ShardedTensor) and id(x._cell) not in written:
                cell = x._cell
                value = cell.value
                if cell.sharding is None and type(value) is Pending:  # (as above)
                    m = walked.get(id(value.node), walked)
                    if m is walked:
                        m = walked[id(value.node)] = _recorded_mesh(value.node)
                else:
                    m = _mesh_of(x, False, walked)
                if m is not None and m is not wanted and m != wanted:
                    _refuse(func, wanted, m)


def _refuse(func, wanted, other):
    raise ValueError(
        f"{func}: the tensor written in place is sharded over {describe_mesh(wanted)} but an operand "
        f"over {describe_mesh(other)}; one computation runs on one mesh, and the target keeps its value. "
        "Move the operand onto the target's mesh first, e.g. other = st.shard(other, target.mesh, "
        "target.partition_spec) (through the host), or compute both on one Mesh."
    )


def _mesh_of(t, written, walked) -> object:
    """The jax mesh a graph using ``t`` must run on, or None if ``t`` can join any mesh: the mesh of its
    sharding annotation (for a replicated annotation only if it is written: its result is laid out
    there) or of its sharded data; replicated data is copied to the graph's mesh. ``walked``: id(node)
    -> ``_recorded_mesh(node)`` of the nodes already looked at (by this check, which keeps them alive)."""
    cell = t._cell
    value, sharding = cell.value, cell.sharding
    pending = type(value) is Pending
    if sharding is not None and (written or pending or not _replicated(value)):
        return sharding.mesh.get_jax_mesh()
    if pending:
        node = value.node
        m = walked.get(id(node), walked)
        if m is walked:
            m = walked[id(node)] = _recorded_mesh(node)
        return m
    return None if _replicated(value) else mesh_of(value)


# Nodes looked at behind a pending operand: enough for `a.mul_(b * 2 + 1)`. Each costs ~0.3 us on
# every in-place op (an optimizer step has hundreds), so deeper graphs are left to the check at run.
_WALK = 3


def _recorded_mesh(node):
    """The mesh of sharded data among the last few recorded nodes behind ``node``, or None; a graph
    deeper than that is still checked when it runs (as ``program._graph_mesh`` does)."""
    todo, seen = [node], 0
    while todo and seen < _WALK:
        node = todo.pop()
        seen += 1
        for ref in node.inputs:
            kind = type(ref)
            if kind is Pending:
                todo.append(ref.node)
            elif kind is Leaf:
                sharding = ref.array.sharding
                if not sharding.is_fully_replicated:
                    return getattr(sharding, "mesh", None)
    return None


def _replicated(value) -> bool:
    sharding = getattr(value, "sharding", None)
    return sharding is None or sharding.is_fully_replicated


def _with_defaults(func, args, kwargs):
    """``args`` with the positional arguments torch left out (equal to their defaults) filled in, so a
    functional twin whose argument has no default (``bernoulli.p``) gets it."""
    schema_args = [a for a in func._schema.arguments if not a.kwarg_only]
    if len(args) >= len(schema_args):
        return args
    missing = schema_args[len(args) :]
    if any(a.name in kwargs or not a.has_default_value() for a in missing):
        return args
    return tuple(args) + tuple(a.default_value for a in missing)
