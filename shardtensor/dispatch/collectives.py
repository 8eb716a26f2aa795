"""torch.distributed's collectives on device tensors: the ``c10d.*_`` ops that ``dist.all_reduce`` and
friends call, and the functional collectives (``torch.ops._c10d_functional.*``, what
``torch.distributed._functional_collectives`` and DTensor call), mapped onto
``torch.ops.shardtensor.*`` (``ops/collectives.py``).

They reach ``__torch_dispatch__`` before any backend of the process group sees them, so they work in a
group of any backend whose ranks are the job's processes (``init_process_group("shardtensor")``, or
``"gloo"`` started the same way). Like every op they are recorded: in lazy mode a collective is part
of the step's one program, and the ``Work`` an ``async_op=True`` call returns is already complete
(reading the tensor runs what is pending). A rank is a process (``st.process_index()``); a process's
value of a tensor is what ``.cpu()`` reads there.

Each process runs the same program, so a collective has every process take part: the world group,
or any group holding every process works; a group of some of the processes does not (a clear
``NotImplementedError``), nor do point-to-point ``send``/``recv`` (use
``torch.ops.shardtensor.collective_permute``, which every process calls), nor ``gather``/``scatter``
(only the root passes its list).

Example::

    dist.init_process_group("shardtensor")
    x = torch.full((2,), float(dist.get_rank())).to(st.device())
    dist.all_reduce(x)            # x is the sum over every process, in place
"""

from __future__ import annotations

import torch

from shardtensor import runtime
from shardtensor.dispatch.table import special
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.readback import to_cpu

_ST = torch.ops.shardtensor
_REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")


# --------------------------------------------------------------------------- arguments


def _bound(func, args, kwargs) -> dict:
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


def groups_of(group, what: str) -> tuple[list[int], int]:
    """(groups, group_size) for ``torch.ops.shardtensor.*`` from a torch.distributed group, which must
    hold every process of the job (its ranks in group order).

    Example: the world group of 4 processes gives ``([], 4)``; a group of ranks [1, 0] of 2 gives ``([1, 0], 2)``.
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
    return ([] if ranks == list(range(count)) else list(ranks)), count


def _reduce_op_name(op) -> str:
    """'sum', 'avg'... from a c10d ReduceOp (a ScriptObject in dispatch) or a functional op's string."""
    if isinstance(op, str):
        name = op.lower()
    else:
        from torch.distributed import ReduceOp

        code = op.op()  # an int: RedOpType's value
        names = {v.value: k.lower() for k, v in ReduceOp.RedOpType.__members__.items()}
        name = names.get(code, str(code))
    if name not in _REDUCE_OPS:
        raise NotImplementedError(
            f"reduce op {name!r} on shardtensor tensors: supported are {', '.join(_REDUCE_OPS)} "
            "(for premul_sum, scale the tensor first and use SUM)."
        )
    return name


def _work(value):
    """A completed c10d Work (boxed, as the op returns it) whose future holds ``value``: the collective
    is recorded, and reading its result runs it."""
    from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]

    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return _create_work_from_future(future).boxed()


def _device_tensors(tensors, what: str) -> None:
    for t in tensors:
        if not isinstance(t, ShardedTensor):
            raise RuntimeError(
                f"{what}: a CPU tensor mixed with shardtensor tensors in one call. Use one device per call "
                "(CPU tensors go through the group's gloo backend, device tensors through shardtensor)."
            )


# --------------------------------------------------------------------------- the collectives, on one tensor


def _all_reduce(x, op: str, groups, size):
    return _ST.all_reduce(x, op, groups, size)


def _gather_stacked(x, groups, size):
    """(group size, *x.shape): every member's value, in group order."""
    return _ST.all_gather(x.unsqueeze(0), 0, groups, size)


