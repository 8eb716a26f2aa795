"""The functional collectives on device tensors: ``torch.ops._c10d_functional.*`` (what
``torch.distributed._functional_collectives``, its ``*_autograd`` forms and DTensor call), recorded as
``torch.ops.shardtensor.*`` collectives, in eager and lazy mode, in ``st.compile`` and in
``torch.compile(backend="shardtensor")``. ``wait_tensor`` returns its argument: the collective is
recorded like any op.

Example::

    y = torch.distributed._functional_collectives.all_reduce(x, "sum", dist.group.WORLD)
"""

from __future__ import annotations

import torch

from shardtensor.dispatch.collectives import (
    ST_OPS,
    all_reduce,
    all_to_all_flat,
    bound,
    check_equal_splits,
    gather_stacked,
    groups_of,
    reduce_op_name,
)
from shardtensor.dispatch.table import special

_fc = getattr(torch.ops, "_c10d_functional", None)


def _fc_op(name: str):
    return getattr(_fc, name).default


def _check_group_size(group_size: int, size: int, what: str) -> None:
    if group_size != size:
        raise ValueError(f"{what}: group_size {group_size} but the group has {size} processes.")


def _register_functional_handlers() -> None:
    @special(_fc_op("all_reduce"))
    def _f_all_reduce(func, args, kwargs):
        b = bound(func, args, kwargs)
        groups, size = groups_of(b["group_name"], "all_reduce", b)
        return all_reduce(b["input"], reduce_op_name(b["reduce_op"]), groups, size)

    @special(_fc_op("all_reduce_"))
    def _f_all_reduce_(func, args, kwargs):
        b = bound(func, args, kwargs)
        groups, size = groups_of(b["group_name"], "all_reduce_", b)
        x = b["input"]
        return x.copy_(all_reduce(x, reduce_op_name(b["reduce_op"]), groups, size))

    @special(_fc_op("all_reduce_coalesced"))
    def _f_all_reduce_coalesced(func, args, kwargs):
        b = bound(func, args, kwargs)
        groups, size = groups_of(b["group_name"], "all_reduce_coalesced", b)
        op = reduce_op_name(b["reduce_op"])
        return [all_reduce(x, op, groups, size) for x in b["inputs"]]

    @special(_fc_op("all_reduce_coalesced_"))
    def _f_all_reduce_coalesced_(func, args, kwargs):
        b = bound(func, args, kwargs)
        groups, size = groups_of(b["group_name"], "all_reduce_coalesced_", b)
        op = reduce_op_name(b["reduce_op"])
        return [x.copy_(all_reduce(x, op, groups, size)) for x in b["inputs"]]

    def gather(x, group_size, group, what, b):
        groups, size = groups_of(group, what, b)
        _check_group_size(group_size, size, what)
        return ST_OPS.all_gather(x, 0, groups, size) if x.dim() else gather_stacked(x, groups, size)

    @special(_fc_op("all_gather_into_tensor"))
    def _f_all_gather(func, args, kwargs):
        b = bound(func, args, kwargs)
        return gather(b["input"], b["group_size"], b["group_name"], "all_gather_into_tensor", b)

    @special(_fc_op("all_gather_into_tensor_coalesced"))
    def _f_all_gather_coalesced(func, args, kwargs):
        b = bound(func, args, kwargs)
        return [gather(x, b["group_size"], b["group_name"], "all_gather_into_tensor_coalesced", b) for x in b["inputs"]]

    @special(_fc_op("all_gather_into_tensor_out"))
    def _f_all_gather_out(func, args, kwargs):
        b = bound(func, args, kwargs)
        out = b["out"]
        return out.copy_(gather(b["input"], b["group_size"], b["group_name"], "all_gather_into_tensor_out", b))

    def scatter(x, op, group_size, group, what, b):
        groups, size = groups_of(group, what, b)
        _check_group_size(group_size, size, what)
        return ST_OPS.reduce_scatter(x, reduce_op_name(op), 0, groups, size)

    @special(_fc_op("reduce_scatter_tensor"))
    def _f_reduce_scatter(func, args, kwargs):
        b = bound(func, args, kwargs)
        return scatter(b["input"], b["reduce_op"], b["group_size"], b["group_name"], "reduce_scatter_tensor", b)

    @special(_fc_op("reduce_scatter_tensor_coalesced"))
    def _f_reduce_scatter_coalesced(func, args, kwargs):
        b = bound(func, args, kwargs)
        what = "reduce_scatter_tensor_coalesced"
        return [scatter(x, b["reduce_op"], b["group_size"], b["group_name"], what, b) for x in b["inputs"]]

    @special(_fc_op("all_to_all_single"))
    def _f_all_to_all_single(func, args, kwargs):
        b = bound(func, args, kwargs)
        x = b["input"]
        groups, size = groups_of(b["group_name"], "all_to_all_single", b)
        rows = x.shape[0] if x.dim() else 0
        check_equal_splits(b["output_split_sizes"], b["input_split_sizes"], rows, size, "all_to_all_single")
        return all_to_all_flat(x, groups, size, "all_to_all_single").reshape(x.shape)

    @special(_fc_op("broadcast"))
    def _f_broadcast(func, args, kwargs):
        b = bound(func, args, kwargs)
        groups, size = groups_of(b["group_name"], "broadcast", b)
        return ST_OPS.broadcast(b["input"], b["src"], groups, size)

    @special(_fc_op("broadcast_"))
    def _f_broadcast_(func, args, kwargs):
        b = bound(func, args, kwargs)
        groups, size = groups_of(b["group_name"], "broadcast_", b)
        x = b["input"]
        return x.copy_(ST_OPS.broadcast(x, b["src"], groups, size))

    @special(_fc_op("wait_tensor"))
    def _f_wait_tensor(func, args, kwargs):
        # the collective is recorded like any op: nothing to wait for
        return args[0]


if torch.distributed.is_available() and _fc is not None and hasattr(_fc, "all_reduce"):
    _register_functional_handlers()
