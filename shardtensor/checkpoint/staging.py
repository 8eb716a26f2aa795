"""``HostStager``: ``dcp.async_save`` of ShardedTensors, each process's shards copied to the host first."""

from __future__ import annotations

import copy
from typing import Any

import torch

from shardtensor.checkpoint.protocol import host_copies, write_items
from shardtensor.tensor.sharded import ShardedTensor


class HostStager:
    """The stager ``dcp.async_save`` needs for ShardedTensors (its default one cannot copy them).

    ``stage`` runs on the caller: it copies the distinct shards each ShardedTensor has in this
    process to the host (replicas once, padding never, never the full tensor) and returns the state
    dict with each replaced by a ``StagedShards`` holding those copies; training may then change
    the tensors while DCP writes the copies in the background, into the same checkpoint
    ``dcp.save`` would write. Other values are kept as they are (CPU tensors are cloned). With a
    process group, give ``async_save`` a group of its own, so the background thread's collectives
    never mix with the training loop's.

    Example::

        future = dcp.async_save(state, checkpoint_id="ckpt/step_100", async_stager=st.checkpoint.HostStager())
        ...                    # train on
        future.result()        # (raises what the save raised)
    """

    _synchronize_after_execute = False  # (stage is synchronous: nothing to wait for)

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict) -> dict:
        return host_state_dict(state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def host_state_dict(value: Any) -> Any:
    """A copy of a state dict that training cannot change, made on the caller: each ShardedTensor a
    ``StagedShards`` (this process's distinct shards on the host), other tensors CPU copies, other
    values deep copies.

    Example::

        frozen = host_state_dict({"model": model.state_dict()})   # then write it in another thread
    """
    if isinstance(value, ShardedTensor):
        return StagedShards(value)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)((k, host_state_dict(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(host_state_dict(v) for v in value)
    return copy.deepcopy(value)


class StagedShards(torch.Tensor):
    """Host copies of one ShardedTensor's distinct shards in this process, which only DCP's save
    reads (through the same protocol as the ShardedTensor's). Any other use raises.

    Example::

        staged = StagedShards(x)
        staged.copies        # {offsets: CPU tensor}
    """

    copies: dict[tuple[int, ...], torch.Tensor]

    @staticmethod
    def __new__(cls, tensor: ShardedTensor) -> StagedShards:
        r = torch.Tensor._make_wrapper_subclass(
            cls, tuple(tensor.shape), dtype=tensor.dtype, device=torch.device("cpu"), requires_grad=tensor.requires_grad
        )
        r.copies = host_copies(tensor)
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise TypeError(
            f"{func}: a StagedShards holds host copies for dcp.async_save to write and supports no "
            "operation; use the ShardedTensor it was staged from"
        )

    def __create_write_items__(self, fqn: str, object: Any) -> list:
        return write_items(fqn, self, [(o, tuple(c.shape)) for o, c in self.copies.items()])

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        offsets = tuple(index.offset) if index.offset is not None else (0,) * self.dim()
        return self.copies[offsets]

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return f"StagedShards(shape={tuple(self.shape)}, dtype={self.dtype}, shards={len(self.copies)})"