def _reduce_scatter_flat(x, op: str, out_numel: int, groups, size, what: str):
    """The reduction of ``x`` over the group, as ``size`` equal flat parts; this process's part."""
    if x.numel() != out_numel * size:
        raise ValueError(
            f"{what}: the input has {x.numel()} elements, the output {out_numel}; the input must have group size "
            f"({size}) times as many."
        )
    return _ST.reduce_scatter(x.reshape(size, out_numel), op, 0, groups, size).reshape(-1)


def _all_to_all_flat(x, groups, size, what: str):
    if x.dim() == 0 or x.shape[0] % size:
        raise ValueError(f"{what}: dimension 0 of an input of shape {tuple(x.shape)} does not split into {size} parts.")
    return _ST.all_to_all(x.reshape(size, -1), 0, 0, groups, size)


def _equal_splits(output_splits, input_splits, rows: int, size: int, what: str) -> None:
    for splits in (output_splits, input_splits):
        if splits and any(int(s) * size != rows for s in splits):
            raise NotImplementedError(
                f"{what} with split sizes {list(splits)} on shardtensor tensors: only equal splits (dimension 0 "
                f"divided evenly over the {size} processes) are supported, as every process's part must have one "
                "shape in one program. Pad the parts to one size."
            )


# --------------------------------------------------------------------------- c10d ops (dist.*)

_c10d = getattr(torch.ops, "c10d", None)


def _c10d_op(name: str):
    return getattr(_c10d, name).default


