"""torch.distributed's collectives on device tensors: the ``c10d.*_`` ops that ``dist.all_reduce`` and
friends call, recorded as ``torch.ops.shardtensor.*`` collectives and written back in place.

Like every op they are recorded: in lazy mode a collective is part of the step's one program, and
the ``Work`` an ``async_op=True`` call returns is already complete (reading the tensor runs what is
pending). Point-to-point ``send``/``recv`` (use ``torch.ops.shardtensor.collective_permute``, which
every process calls) and ``gather``/``scatter`` (only the root passes its list) raise.

Example::

    dist.init_process_group("shardtensor")
    x = torch.full((2,), float(dist.get_rank())).to(st.device())
    dist.all_reduce(x)            # x is the sum over every process, in place
"""

from __future__ import annotations

import torch

from shardtensor.dispatch.collectives import (
    ST_OPS,
    all_reduce,
    all_to_all_flat,
    bound,
    check_device_tensors,
    check_equal_splits,
    completed_work,
    gather_stacked,
    groups_of,
    reduce_op_name,
    reduce_scatter_flat,
)
from shardtensor.dispatch.table import special
from shardtensor.tensor.readback import to_cpu

_c10d = getattr(torch.ops, "c10d", None)


def _c10d_op(name: str):
    return getattr(_c10d, name).default


def _all_reduce_in_place(b: dict, what: str) -> list:
    """Each of the op's ``tensors`` replaced in place by its all-reduce over the op's group."""
    tensors = b["tensors"]
    check_device_tensors(tensors, what)
    op = reduce_op_name(b["reduce_op"])
    groups, size = groups_of(b["process_group"], what, b)
    for t in tensors:
        t.copy_(all_reduce(t, op, groups, size))
    return tensors


