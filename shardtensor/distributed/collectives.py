"""PyTorch/XLA's functional collectives (``xm.all_reduce``, ``xm.all_gather``, ...) across the
processes of a job, with torch_xla's signatures and meaning.

Each process holds its own value of a tensor (what ``.cpu()`` reads there: a replicated tensor's
local copy, which may differ from process to process); a collective combines the values of the
processes of a group, as torch_xla's combine those of replicas (a replica is a process). They record
into the lazy program like any op (``torch.ops.shardtensor.*``, ops/collectives.py, which does the
work; this module checks and converts the arguments). ``groups`` is a list of lists of process
indices, a partition of every process into groups of one size; ``None`` or ``[]`` is one group of
all. ``pin_layout`` is accepted for torch_xla's signatures and has no effect (JAX chooses layouts).

Example::

    import shardtensor as st
    x = torch.full((2,), float(st.process_index())).to(st.device())
    st.all_reduce(st.REDUCE_SUM, x)                          # 0 + 1 + 2 + 3 in each of 4 processes
    st.all_gather(x, groups=[[0, 1], [2, 3]])                # [0, 0, 1, 1] in processes 0 and 1
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardtensor import runtime as rt
from shardtensor.distributed.agreement import check_same_everywhere

REDUCE_SUM = "sum"
REDUCE_MUL = "mul"
REDUCE_AND = "and"
REDUCE_OR = "or"
REDUCE_MIN = "min"
REDUCE_MAX = "max"

_OPS = torch.ops.shardtensor
# all_reduce of a list: tensors under this many elements are reduced as one concatenation (per
# dtype), larger ones alone. Measured on CPU (2 processes, gloo; bench/data_parallel.py): XLA combines
# the all-reduces of a program into one, but reduces each of its operands on its own, at ~4 ms each
# (30 small tensors: 115 ms, 0.8 ms joined; a small GPT's step 3x faster); joining large ones too
# made an MLP's step 6x slower (its 5 MB concatenation, fused with the gradients' producers).
JOIN_BELOW = 1 << 18
# torch_xla's reduce types -> the ops' names (REDUCE_OPS of ops/collectives.py)
_REDUCE_TYPES = {
    REDUCE_SUM: "sum",
    REDUCE_MUL: "product",
    REDUCE_AND: "band",
    REDUCE_OR: "bor",
    REDUCE_MIN: "min",
    REDUCE_MAX: "max",
}
# torch.distributed.ReduceOp names -> the ops' names
_REDUCE_OPS = {
    "SUM": "sum",
    "AVG": "avg",
    "PRODUCT": "product",
    "MIN": "min",
    "MAX": "max",
    "BAND": "band",
    "BOR": "bor",
    "BXOR": "bxor",
}


def process_groups(groups: Sequence[Sequence[int]] | None, what: str) -> tuple[list[int], int]:
    """The ops' form of ``groups``: (flat process indices, group size); ``([], 0)`` for one group of
    every process. Checks that the groups partition the processes into groups of one size.

    Example (4 processes): ``process_groups([[0, 2], [1, 3]], "all_reduce") == ([0, 2, 1, 3], 2)``.
    """
    if groups is None or (isinstance(groups, Sequence) and len(groups) == 0):
        return [], 0
    n = rt.process_count()
    usage = f"{what}: groups must be a list of lists of process indices (a partition of 0..{n - 1})"
    if isinstance(groups, str | bytes) or not isinstance(groups, Sequence):
        raise TypeError(f"{usage}, got {groups!r}.")
    rows = []
    for row in groups:
        if isinstance(row, str | bytes) or not isinstance(row, Sequence) or not row:
            raise TypeError(f"{usage}, got {groups!r}: each group is a non-empty list.")
        for p in row:
            if isinstance(p, bool) or not isinstance(p, int):
                raise TypeError(f"{usage}, got {groups!r}: {p!r} is not an int.")
        rows.append([int(p) for p in row])
    sizes = sorted({len(row) for row in rows})
    if len(sizes) > 1:
        raise ValueError(
            f"{what}: every group must have the same size, got sizes {[len(r) for r in rows]} in {groups!r}."
        )
    flat = [p for row in rows for p in row]
    outside = sorted({p for p in flat if not 0 <= p < n})
    repeated = sorted({p for p in flat if flat.count(p) > 1})
    missing = sorted(set(range(n)) - set(flat))
    if outside or repeated or missing:
        problems = [
            f"{label} {values}"
            for label, values in (("out of range", outside), ("repeated", repeated), ("missing", missing))
            if values
        ]
        raise ValueError(
            f"{usage}: each process in exactly one group; {groups!r} has {', '.join(problems)} "
            f"(this job has {n} process{'es' if n > 1 else ''})."
        )
    return flat, sizes[0]


def _group_size(groups: list[int], group_size: int) -> int:
    return group_size if groups else rt.process_count()


def _reduce_op(reduce_type: Any) -> str:
    """torch_xla's reduce type (REDUCE_SUM, ...) or a torch.distributed.ReduceOp -> the ops' name."""
    if isinstance(reduce_type, str) and reduce_type in _REDUCE_TYPES:
        return _REDUCE_TYPES[reduce_type]
    reduce_op = getattr(torch.distributed, "ReduceOp", None)
    if reduce_op is not None and not isinstance(reduce_type, str):
        for name, op in _REDUCE_OPS.items():
            if reduce_type == getattr(reduce_op, name):
                return op
    raise ValueError(
        f"unknown reduce type {reduce_type!r}: use REDUCE_SUM, REDUCE_MUL, REDUCE_AND, REDUCE_OR, REDUCE_MIN, "
        f"REDUCE_MAX ({', '.join(map(repr, _REDUCE_TYPES))}) or a torch.distributed.ReduceOp "
        f"({', '.join(_REDUCE_OPS)})."
    )


def _check_scale(dtype: torch.dtype, scale: float, what: str) -> None:
    if scale != 1.0 and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{what}: scale={scale} needs a floating-point tensor, got {dtype}; leave scale at 1.0.")


def _scaled(t: torch.Tensor, scale: float, what: str) -> torch.Tensor:
    _check_scale(t.dtype, scale, what)
    return t if scale == 1.0 else t * scale


def _tensor(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what} takes a tensor or a list of tensors, got {type(value).__name__}.")
    return value


def _dim(t: torch.Tensor, dim: int, what: str, name: str = "dim") -> int:
    if t.dim() == 0:
        raise IndexError(f"{what}: a 0-dimensional tensor has no {name}: reshape it to (1,) first.")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -t.dim() <= dim < t.dim():
        raise IndexError(f"{what}: {name}={dim!r} is out of range for a tensor of shape {tuple(t.shape)}.")
    return dim % t.dim()


def _into(output: torch.Tensor | None, result: torch.Tensor, what: str) -> torch.Tensor:
    """``result`` written into ``output`` (torch_xla's ``output=``), or ``result`` itself."""
    if output is None:
        return result
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"{what}: output must be a tensor, got {type(output).__name__}.")
    if output.shape != result.shape or output.dtype != result.dtype:
        raise ValueError(
            f"{what}: output has shape {tuple(output.shape)} and dtype {output.dtype}; the result has shape "
            f"{tuple(result.shape)} and dtype {result.dtype}. Pass an output of that shape and dtype, or none."
        )
    return output.copy_(result)