def _register_c10d_handlers() -> None:
    @special(_c10d_op("allreduce_"))
    def _allreduce_(func, args, kwargs):
        b = _bound(func, args, kwargs)
        if b["sparse_indices"] is not None:
            raise NotImplementedError("dist.all_reduce of sparse tensors: shardtensor tensors are dense.")
        tensors = b["tensors"]
        _device_tensors(tensors, "dist.all_reduce")
        op = _reduce_op_name(b["reduce_op"])
        groups, size = groups_of(b["process_group"], "dist.all_reduce")
        for t in tensors:
            t.copy_(_all_reduce(t, op, groups, size))
        return tensors, _work(tensors)

    @special(_c10d_op("allreduce_coalesced_"))
    def _allreduce_coalesced_(func, args, kwargs):
        b = _bound(func, args, kwargs)
        tensors = b["tensors"]
        _device_tensors(tensors, "dist.all_reduce_coalesced")
        op = _reduce_op_name(b["reduce_op"])
        groups, size = groups_of(b["process_group"], "dist.all_reduce_coalesced")
        for t in tensors:
            t.copy_(_all_reduce(t, op, groups, size))
        return _work(tensors)

    @special(_c10d_op("allgather_"))
    def _allgather_(func, args, kwargs):
        b = _bound(func, args, kwargs)
        outputs, inputs = b["output_tensors"], b["input_tensors"]
        groups, size = groups_of(b["process_group"], "dist.all_gather")
        for out_list, x in zip(outputs, inputs):
            _device_tensors([x, *out_list], "dist.all_gather")
            if len(out_list) != size:
                raise ValueError(f"dist.all_gather: {len(out_list)} output tensors for a group of {size} processes.")
            stacked = _gather_stacked(x, groups, size)
            for i, out in enumerate(out_list):
                out.copy_(stacked[i])
        return outputs, _work(outputs)

    @special(_c10d_op("_allgather_base_"))
    def _allgather_base_(func, args, kwargs):
        b = _bound(func, args, kwargs)
        out, x = b["output_tensor"], b["input_tensor"]
        _device_tensors([out, x], "dist.all_gather_into_tensor")
        groups, size = groups_of(b["process_group"], "dist.all_gather_into_tensor")
        if out.numel() != x.numel() * size:
            raise ValueError(
                f"dist.all_gather_into_tensor: the output has {out.numel()} elements, the input {x.numel()}; the "
                f"output must have group size ({size}) times as many."
            )
        # stacked (size, *x.shape) or concatenated (size * x.shape[0], ...): the same elements in order
        out.copy_(_gather_stacked(x, groups, size).reshape(out.shape))
        return out, _work([out])

    @special(_c10d_op("allgather_into_tensor_coalesced_"))
    def _allgather_into_tensor_coalesced_(func, args, kwargs):
        b = _bound(func, args, kwargs)
        for out, x in zip(b["outputs"], b["inputs"]):
            _allgather_base_(_c10d_op("_allgather_base_"), (out, x, b["process_group"]), {})
        return _work(b["outputs"])

    @special(_c10d_op("gather_"), _c10d_op("scatter_"))
    def _rooted(func, args, kwargs):
        # only the root passes the list: the processes would record different programs, and programs
        # that differ may order their collectives differently (a deadlock)
        name = "gather" if func == _c10d_op("gather_") else "scatter"
        instead = (
            "dist.all_gather (every process receives the list; keep it where you need it)"
            if name == "gather"
            else "dist.broadcast of the stacked list from src, then take your part (or dist.all_to_all)"
        )
        raise NotImplementedError(
            f"dist.{name} on shardtensor tensors: only the root process passes its list, so the processes would "
            f"record different programs, and every process must run the same one. Use {instead}."
        )

    @special(_c10d_op("reduce_scatter_"))
    def _reduce_scatter_(func, args, kwargs):
        b = _bound(func, args, kwargs)
        outputs, inputs = b["output_tensors"], b["input_tensors"]
        op = _reduce_op_name(b["reduce_op"])
        groups, size = groups_of(b["process_group"], "dist.reduce_scatter")
        for out, in_list in zip(outputs, inputs):
            _device_tensors([out, *in_list], "dist.reduce_scatter")
            if len(in_list) != size:
                raise ValueError(f"dist.reduce_scatter: {len(in_list)} input tensors for a group of {size} processes.")
            stacked = torch.stack([t.reshape(out.shape) for t in in_list])
            out.copy_(_ST.reduce_scatter(stacked, op, 0, groups, size)[0])
        return outputs, _work(outputs)

    @special(_c10d_op("_reduce_scatter_base_"))
    def _reduce_scatter_base_(func, args, kwargs):
        b = _bound(func, args, kwargs)
        out, x = b["output_tensor"], b["input_tensor"]
        _device_tensors([out, x], "dist.reduce_scatter_tensor")
        op = _reduce_op_name(b["reduce_op"])
        groups, size = groups_of(b["process_group"], "dist.reduce_scatter_tensor")
        part = _reduce_scatter_flat(x, op, out.numel(), groups, size, "dist.reduce_scatter_tensor")
        out.copy_(part.reshape(out.shape))
        return out, _work([out])

    @special(_c10d_op("reduce_scatter_tensor_coalesced_"))
    def _reduce_scatter_tensor_coalesced_(func, args, kwargs):
        b = _bound(func, args, kwargs)
        for out, x in zip(b["outputs"], b["inputs"]):
            _reduce_scatter_base_(_c10d_op("_reduce_scatter_base_"), (out, x, b["process_group"], b["reduce_op"]), {})
        return _work(b["outputs"])

    @special(_c10d_op("alltoall_base_"))
    def _alltoall_base_(func, args, kwargs):
        b = _bound(func, args, kwargs)
        out, x = b["output"], b["input"]
        _device_tensors([out, x], "dist.all_to_all_single")
        groups, size = groups_of(b["process_group"], "dist.all_to_all_single")
        rows = x.shape[0] if x.dim() else 0
        _equal_splits(b["output_split_sizes"], b["input_split_sizes"], rows, size, "dist.all_to_all_single")
        if out.shape != x.shape:
            raise ValueError(
                f"dist.all_to_all_single with equal splits: the output's shape {tuple(out.shape)} must be the "
                f"input's, {tuple(x.shape)}."
            )
        out.copy_(_all_to_all_flat(x, groups, size, "dist.all_to_all_single").reshape(out.shape))
        return _work([out])

    @special(_c10d_op("alltoall_"))
    def _alltoall_(func, args, kwargs):
        b = _bound(func, args, kwargs)
        outputs, inputs = b["output_tensors"], b["input_tensors"]
        _device_tensors([*outputs, *inputs], "dist.all_to_all")
        groups, size = groups_of(b["process_group"], "dist.all_to_all")
        shapes = {tuple(t.shape) for t in (*outputs, *inputs)}
        if len(inputs) != size or len(outputs) != size or len(shapes) != 1:
            raise NotImplementedError(
                f"dist.all_to_all on shardtensor tensors takes {size} inputs and {size} outputs of one shape "
                "(one per process); pad the parts to one shape."
            )
        received = _ST.all_to_all(torch.stack(list(inputs)), 0, 0, groups, size)
        for i, out in enumerate(outputs):
            out.copy_(received[i])
        return outputs, _work(outputs)

    @special(_c10d_op("broadcast_"))
    def _broadcast_(func, args, kwargs):
        b = _bound(func, args, kwargs)
        tensors = b["tensors"]
        _device_tensors(tensors, "dist.broadcast")
        groups, size = groups_of(b["process_group"], "dist.broadcast")
        # root_rank is the source's rank in the group (dist.broadcast translates a global src)
        for t in tensors:
            t.copy_(_ST.broadcast(t, b["root_rank"], groups, size))
        return tensors, _work(tensors)

    @special(_c10d_op("reduce_"))
    def _reduce_(func, args, kwargs):
        # every process gets the result: torch leaves the non-destination tensors unspecified
        b = _bound(func, args, kwargs)
        tensors = b["tensors"]
        _device_tensors(tensors, "dist.reduce")
        op = _reduce_op_name(b["reduce_op"])
        groups, size = groups_of(b["process_group"], "dist.reduce")
        for t in tensors:
            t.copy_(_all_reduce(t, op, groups, size))
        return _work(tensors)

    @special(_c10d_op("barrier"))
    def _barrier(func, args, kwargs):
        b = _bound(func, args, kwargs)
        groups, size = groups_of(b["process_group"], "dist.barrier")
        # a value every process waits for: run now
        to_cpu(_ST.all_reduce(torch.zeros((), dtype=torch.int32, device=b["tensor"].device), "sum", groups, size))
        return _work([])

    @special(_c10d_op("send"), _c10d_op("recv_"), _c10d_op("recv_any_source_"))
    def _point_to_point(func, args, kwargs):
        raise NotImplementedError(
            f"{func} (dist.send / dist.recv / isend / irecv / batch_isend_irecv) on shardtensor tensors: a call "
            "made by only two processes cannot be part of the program every process runs (SPMD). Use "
            "torch.ops.shardtensor.collective_permute(x, [src, dst, ...]) (JAX's ppermute; "
            "st.collective_permute), which every process calls: each source sends, each destination receives."
        )


