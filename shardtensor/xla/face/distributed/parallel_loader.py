"""``torch_xla.distributed.parallel_loader`` (``pl``) under the face: ``MpDeviceLoader`` and
``ParallelLoader`` are ``st.MpDeviceLoader`` (background upload, sharded by ``input_sharding``, a sync
before each batch) taking ``'xla'`` devices and PyTorch/XLA's keywords, with the step closures run at
each of those syncs."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any

import shardtensor as st
from shardtensor.xla.face import _support


class _PerDeviceLoader:
    """One pass over the batches: ``st.MpDeviceLoader``'s iterator, running the step closures after the
    sync each ``next()`` makes, as PyTorch/XLA's ``torch_xla.sync()`` there does."""

    def __init__(self, batches: Iterator[Any], length: int | None) -> None:
        self._batches = batches
        self._length = length

    def __iter__(self) -> _PerDeviceLoader:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._batches)
        finally:
            _support.run_step_closures()
        return batch

    next = __next__

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("the wrapped loader has no len()")
        return self._length


def _loader_kwargs(kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    batchdim = kwargs.pop("batchdim", 0)  # (PyTorch/XLA does not use it for sharding either)
    if batchdim != 0:
        raise NotImplementedError(f"MpDeviceLoader(batchdim={batchdim}): batches are split along dimension 0.")
    known = {
        "input_sharding",
        "loader_prefetch_size",
        "device_prefetch_size",
        "host_to_device_transfer_threads",
        "batches_per_execution",
    }
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(
            f"MpDeviceLoader got unexpected keyword arguments {unknown}; it takes {sorted(known | {'batchdim'})}."
        )
    return kwargs


class MpDeviceLoader(st.MpDeviceLoader):
    """``MpDeviceLoader(loader, device, **kwargs)``: ``kwargs`` as ``ParallelLoader`` takes them
    (``input_sharding``, ``loader_prefetch_size``, ``device_prefetch_size``,
    ``host_to_device_transfer_threads``, ``batches_per_execution``, ``batchdim=0``)."""

    def __init__(self, loader: Iterable[Any], device: Any, **kwargs: Any) -> None:
        super().__init__(loader, _support.as_st_device(device), **_loader_kwargs(kwargs))

    def __iter__(self) -> _PerDeviceLoader:
        loader = self.loader
        length = len(loader) if isinstance(loader, Sized) else None
        return _PerDeviceLoader(super().__iter__(), length)


class ParallelLoader:
    """``ParallelLoader(cpu_loader, devices, ...)``: one device under SPMD; ``per_device_loader(device)``
    gives the iterator of batches on it."""

    def __init__(self, cpu_loader: Iterable[Any], devices: Sequence[Any], **kwargs: Any) -> None:
        devices = [_support.as_st_device(d) for d in devices]
        if len(devices) != 1:
            raise ValueError(f"ParallelLoader: one device under SPMD (torch_xla.device()), got {len(devices)}.")
        self._cpu_loader = cpu_loader
        self._loader = MpDeviceLoader(cpu_loader, devices[0], **kwargs)
        self._batches_per_execution = kwargs.get("batches_per_execution", 1)

    def per_device_loader(self, device: Any) -> _PerDeviceLoader:
        _support.as_st_device(device)
        return iter(self._loader)

    def per_device_samples(self) -> int:
        return len(self._cpu_loader)  # type: ignore[arg-type]

    @property
    def batches_per_execution(self) -> int:
        return self._batches_per_execution

    def close(self) -> None:
        self._loader.close()
