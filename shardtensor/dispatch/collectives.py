"""torch.distributed's groups, reduce ops and ops on lists, as the arguments of ``torch.ops.shardtensor.*``
(``ops/collectives.py``): what the handlers of ``c10d_ops`` (``dist.*``) and ``functional_collectives``
share.

torch.distributed's collectives reach ``__torch_dispatch__`` before any backend of the process group
sees them, so they work in a group of any backend whose ranks are the job's processes
(``init_process_group("shardtensor")``, or ``"gloo"`` started the same way). A rank is a process
(``st.process_index()``); a process's value of a tensor is what ``.cpu()`` reads there. Each process
runs the same program, so every process takes part in each collective: the world group, or any
group holding every process, works; a group of some of the processes does not (a clear
``NotImplementedError``).

Example::

    groups_of(dist.group.WORLD, "dist.all_reduce")   # ([], 2) in a job of 2 processes
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from shardtensor import runtime
from shardtensor.ops.collectives import REDUCE_OPS
from shardtensor.tensor import ShardedTensor

ST_OPS = torch.ops.shardtensor  # the collectives these handlers record


# --------------------------------------------------------------------------- arguments


def bound(func, args, kwargs) -> dict:
    """The op's arguments by name, defaults filled in."""
    out = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value
    return out


def _process_group(group):
    """A ProcessGroup from what an op receives: a ScriptObject (c10d ops), a group name or a group
    (functional collectives)."""
    from torch.distributed import distributed_c10d as c10d

    if isinstance(group, torch.ScriptObject):
        return c10d.ProcessGroup.unbox(group)
    if isinstance(group, str):
        return c10d._resolve_process_group(c10d.GroupName(group))
    return group


def _check_ranks_are_processes() -> None:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if (rank, world) != (runtime.process_index(), runtime.process_count()):
        raise RuntimeError(
            f"torch.distributed collective on a shardtensor tensor: this process is rank {rank} of {world} in "
            f"torch.distributed but process {runtime.process_index()} of {runtime.process_count()} of shardtensor's "
            "job, and a rank must be a process. Start the processes with st.launch (or torchrun with "
            "SHARDTENSOR_AUTO_DISTRIBUTED=1) and call dist.init_process_group('shardtensor')."
        )


def groups_of(group, what: str, b: dict | None = None) -> tuple[list[int], int]:
    """(groups, group_size) for ``torch.ops.shardtensor.*`` from a torch.distributed group (a
    ProcessGroup, its ScriptObject, or its name), which must hold every process of the job. With the
    op's arguments ``b``, also checks that every process passed them alike (`check_same_everywhere`).

    Example::

        groups_of(dist.group.WORLD, "dist.all_reduce")   # ([], 4) in a job of 4 processes
    """
    import torch.distributed as dist

    _check_ranks_are_processes()
    ranks = dist.get_process_group_ranks(_process_group(group))
    count = runtime.process_count()
    if sorted(ranks) != list(range(count)):
        raise NotImplementedError(
            f"{what} on shardtensor tensors in a process group of ranks {ranks}, which is not every one of the "
            f"{count} processes: every process runs the same program, so every process takes part in each "
            "collective. Use the world group (or a group of every process); for collectives within parts of the "
            "job, every process calls torch.ops.shardtensor.* with groups of processes, e.g. "
            "torch.ops.shardtensor.all_reduce(x, 'sum', [0, 1, 2, 3], 2) for the pairs [0, 1] and [2, 3]."
        )
    if b is not None:
        check_same_everywhere(b, what)
    return ([] if ranks == list(range(count)) else list(ranks)), count


# The check that every process passes a collective alike; set by shardtensor.distributed, which owns the
# job's coordination service (a higher layer): check(what, tensors, *arguments) raises in every process
_AGREEMENT: list[Callable[..., None]] = []
# arguments that may differ between processes without changing the program
_NOT_COMPARED = frozenset({"process_group", "group_name", "async_op", "timeout"})


def set_agreement_check(check: Callable[..., None]) -> None:
    """Use ``check(what, tensors, *arguments)`` to compare each collective's arguments across the
    processes before it is recorded (shardtensor.distributed installs its own when imported).

    Example: ``set_agreement_check(agreement.check_same_everywhere)``.
    """
    _AGREEMENT[:] = [check]