# --------------------------------------------------------------------------- functional collectives


_fc = getattr(torch.ops, "_c10d_functional", None)


def _fc_op(name: str):
    return getattr(_fc, name).default


def _check_group_size(group_size: int, size: int, what: str) -> None:
    if group_size != size:
        raise ValueError(f"{what}: group_size {group_size} but the group has {size} processes.")


def _register_functional_handlers() -> None:
    @special(_fc_op("all_reduce"))
    def _f_all_reduce(func, args, kwargs):
        b = _bound(func, args, kwargs)
        groups, size = groups_of(b["group_name"], "all_reduce")
        return _all_reduce(b["input"], _reduce_op_name(b["reduce_op"]), groups, size)

    @special(_fc_op("all_reduce_"))
    def _f_all_reduce_(func, args, kwargs):
        b = _bound(func, args, kwargs)
        groups, size = groups_of(b["group_name"], "all_reduce_")
        x = b["input"]
        return x.copy_(_all_reduce(x, _reduce_op_name(b["reduce_op"]), groups, size))

    @special(_fc_op("all_reduce_coalesced"))
    def _f_all_reduce_coalesced(func, args, kwargs):
        b = _bound(func, args, kwargs)
        groups, size = groups_of(b["group_name"], "all_reduce_coalesced")
        op = _reduce_op_name(b["reduce_op"])
        return [_all_reduce(x, op, groups, size) for x in b["inputs"]]

    @special(_fc_op("all_reduce_coalesced_"))
    def _f_all_reduce_coalesced_(func, args, kwargs):
        b = _bound(func, args, kwargs)
        groups, size = groups_of(b["group_name"], "all_reduce_coalesced_")
        op = _reduce_op_name(b["reduce_op"])
        return [x.copy_(_all_reduce(x, op, groups, size)) for x in b["inputs"]]

    def gather(x, group_size, group, what):
        groups, size = groups_of(group, what)
        _check_group_size(group_size, size, what)
        return _ST.all_gather(x, 0, groups, size) if x.dim() else _gather_stacked(x, groups, size)

    @special(_fc_op("all_gather_into_tensor"))
    def _f_all_gather(func, args, kwargs):
        b = _bound(func, args, kwargs)
        return gather(b["input"], b["group_size"], b["group_name"], "all_gather_into_tensor")

    @special(_fc_op("all_gather_into_tensor_coalesced"))
    def _f_all_gather_coalesced(func, args, kwargs):
        b = _bound(func, args, kwargs)
        return [gather(x, b["group_size"], b["group_name"], "all_gather_into_tensor_coalesced") for x in b["inputs"]]

    @special(_fc_op("all_gather_into_tensor_out"))
    def _f_all_gather_out(func, args, kwargs):
        b = _bound(func, args, kwargs)
        out = b["out"]
        return out.copy_(gather(b["input"], b["group_size"], b["group_name"], "all_gather_into_tensor_out"))

    def scatter(x, op, group_size, group, what):
        groups, size = groups_of(group, what)
        _check_group_size(group_size, size, what)
        return _ST.reduce_scatter(x, _reduce_op_name(op), 0, groups, size)

    @special(_fc_op("reduce_scatter_tensor"))
    def _f_reduce_scatter(func, args, kwargs):
        b = _bound(func, args, kwargs)
        return scatter(b["input"], b["reduce_op"], b["group_size"], b["group_name"], "reduce_scatter_tensor")

    @special(_fc_op("reduce_scatter_tensor_coalesced"))
    def _f_reduce_scatter_coalesced(func, args, kwargs):
        b = _bound(func, args, kwargs)
        what = "reduce_scatter_tensor_coalesced"
        return [scatter(x, b["reduce_op"], b["group_size"], b["group_name"], what) for x in b["inputs"]]

    @special(_fc_op("all_to_all_single"))
    def _f_all_to_all_single(func, args, kwargs):
        b = _bound(func, args, kwargs)
        x = b["input"]
        groups, size = groups_of(b["group_name"], "all_to_all_single")
        rows = x.shape[0] if x.dim() else 0
        _equal_splits(b["output_split_sizes"], b["input_split_sizes"], rows, size, "all_to_all_single")
        return _all_to_all_flat(x, groups, size, "all_to_all_single").reshape(x.shape)

    @special(_fc_op("broadcast"))
    def _f_broadcast(func, args, kwargs):
        b = _bound(func, args, kwargs)
        groups, size = groups_of(b["group_name"], "broadcast")
        return _ST.broadcast(b["input"], b["src"], groups, size)

    @special(_fc_op("broadcast_"))
    def _f_broadcast_(func, args, kwargs):
        b = _bound(func, args, kwargs)
        groups, size = groups_of(b["group_name"], "broadcast_")
        x = b["input"]
        return x.copy_(_ST.broadcast(x, b["src"], groups, size))

    @special(_fc_op("wait_tensor"))
    def _f_wait_tensor(func, args, kwargs):
        # the collective is recorded like any op: nothing to wait for
        return args[0]


if torch.distributed.is_available() and _c10d is not None and hasattr(_c10d, "allreduce_"):
    _register_c10d_handlers()
if torch.distributed.is_available() and _fc is not None and hasattr(_fc, "all_reduce"):
    _register_functional_handlers()