def _check_count(count: int, size: int, name: str, what: str) -> None:
    if count != size:
        raise ValueError(
            f"{what}: {name}={count!r} must equal the number of processes in each group ({size}): the tensor is "
            "split into one part per member of the group."
        )


def all_reduce(
    reduce_type: Any,
    inputs: torch.Tensor | list[torch.Tensor],
    scale: float = 1.0,
    groups: Sequence[Sequence[int]] | None = None,
    pin_layout: bool = True,
) -> torch.Tensor | list[torch.Tensor]:
    """The reduction of each process's value over the processes of its group, times ``scale``
    (torch_xla's ``xm.all_reduce``). A tensor gives a new tensor; a list of tensors is reduced in
    place and returned (small ones joined into one collective).

    Example::

        g = st.all_reduce(st.REDUCE_SUM, grad, scale=1.0 / st.process_count())   # the mean
        st.all_reduce(st.REDUCE_MAX, [a, b], groups=[[0, 1], [2, 3]])             # a, b in place
    """
    op = _reduce_op(reduce_type)
    flat, size = process_groups(groups, "all_reduce")
    if isinstance(inputs, torch.Tensor):
        check_same_everywhere("all_reduce", [inputs], op, flat, size)
        return _scaled(_OPS.all_reduce(inputs, op, flat, size), scale, "all_reduce")
    if not isinstance(inputs, list | tuple):
        raise TypeError(f"all_reduce takes a tensor or a list of tensors, got {type(inputs).__name__}.")
    tensors = [_tensor(t, "all_reduce") for t in inputs]
    for t in tensors:  # every argument checked before any tensor is changed in place
        _check_scale(t.dtype, scale, "all_reduce")
    check_same_everywhere("all_reduce", tensors, op, flat, size)
    small: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() < JOIN_BELOW:
            small.setdefault((t.dtype, t.device), []).append(t)
        else:
            t.copy_(_scaled(_OPS.all_reduce(t, op, flat, size), scale, "all_reduce"))
    for bucket in small.values():  # the small ones of a dtype: one op on their concatenation
        joined = _OPS.all_reduce(torch.cat([t.reshape(-1) for t in bucket]), op, flat, size)
        for t, part in zip(bucket, _scaled(joined, scale, "all_reduce").split([t.numel() for t in bucket])):
            t.copy_(part.view(t.shape))
    return inputs


