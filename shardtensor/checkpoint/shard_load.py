"""Loading a ShardedTensor shard by shard: each process reads only its own distinct shards.

A ``ShardLoad`` holds one host buffer per distinct region of the tensor that this process's devices
hold (replicas share one; padding has none). DCP's reads copy the stored chunks into those buffers;
when every element has been written, the buffers are uploaded device by device and become the
tensor's stored array, with the tensor's own sharding. No step is a global operation, so processes
that read different chunks in different orders never have to agree on anything.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shardtensor import metrics as counters
from shardtensor import runtime
from shardtensor.dtypes import torch_to_numpy
from shardtensor.graph import state
from shardtensor.tensor.sharded import ShardedTensor


class ShardLoad:
    """The pending load of one ShardedTensor: host buffers of its distinct addressable shards.

    The buffers are allocated when DCP first reads into them. ``install=True`` puts the uploaded
    array into the tensor's storage as soon as the buffers are full (DCP's default planner has no
    later hook); ``install=False`` keeps it in ``array`` for a planner that installs every tensor at
    once.

    Example::

        ShardLoad(x).regions   # {offsets: sizes} of the distinct shards this process reads
    """

    def __init__(self, tensor: ShardedTensor, install: bool = True) -> None:
        array = tensor._concrete_array()
        self.cell = tensor._cell
        self.sharding = array.sharding
        self.padded_shape = tuple(array.shape)
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self.install_when_full = install
        self.array: Any = None  # the uploaded jax array, once the buffers are full
        # device -> (offsets of its region or None for padding only, its padded shard shape)
        self.devices: list[tuple[Any, tuple[int, ...] | None, tuple[int, ...]]] = []
        self.regions: dict[tuple[int, ...], tuple[int, ...]] = {}  # offsets -> sizes, distinct
        index_map = self.sharding.addressable_devices_indices_map(self.padded_shape)
        for device in sorted(index_map, key=lambda d: d.id):
            bounds = [s.indices(n)[:2] for s, n in zip(index_map[device], self.padded_shape)]
            offsets = tuple(min(lo, n) for (lo, _), n in zip(bounds, self.shape))
            sizes = tuple(min(hi, n) - lo for (_, hi), n, lo in zip(bounds, self.shape, offsets))
            real = 0 not in sizes
            if real:
                self.regions.setdefault(offsets, sizes)
            self.devices.append((device, offsets if real else None, tuple(hi - lo for lo, hi in bounds)))
        self.total = sum(int(np.prod(sizes)) for sizes in self.regions.values())
        self.buffers: dict[tuple[int, ...], torch.Tensor] = {}  # allocated when first read into
        self.written: dict[str, int] = {}  # elements copied in, per state-dict key (tied weights)

    def buffer(self, fqn: str, offsets: tuple[int, ...]) -> torch.Tensor:
        """The buffer of the region at ``offsets``, counting what DCP copies into it for ``fqn``."""
        if offsets not in self.regions:
            raise ValueError(
                f"{fqn}: no shard of this process starts at {offsets} (its shards start at {sorted(self.regions)})"
            )
        if self.array is not None:
            # all read already: the same tensor under a second key (tied weights) reads it again
            return torch.empty(self.regions[offsets], dtype=self.dtype)
        if offsets not in self.buffers:
            self.buffers[offsets] = torch.empty(self.regions[offsets], dtype=self.dtype)
        view = self.buffers[offsets].as_subclass(_LoadBuffer)
        view._load = (self, fqn)
        return view

    def note_written(self, fqn: str, count: int) -> None:
        self.written[fqn] = self.written.get(fqn, 0) + count
        if self.written[fqn] == self.total and self.array is None:
            self.upload()
            if self.install_when_full:
                self.install()

    @runtime.with_x64  # (int64 and float64 buffers stay 64-bit on the devices)
    def upload(self) -> None:
        """Each addressable device receives its region's buffer (zeros where it holds padding)."""
        import jax

        device_arrays = []
        for device, offsets, padded in self.devices:
            if offsets is None:
                host = np.zeros(padded, dtype=torch_to_numpy(torch.empty(0, dtype=self.dtype)).dtype)
            else:
                host = torch_to_numpy(self.buffers[offsets])
                if host.shape != padded:
                    host = np.pad(host, [(0, p - n) for n, p in zip(host.shape, padded)])
            device_arrays.append(jax.device_put(host, device))
        self.array = jax.make_array_from_single_device_arrays(self.padded_shape, self.sharding, device_arrays)
        counters.increment("TransferToDevice")
        self.buffers.clear()  # (the host memory goes as soon as the devices hold the data)

    def install(self) -> None:
        """The uploaded array becomes the tensor's stored value (and that of every view of it)."""
        if self.array is None:
            raise RuntimeError("ShardLoad.install: the shards have not all been read yet")
        _set_value(self.cell, self.array)


@state.locked
def _set_value(cell, array) -> None:
    # an in-place update of the storage, as copy_ would make, without a program: the array already
    # has the cell's sharding
    state.set_concrete(cell, array, owned=True)


class _LoadBuffer(torch.Tensor):
    """A host buffer (or a narrowed view of one) DCP copies a stored chunk into: counts the copy."""

    _load: tuple[ShardLoad, str] | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        load = getattr(args[0], "_load", None) if args else None
        if isinstance(result, _LoadBuffer):
            result._load = load  # (narrow and detach keep the owner)
        if func is torch.Tensor.copy_ and load is not None:
            load[0].note_written(load[1], args[0].numel())
        return result
