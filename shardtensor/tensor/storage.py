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


def storage_of(storage: torch.UntypedStorage, cell_id: int, cell_nbytes: int) -> CellStorage:
    """Give torch's storage object of a ShardedTensor its cell's identity and size (in place)."""
    storage.__class__ = CellStorage
    storage._cell_id = cell_id  # type: ignore[attr-defined]
    storage._cell_nbytes = cell_nbytes  # type: ignore[attr-defined]
    return storage  # type: ignore[return-value]