def check_same_everywhere(b: dict, what: str) -> None:
    """Raise ``ValueError`` in every process when the processes passed the collective ``what`` (its
    arguments ``b``, from `bound`) tensors of different shapes or dtypes, or different other arguments:
    their programs would not match, and the job would hang or abort. Call it after `groups_of` (a
    group of some processes only is refused first, in the processes that call it).

    Example: ``check_same_everywhere(b, "dist.all_reduce")``.
    """
    if runtime.process_count() == 1 or not _AGREEMENT:
        return
    tensors: list[torch.Tensor] = []
    arguments: list = []
    for name, value in b.items():
        if name in _NOT_COMPARED:
            continue
        leaves = pytree.tree_leaves(value)
        if leaves and all(isinstance(t, torch.Tensor) for t in leaves):
            tensors.extend(leaves)
            arguments.append(f"{name}: {pytree.tree_map(lambda _: '*', value)}")  # the lists' structure
        elif name == "reduce_op":
            arguments.append(reduce_op_name(value))
        elif value is not None:
            arguments.append(value)
    _AGREEMENT[0](what, tensors, *arguments)


def reduce_op_name(op) -> str:
    """'sum', 'avg'... from a c10d ReduceOp (a ScriptObject in dispatch) or a functional op's string.

    Example: ``reduce_op_name("SUM") == "sum"``.
    """
    if isinstance(op, str):
        name = op.lower()
    else:
        from torch.distributed import ReduceOp

        code = op.op()  # an int: RedOpType's value
        names = {v.value: k.lower() for k, v in ReduceOp.RedOpType.__members__.items()}
        name = names.get(code, str(code))
    if name not in REDUCE_OPS:
        raise NotImplementedError(
            f"reduce op {name!r} on shardtensor tensors: supported are {', '.join(REDUCE_OPS)} "
            "(for premul_sum, scale the tensor first and use SUM)."
        )
    return name


def completed_work(value):
    """A completed c10d Work (boxed, as the op returns it) whose future holds ``value``: the collective
    is recorded, and reading its result runs it.

    Example: ``return tensors, completed_work(tensors)`` (what ``c10d.allreduce_`` returns).
    """
    from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]

    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return _create_work_from_future(future).boxed()


def check_device_tensors(tensors, what: str) -> None:
    """Raise when a call mixes CPU tensors with device tensors.

    Example: ``check_device_tensors([out, x], "dist.all_gather_into_tensor")``.
    """
    for t in tensors:
        if not isinstance(t, ShardedTensor):
            raise RuntimeError(
                f"{what}: a CPU tensor mixed with shardtensor tensors in one call. Use one device per call "
                "(CPU tensors go through the group's gloo backend, device tensors through shardtensor)."
            )


# --------------------------------------------------------------------------- the collectives, on one tensor


def all_reduce(x, op: str, groups, size):
    """The reduction of ``x`` over the group (``torch.ops.shardtensor.all_reduce``).

    Example: ``all_reduce(x, "sum", *groups_of(dist.group.WORLD, "all_reduce"))``.
    """
    return ST_OPS.all_reduce(x, op, groups, size)


def gather_stacked(x, groups, size):
    """(group size, *x.shape): every member's value, in group order.

    Example: ``gather_stacked(x, [], 2)[1]`` is process 1's ``x``.
    """
    return ST_OPS.all_gather(x.unsqueeze(0), 0, groups, size)


def reduce_scatter_flat(x, op: str, out_numel: int, groups, size, what: str):
    """The reduction of ``x`` over the group, as ``size`` equal flat parts; this process's part.

    Example: ``reduce_scatter_flat(x, "sum", x.numel() // 2, [], 2, "dist.reduce_scatter_tensor")``.
    """
    if x.numel() != out_numel * size:
        raise ValueError(
            f"{what}: the input has {x.numel()} elements, the output {out_numel}; the input must have group size "
            f"({size}) times as many."
        )
    return ST_OPS.reduce_scatter(x.reshape(size, out_numel), op, 0, groups, size).reshape(-1)


def all_to_all_flat(x, groups, size, what: str):
    """``x``'s dimension 0 in ``size`` equal parts, part i to the group's member i; (size, -1): the parts
    received, in group order.

    Example: ``all_to_all_flat(x, [], 2, "dist.all_to_all_single").reshape(x.shape)``.
    """
    if x.dim() == 0 or x.shape[0] % size:
        raise ValueError(f"{what}: dimension 0 of an input of shape {tuple(x.shape)} does not split into {size} parts.")
    return ST_OPS.all_to_all(x.reshape(size, -1), 0, 0, groups, size)


def check_equal_splits(output_splits, input_splits, rows: int, size: int, what: str) -> None:
    """Raise unless the split sizes (empty: equal) divide ``rows`` evenly over the ``size`` processes.

    Example: ``check_equal_splits([2, 2], [2, 2], 4, 2, "dist.all_to_all_single")`` passes.
    """
    for splits in (output_splits, input_splits):
        if splits and any(int(s) * size != rows for s in splits):
            raise NotImplementedError(
                f"{what} with split sizes {list(splits)} on shardtensor tensors: only equal splits (dimension 0 "
                f"divided evenly over the {size} processes) are supported, as every process's part must have one "
                "shape in one program. Pad the parts to one size."
            )