def _register_c10d_handlers() -> None:
    @special(_c10d_op("allreduce_"))
    def _allreduce_(func, args, kwargs):
        b = bound(func, args, kwargs)
        if b["sparse_indices"] is not None:
            raise NotImplementedError("dist.all_reduce of sparse tensors: shardtensor tensors are dense.")
        tensors = _all_reduce_in_place(b, "dist.all_reduce")
        return tensors, completed_work(tensors)

    @special(_c10d_op("allreduce_coalesced_"))
    def _allreduce_coalesced_(func, args, kwargs):
        return completed_work(_all_reduce_in_place(bound(func, args, kwargs), "dist.all_reduce_coalesced"))

    @special(_c10d_op("allgather_"))
    def _allgather_(func, args, kwargs):
        b = bound(func, args, kwargs)
        outputs, inputs = b["output_tensors"], b["input_tensors"]
        groups, size = groups_of(b["process_group"], "dist.all_gather", b)
        for out_list, x in zip(outputs, inputs):
            check_device_tensors([x, *out_list], "dist.all_gather")
            if len(out_list) != size:
                raise ValueError(f"dist.all_gather: {len(out_list)} output tensors for a group of {size} processes.")
            stacked = gather_stacked(x, groups, size)
            for i, out in enumerate(out_list):
                out.copy_(stacked[i])
        return outputs, completed_work(outputs)

    @special(_c10d_op("_allgather_base_"))
    def _allgather_base_(func, args, kwargs):
        b = bound(func, args, kwargs)
        out, x = b["output_tensor"], b["input_tensor"]
        check_device_tensors([out, x], "dist.all_gather_into_tensor")
        groups, size = groups_of(b["process_group"], "dist.all_gather_into_tensor", b)
        if out.numel() != x.numel() * size:
            raise ValueError(
                f"dist.all_gather_into_tensor: the output has {out.numel()} elements, the input {x.numel()}; the "
                f"output must have group size ({size}) times as many."
            )
        # stacked (size, *x.shape) or concatenated (size * x.shape[0], ...): the same elements in order
        out.copy_(gather_stacked(x, groups, size).reshape(out.shape))
        return out, completed_work([out])

    @special(_c10d_op("allgather_into_tensor_coalesced_"))
    def _allgather_into_tensor_coalesced_(func, args, kwargs):
        b = bound(func, args, kwargs)
        for out, x in zip(b["outputs"], b["inputs"]):
            _allgather_base_(_c10d_op("_allgather_base_"), (out, x, b["process_group"]), {})
        return completed_work(b["outputs"])

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
        b = bound(func, args, kwargs)
        outputs, inputs = b["output_tensors"], b["input_tensors"]
        op = reduce_op_name(b["reduce_op"])
        groups, size = groups_of(b["process_group"], "dist.reduce_scatter", b)
        for out, in_list in zip(outputs, inputs):
            check_device_tensors([out, *in_list], "dist.reduce_scatter")
            if len(in_list) != size:
                raise ValueError(f"dist.reduce_scatter: {len(in_list)} input tensors for a group of {size} processes.")
            stacked = torch.stack([t.reshape(out.shape) for t in in_list])
            out.copy_(ST_OPS.reduce_scatter(stacked, op, 0, groups, size)[0])
        return outputs, completed_work(outputs)

    @special(_c10d_op("_reduce_scatter_base_"))
    def _reduce_scatter_base_(func, args, kwargs):
        b = bound(func, args, kwargs)
        out, x = b["output_tensor"], b["input_tensor"]
        check_device_tensors([out, x], "dist.reduce_scatter_tensor")
        op = reduce_op_name(b["reduce_op"])
        groups, size = groups_of(b["process_group"], "dist.reduce_scatter_tensor", b)
        part = reduce_scatter_flat(x, op, out.numel(), groups, size, "dist.reduce_scatter_tensor")
        out.copy_(part.reshape(out.shape))
        return out, completed_work([out])

    @special(_c10d_op("reduce_scatter_tensor_coalesced_"))
    def _reduce_scatter_tensor_coalesced_(func, args, kwargs):
        b = bound(func, args, kwargs)
        for out, x in zip(b["outputs"], b["inputs"]):
            _reduce_scatter_base_(_c10d_op("_reduce_scatter_base_"), (out, x, b["process_group"], b["reduce_op"]), {})
        return completed_work(b["outputs"])

    @special(_c10d_op("alltoall_base_"))
    def _alltoall_base_(func, args, kwargs):
        b = bound(func, args, kwargs)
        out, x = b["output"], b["input"]
        check_device_tensors([out, x], "dist.all_to_all_single")
        groups, size = groups_of(b["process_group"], "dist.all_to_all_single", b)
        rows = x.shape[0] if x.dim() else 0
        check_equal_splits(b["output_split_sizes"], b["input_split_sizes"], rows, size, "dist.all_to_all_single")
        if out.shape != x.shape:
            raise ValueError(
                f"dist.all_to_all_single with equal splits: the output's shape {tuple(out.shape)} must be the "
                f"input's, {tuple(x.shape)}."
            )
        out.copy_(all_to_all_flat(x, groups, size, "dist.all_to_all_single").reshape(out.shape))
        return completed_work([out])

    @special(_c10d_op("alltoall_"))
    def _alltoall_(func, args, kwargs):
        b = bound(func, args, kwargs)
        outputs, inputs = b["output_tensors"], b["input_tensors"]
        check_device_tensors([*outputs, *inputs], "dist.all_to_all")
        groups, size = groups_of(b["process_group"], "dist.all_to_all", b)
        shapes = {tuple(t.shape) for t in (*outputs, *inputs)}
        if len(inputs) != size or len(outputs) != size or len(shapes) != 1:
            raise NotImplementedError(
                f"dist.all_to_all on shardtensor tensors takes {size} inputs and {size} outputs of one shape "
                "(one per process); pad the parts to one shape."
            )
        received = ST_OPS.all_to_all(torch.stack(list(inputs)), 0, 0, groups, size)
        for i, out in enumerate(outputs):
            out.copy_(received[i])
        return outputs, completed_work(outputs)

    @special(_c10d_op("broadcast_"))
    def _broadcast_(func, args, kwargs):
        b = bound(func, args, kwargs)
        tensors = b["tensors"]
        check_device_tensors(tensors, "dist.broadcast")
        groups, size = groups_of(b["process_group"], "dist.broadcast", b)
        # root_rank is the source's rank in the group (dist.broadcast translates a global src)
        for t in tensors:
            t.copy_(ST_OPS.broadcast(t, b["root_rank"], groups, size))
        return tensors, completed_work(tensors)

    @special(_c10d_op("reduce_"))
    def _reduce_(func, args, kwargs):
        # every process gets the result: torch leaves the non-destination tensors unspecified
        return completed_work(_all_reduce_in_place(bound(func, args, kwargs), "dist.reduce"))

    @special(_c10d_op("barrier"))
    def _barrier(func, args, kwargs):
        b = bound(func, args, kwargs)
        groups, size = groups_of(b["process_group"], "dist.barrier", b)
        # a value every process waits for: run now
        to_cpu(ST_OPS.all_reduce(torch.zeros((), dtype=torch.int32, device=b["tensor"].device), "sum", groups, size))
        return completed_work([])

    @special(_c10d_op("send"), _c10d_op("recv_"), _c10d_op("recv_any_source_"))
    def _point_to_point(func, args, kwargs):
        raise NotImplementedError(
            f"{func} (dist.send / dist.recv / isend / irecv / batch_isend_irecv) on shardtensor tensors: a call "
            "made by only two processes cannot be part of the program every process runs (SPMD). Use "
            "torch.ops.shardtensor.collective_permute(x, [src, dst, ...]) (JAX's ppermute; "
            "st.collective_permute), which every process calls: each source sends, each destination receives."
        )


if torch.distributed.is_available() and _c10d is not None and hasattr(_c10d, "allreduce_"):
    _register_c10d_handlers()