def all_gather(
    value: torch.Tensor | list[torch.Tensor],
    dim: int = 0,
    groups: Sequence[Sequence[int]] | None = None,
    output: torch.Tensor | list[torch.Tensor] | None = None,
    pin_layout: bool = True,
) -> torch.Tensor | list[torch.Tensor]:
    """The values of the processes of each group concatenated along ``dim`` in group order
    (torch_xla's ``xm.all_gather``); written into ``output`` when given. A list gathers each tensor.

    Example::

        st.all_gather(x)                       # (4 * n, ...) from x of (n, ...) in 4 processes
        st.all_gather(x, 1, groups=[[0, 2], [1, 3]], output=out)
    """
    flat, size = process_groups(groups, "all_gather")

    def one(t: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        check_same_everywhere("all_gather", [t], dim, flat, size)
        return _into(out, _OPS.all_gather(t, _dim(t, dim, "all_gather"), flat, size), "all_gather")

    return _each(value, output, one, "all_gather")


def _each(
    value: Any, output: Any, one: Callable[[torch.Tensor, Any], torch.Tensor], what: str
) -> torch.Tensor | list[torch.Tensor]:
    """``one(tensor, its output)`` for a tensor, or for each tensor of a list (outputs: a list too)."""
    if not isinstance(value, list | tuple):
        return one(_tensor(value, what), output)
    if output is None:
        output = [None] * len(value)
    if not isinstance(output, list | tuple) or len(output) != len(value):
        raise ValueError(
            f"{what}: for a list of {len(value)} inputs, output must be a list of as many tensors, or None."
        )
    return [one(_tensor(v, what), o) for v, o in zip(value, output)]


def reduce_scatter(
    reduce_type: Any,
    input: torch.Tensor | list[torch.Tensor],
    scale: float,
    scatter_dim: int,
    shard_count: int,
    groups: Sequence[Sequence[int]] | None = None,
    output: torch.Tensor | list[torch.Tensor] | None = None,
    pin_layout: bool = True,
) -> torch.Tensor | list[torch.Tensor]:
    """The reduction over each group, times ``scale``, split along ``scatter_dim`` into
    ``shard_count`` parts (the group size): each process keeps the part at its position in its group
    (torch_xla's ``xm.reduce_scatter``); written into ``output`` when given. A list does each tensor.

    Example::

        st.reduce_scatter(st.REDUCE_SUM, x, 1.0, 0, st.process_count())   # x.shape[0] // 4 rows each
    """
    op = _reduce_op(reduce_type)
    flat, size = process_groups(groups, "reduce_scatter")
    _check_count(shard_count, _group_size(flat, size), "shard_count", "reduce_scatter")

    def one(t: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        dim = _dim(t, scatter_dim, "reduce_scatter", "scatter_dim")
        check_same_everywhere("reduce_scatter", [t], op, dim, flat, size)
        return _into(
            out, _scaled(_OPS.reduce_scatter(t, op, dim, flat, size), scale, "reduce_scatter"), "reduce_scatter"
        )

    return _each(input, output, one, "reduce_scatter")


def all_to_all(
    value: torch.Tensor,
    split_dimension: int,
    concat_dimension: int,
    split_count: int,
    groups: Sequence[Sequence[int]] | None = None,
    pin_layout: bool = True,
) -> torch.Tensor:
    """Each process splits its value along ``split_dimension`` into ``split_count`` parts (the group
    size) and sends part i to the member at position i of its group; each concatenates what it
    receives along ``concat_dimension`` in group order (torch_xla's ``xm.all_to_all``).

    Example::

        st.all_to_all(x, 0, 1, st.process_count())   # x (4, 3) -> (1, 12) in 4 processes
    """
    flat, size = process_groups(groups, "all_to_all")
    _check_count(split_count, _group_size(flat, size), "split_count", "all_to_all")
    value = _tensor(value, "all_to_all")
    split = _dim(value, split_dimension, "all_to_all", "split_dimension")
    concat = _dim(value, concat_dimension, "all_to_all", "concat_dimension")
    check_same_everywhere("all_to_all", [value], split, concat, flat, size)
    return _OPS.all_to_all(value, split, concat, flat, size)


def collective_permute(value: torch.Tensor, pairs: Sequence[Sequence[int]]) -> torch.Tensor:
    """Each ``[source, target]`` pair sends the source process's value to the target process; a
    process no pair targets gets zeros (torch_xla's ``xm.collective_permute``).

    Example::

        st.collective_permute(x, [[0, 1], [1, 2], [2, 3], [3, 0]])   # a ring: each gets its left neighbour's
    """
    value = _tensor(value, "collective_permute")
    n = rt.process_count()
    usage = f"collective_permute: pairs must be a list of [source, target] process indices in 0..{n - 1}"
    if isinstance(pairs, str | bytes) or not isinstance(pairs, Sequence):
        raise TypeError(f"{usage}, got {pairs!r}.")
    for pair in pairs:
        ok = isinstance(pair, Sequence) and not isinstance(pair, str | bytes) and len(pair) == 2
        if not ok or not all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p < n for p in pair):
            raise ValueError(f"{usage}, got {pairs!r}.")
    for side, name in ((0, "source"), (1, "target")):
        ends = [pair[side] for pair in pairs]
        if len(set(ends)) != len(ends):
            raise ValueError(f"{usage}: each process is the {name} of at most one pair, got {pairs!r}.")
    flat_pairs = [int(p) for pair in pairs for p in pair]
    check_same_everywhere("collective_permute", [value], flat_pairs)
    return _OPS.collective_permute(value, flat_pairs)
