"""What ``ShardedTensor.untyped_storage()`` answers: torch's storage object, with an identity.

A ShardedTensor's data lives in JAX, so torch gives it an "invalid python storage" whose
``data_ptr()`` raises. Libraries that group tensors by storage before saving (safetensors'
shared-tensor check, transformers' tied-weight detection, both through ``storage_ptr``) then fail.
Here the storage keeps torch's object (so ``StorageWeakRef`` and ``isinstance`` still work) and
answers ``data_ptr()`` with an identifier of the tensor's storage cell (equal for a tensor, its
``detach()`` and its views; never an address to read: there are no host bytes) and ``nbytes()``
with the cell's size. The data itself is read with ``.cpu()``, as on any accelerator.
"""

from __future__ import annotations

import torch


class CellStorage(torch.UntypedStorage):
    """torch's storage of a ShardedTensor, identified by its storage cell.

    Example::

        x.untyped_storage().data_ptr() == x.detach().untyped_storage().data_ptr()   # True
    """

    _cell_id: int
    _cell_nbytes: int

    def data_ptr(self) -> int:
        return self._cell_id

    def nbytes(self) -> int:
        return self._cell_nbytes

    def copy_(self, source, non_blocking=None):
        # torch's own error here ("invalid python storage") does not say what to do; DCP's default
        # async stager is the usual caller (it copies each tensor's storage into a CPU one)
        if isinstance(source, CellStorage) and hasattr(source, "_cell_id"):
            raise RuntimeError(
                "Cannot copy a ShardedTensor's storage: to torch it is an invalid python storage, holding no host "
                "bytes (the data is on the devices); read the tensor with t.cpu(). dcp.async_save's default stager "
                "does this: "
                "pass async_stager=st.checkpoint.HostStager() to dcp.async_save (or save with "
                "st.checkpoint.CheckpointManager)."
            )
        return super().copy_(source, non_blocking)


def storage_of(storage: torch.UntypedStorage, cell_id: int, cell_nbytes: int) -> CellStorage:
    """Give torch's storage object of a ShardedTensor its cell's identity and size (in place)."""
    storage.__class__ = CellStorage
    storage._cell_id = cell_id  # type: ignore[attr-defined]
    storage._cell_nbytes = cell_nbytes  # type: ignore[attr-defined]
    return storage  # type: ignore[return-value]
