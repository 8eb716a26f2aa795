"""Facts about an aten overload's schema, computed once per overload: which arguments are runtime
scalars, which it writes, its ``out=`` arguments, and the functional twin that computes the same
values without writing (``add_.Tensor`` -> ``add.Tensor``).

Example::

    facts(torch.ops.aten.add_.Tensor).functional   # aten.add.Tensor
"""

from __future__ import annotations

import dataclasses

import torch

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class OpFacts:
    """What the dispatcher needs to know of one overload's schema."""

    scalar_slots: frozenset  # positions / names of Scalar, Scalar[] or Tensor arguments
    mutated: tuple  # names of arguments the op writes (a!)
    out_names: tuple  # names of out= arguments
    arg_names: tuple
    is_view: bool
    functional: torch._ops.OpOverload | None = None  # the overload to run for a mutating op
    functional_by_name: bool = False  # its arguments come in another order: pass them by name
    # per result of the functional twin: (the argument it goes to, whether it is written there)
    written: tuple = ()

    def bind(self, args, kwargs) -> dict:
        """The arguments of a call by name."""
        bound = dict(zip(self.arg_names, args))
        bound.update(kwargs)
        return bound


# id(overload) -> (overload, its facts): keyed by id, as an OpOverload hashes in Python and this runs
# several times per dispatched op (the tuple keeps the overload alive, so its id stays its own)
_FACTS: dict = {}


def facts(func) -> OpFacts:
    """The (memoised) schema facts of an aten overload."""
    entry = _FACTS.get(id(func))
    if entry is None or entry[0] is not func:
        entry = _FACTS[id(func)] = (func, _make_facts(func))
    return entry[1]


def _make_facts(func) -> OpFacts:
    schema = func._schema
    slots: set[int] = set()
    mutated: list = []
    outs: list = []
    names: list[str] = []
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
    if not mutated:
        return f
    functional = _functional_twin(func, f)
    by_name = False
    if functional is not None:
        mine = [n for n in f.arg_names if n not in f.out_names]
        theirs = [a.name for a in functional._schema.arguments]
        by_name = theirs[: len(mine)] != mine[: len(theirs)]
    return dataclasses.replace(
        f, functional=functional, functional_by_name=by_name, written=_written(func, f, functional)
    )


def _written(func, f: OpFacts, functional) -> tuple:
    """Per result of ``functional``, in order: (the argument it belongs to, whether it is written there).

    Mostly the mutated arguments in the schema's order, all written. Where the twin names its results
    after arguments (``_fused_adam`` returns ``self_out, grads_out, ...``), by name; and torch's
    out= form of such an op (``_fused_adam.out``, ``_amp_update_scale.out``) writes only its out=
    arguments, although its schema marks the others as written too: the others are left as they are.
    """
    everything = tuple((name, True) for name in f.mutated)
    if functional is None or not (is_inplace(func) or f.out_names):
        return everything
    results = [r.name for r in functional._schema.returns]
    if len(results) != len(f.mutated):
        return everything
    pairs: list = []
    outs = list(f.out_names)
    for r in results:
        base = r[: -len("_out")] if r.endswith("_out") else None
        if base is not None and base in f.mutated and base not in f.out_names:
            pairs.append((base, not f.out_names))
        elif outs:
            pairs.append((outs.pop(0), True))
        else:
            return everything
    return tuple(pairs)


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


def is_inplace(func) -> bool:
    """Whether ``func`` is an in-place variant (``add_``), not an ``out=`` or functional one."""
    name = func._schema.name
    return name.endswith("_") and not name.endswith("__")
