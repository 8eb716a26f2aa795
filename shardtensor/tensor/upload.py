"""Uploads: host values onto the devices, sharded (each device receives only its own shard, stored
padded where the sharding does not divide), as the storage cells of new ShardedTensors.
"""

from __future__ import annotations

import jax
import numpy as np
import torch

from shardtensor import metrics as counters
from shardtensor import sharding as sh
from shardtensor.dtypes import to_jax, torch_to_numpy
from shardtensor.graph.ir import Cell
from shardtensor.mesh import default_mesh
from shardtensor.runtime import check_not_forked, warn_float64_on_tpu, with_x64
from shardtensor.tensor.sharded import ShardedTensor


@with_x64  # without 64-bit types jax would store int64 / float64 hosts as int32 / float32
def upload(host: np.ndarray, mesh, spec, sharding=None):
    """A jax array holding ``host`` laid out as (mesh, spec), padded at the end of uneven dims
    (``sharding``: the jax sharding to place it with, when the layout is known as one already)."""
    check_not_forked("move data to the devices")
    warn_float64_on_tpu(host.dtype)
    shape = tuple(host.shape)
    padded = tuple(sh.padded_shape(shape, mesh, spec))
    if padded != shape:
        host = np.pad(host, [(0, p - n) for n, p in zip(shape, padded)])
    return upload_as(host, sharding if sharding is not None else sh.named_sharding(mesh, spec, len(shape)))


@with_x64
def upload_as(host: np.ndarray, sharding) -> jax.Array:
    """A jax array holding ``host`` (already padded where it must be) with the jax ``sharding``.

    Example: ``upload_as(np.ones((8, 2)), existing_array.sharding)``.
    """
    check_not_forked("move data to the devices")
    counters.increment("TransferToDevice")
    with counters.timed("TransferToDeviceTime"):
        return jax.make_array_from_callback(host.shape, sharding, lambda index: private_copy(host[index]))


# jax's CPU client takes a host array aligned to this many bytes as the device buffer (no copy)
_ZERO_COPY_ALIGNMENT = 64


def private_copy(host: np.ndarray) -> np.ndarray:
    """A copy of ``host`` that one device buffer may own: on the CPU platform jax would otherwise
    alias the caller's memory (a later in-place change of the CPU tensor would show through). The
    copy is aligned so that jax takes it as it is instead of copying it again: half the memory
    traffic of an upload, and no second buffer in flight.

    Example: ``jax.make_array_from_callback(a.shape, sharding, lambda i: private_copy(a[i]))``.
    """
    raw = np.empty(host.nbytes + _ZERO_COPY_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % _ZERO_COPY_ALIGNMENT
    out = raw[start : start + host.nbytes].view(host.dtype).reshape(host.shape)
    np.copyto(out, host)
    return out


def cell_from_host(host: np.ndarray, mesh, spec, dtype) -> Cell:
    """A Cell that owns a fresh upload of ``host``; ``spec=None`` stores it replicated."""
    shape = tuple(host.shape)
    if spec is None:
        array = upload(host, mesh, (None,) * len(shape))
        return Cell(array, shape, dtype, owned=True)
    return Cell(upload(host, mesh, spec), shape, dtype, sh.ShardingSpec(mesh, spec), owned=True)


def upload_replicated(t: torch.Tensor) -> ShardedTensor:
    """The CPU tensor ``t`` uploaded, replicated on the default mesh: a transfer, no program.

    Example::

        ids = upload_replicated(torch.tensor([[5, 7, 9]]))
    """
    return ShardedTensor(cell_from_host(torch_to_numpy(t.contiguous()), default_mesh(), None, t.dtype))


def upload_like(t: torch.Tensor, like: ShardedTensor) -> ShardedTensor:
    """The CPU tensor ``t`` uploaded with the layout of ``like`` (for ``dst.copy_(cpu_tensor)``)."""
    return Upload.like(like, t.dtype, tuple(t.shape)).tensor(t)


class Upload:
    """How a CPU tensor is uploaded for ``dst.copy_(src)``: converted to ``dtype``, broadcast to
    ``shape``, laid out as (mesh, spec) (replicated: spec None). An ``st.compile`` replay uploads
    an argument's new value the way its trace did.

    Example: ``Upload.like(dst, dst.dtype, tuple(dst.shape)).array(cpu_tensor)``
    """

    def __init__(self, dtype: torch.dtype, shape: tuple, mesh, spec):
        self.dtype, self.shape, self.mesh, self.spec = dtype, shape, mesh, spec

    @classmethod
    def like(cls, like: ShardedTensor, dtype: torch.dtype, shape: tuple) -> Upload:
        cell = like._cell
        if cell.spec is not None and not like._chain:
            return cls(dtype, shape, cell.mesh, cell.spec)
        return cls(dtype, shape, default_mesh(), None)

    def host(self, t: torch.Tensor) -> np.ndarray:
        return torch_to_numpy(t.to(self.dtype).expand(self.shape).contiguous())

    def array(self, t: torch.Tensor, sharding=None):
        """The jax array ``t`` uploads to (placed with ``sharding``: the one the program was traced
        with, which may be another mesh's when the upload was moved onto the program's mesh)."""
        host = self.host(t)
        return upload(host, self.mesh, self.spec if self.spec is not None else (None,) * host.ndim, sharding)

    def tensor(self, t: torch.Tensor) -> ShardedTensor:
        return ShardedTensor(cell_from_host(self.host(t), self.mesh, self.spec, self.dtype))


def wrap_upload(array, shape, dtype, mesh=None, spec=None) -> ShardedTensor:
    """A ShardedTensor that owns ``array``, a fresh upload of a tensor of logical ``shape`` stored as
    (mesh, spec) (padded where uneven; ``spec=None``: no annotation, XLA's layout).

    Call it on the thread that records ops: it creates a Cell. The upload itself (jax) may run on
    any thread; this is how ``MpDeviceLoader`` hands over batches its threads uploaded.
    """
    counters.increment("TransferToDevice")
    sharding = None if spec is None else sh.ShardingSpec(mesh, spec)
    return ShardedTensor(Cell(array, tuple(shape), dtype, sharding, owned=True))


@with_x64
def zeros_on_devices(shape, dtype: torch.dtype) -> ShardedTensor:
    """A replicated zero tensor made by JAX on the devices at once: no host transfer, and no node in
    the next program (a buffer created this way is an input of every program that uses it, from the
    first on, so a loop that resets it in place records the same program on every pass).

    Example::

        cache = zeros_on_devices((8, 16, 1024, 64), torch.bfloat16)
    """
    check_not_forked("make tensors on the devices")
    shape = tuple(int(n) for n in shape)
    mesh = default_mesh()
    array = jax.numpy.zeros(shape, to_jax(dtype), device=sh.named_sharding(mesh, (None,) * len(shape), len(shape)))
    return ShardedTensor(Cell(array, shape, dtype, owned=True))
