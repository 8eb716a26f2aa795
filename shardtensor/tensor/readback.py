"""Reading a ShardedTensor's value: the stored jax array (computing what is pending) and a CPU copy."""

from __future__ import annotations

import math
import warnings

import jax
import numpy as np
import torch

from shardtensor import metrics as counters
from shardtensor.dtypes import numpy_to_torch
from shardtensor.graph import checks, execute, inflight, state, views
from shardtensor.graph.ir import Cell, Failed
from shardtensor.graph.waiting import ExecutionFailedError, wait_until_ready
from shardtensor.runtime import with_x64


@with_x64
def materialize(t):
    """The concrete stored jax array of ShardedTensor ``t`` (computing what is pending).

    Example: ``materialize(x).sharding`` is where XLA put ``x``'s data.
    """
    cell = t._cell
    if t._chain:
        ref = views.read(t)
        tmp = Cell(ref, t.shape, t.dtype)
        state.set_pending(tmp, ref)
        cell = tmp
    if cell.is_pending():
        state.check_execution_allowed(f"a value of a {tuple(t.shape)} tensor was needed")
        try:
            execute.run_cells(state.pending_cells() + [cell])
        except Exception as error:
            if cell.is_pending() or isinstance(cell.value, Failed):
                raise
            # another pending tensor failed; it keeps its error for whoever reads it
            warnings.warn(
                f"a pending computation failed ({error}); reading that tensor raises the error",
                RuntimeWarning,
                stacklevel=3,
            )
    checks.verify()  # a failed on-device check of this or an earlier run raises before a value is read
    if isinstance(cell.value, Failed):
        cell.value.reraise()
    return cell.value


# A view of a computed value is read by reading its base and replaying the view ops with torch on
# the host, rather than compiling and running a program for the view (each new index of ``x[i]``
# would be one), when the base is at most twice the view or larger by at most this many bytes.
HOST_VIEW_SLACK_BYTES = 1 << 16
_aten = torch.ops.aten
# View ops replayed on the host: those that pick or rearrange elements (torch's CPU kernels give the
# same values as their lowerings). Others (conjugate and negative views, storage views) run a program.
HOST_VIEW_OPS = frozenset(
    {
        _aten.view.default,
        _aten._unsafe_view.default,
        _aten.reshape.default,
        _aten._reshape_alias.default,
        _aten.unsqueeze.default,
        _aten.squeeze.default,
        _aten.squeeze.dim,
        _aten.squeeze.dims,
        _aten.select.int,
        _aten.slice.Tensor,
        _aten.narrow.default,
        _aten.t.default,
        _aten.transpose.int,
        _aten.permute.default,
        _aten.expand.default,
        _aten.unbind.int,
        _aten.split.Tensor,
        _aten.split_with_sizes.default,
        _aten.diagonal.default,
        _aten.unfold.default,
    }
)


@with_x64
def to_cpu(t) -> torch.Tensor:
    """A torch CPU tensor with the value of ``t`` (on several processes: the whole tensor on each).

    Example: ``to_cpu(st.shard(torch.ones(2), mesh, (None,)))`` is ``tensor([1., 1.])``.
    """
    if state.STATE.tracing:  # (an st.compile trace: a replay could not repeat what this value decides)
        state.check_execution_allowed(f"a value of a {tuple(t.shape)} tensor was read on the host")
        state.STATE.trace_broken = state.STATE.trace_broken or state.HOST_READ
    if t._chain and _view_read_on_host(t):
        checks.verify()  # as materialize(): a failed on-device check raises before a value is read
        base = _host_copy(t._cell.value, t._cell.shape)
        for step in t._chain:
            out = step.func(base, *step.args, **step.kwargs)
            base = out if isinstance(out, torch.Tensor) else out[step.index]  # split, unbind: one of several
        return base.clone(memory_format=torch.contiguous_format)
    return _host_copy(materialize(t), t.shape)


def _view_read_on_host(t) -> bool:
    """``t`` is a view of a computed value by ``HOST_VIEW_OPS`` only, and its base is small next to
    it (``HOST_VIEW_SLACK_BYTES``)."""
    if state.STATE.tracing or state.STATE.execution_guard is not None:
        return False  # a capture (st.compile) sees reads as runs, as materialize() makes them
    cell = t._cell
    if cell.is_pending() or isinstance(cell.value, Failed) or any(s.func not in HOST_VIEW_OPS for s in t._chain):
        return False
    itemsize = t.element_size()
    base, view = math.prod(cell.shape) * itemsize, t.numel() * itemsize
    return base <= 2 * view or base - view <= HOST_VIEW_SLACK_BYTES


def _host_copy(a, shape) -> torch.Tensor:
    """A torch CPU tensor with the value of the stored array ``a`` of logical ``shape``."""
    try:
        wait_until_ready([a])  # interruptible, and raises (never hangs) when its program failed
    except ExecutionFailedError:
        with state.ENGINE_LOCK:
            # give back what the failed program overwrote, fail what it computed; raise that failure
            inflight.settle(wait_for=a)
        raise
    with state.ENGINE_LOCK:
        inflight.settle()  # finished runs let go of the old buffers they kept (aliasing off)
    with counters.timed("TransferFromDeviceTime"):
        if a.is_fully_addressable:
            # read through a new array over the same device buffers (no device copy): jax keeps the
            # host copy it makes on the array read, for that array's life; on the stored array every
            # tensor read once would hold host memory as large as itself (a state dict saved tensor by
            # tensor would end up all on the host), where torch's .cpu() keeps nothing
            shards = [s.data for s in a.addressable_shards]
            host = np.asarray(jax.make_array_from_single_device_arrays(a.shape, a.sharding, shards))
        else:
            from jax.experimental import multihost_utils  # only multi-process jobs need it

            host = np.asarray(multihost_utils.process_allgather(a, tiled=True))
    counters.increment("TransferFromDevice")
    host = host[tuple(slice(0, n) for n in shape)]
    return numpy_to_torch(host)
