"""Batches on their way to the devices: which layout each tensor of a batch gets, its upload
(jax only, so any thread may do it) and its wrapping as a ShardedTensor (on the thread that records
ops, since that creates shardtensor state).

Example::

    layouts = Layouts(ShardingSpec(mesh, ('data', None)))   # on the main thread
    uploaded = layouts.upload_batch({'x': torch.randn(16, 4), 'step': 3})   # on any thread
    batch = wrap_batch(uploaded)    # on the main thread: {'x': ShardedTensor, 'step': 3}
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import jax
import numpy as np
import torch

from shardtensor import metrics as counters
from shardtensor import runtime
from shardtensor import sharding as sh
from shardtensor.dtypes import torch_to_numpy
from shardtensor.mesh import get_1d_mesh, get_global_mesh
from shardtensor.sharding import ShardingSpec, named_sharding
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.upload import private_copy, wrap_upload
from shardtensor.trees import leaves, map_leaves, mapping_with


class Uploaded:
    """One tensor of a batch after its upload: the jax array and what its ShardedTensor needs."""

    __slots__ = ("array", "dtype", "mesh", "requires_grad", "shape", "spec")

    def __init__(self, array, shape, dtype, mesh, spec, requires_grad):
        self.array, self.shape, self.dtype = array, shape, dtype
        self.mesh, self.spec, self.requires_grad = mesh, spec, requires_grad


def _moves(leaf) -> bool:
    """Whether a batch leaf goes to the devices: torch CPU tensors (not already on st.device())."""
    return isinstance(leaf, torch.Tensor) and not isinstance(leaf, ShardedTensor) and leaf.device.type == "cpu"


def _holds_tensor(obj) -> bool:
    return any(_moves(leaf) for leaf in leaves(obj))


class Layouts:
    """``input_sharding`` resolved: the layout of every tensor of a batch, and its upload.

    Build it on the main thread (it fixes the meshes and builds their jax meshes); ``upload_batch``
    then touches jax only and runs on any thread.
    """

    def __init__(self, input_sharding=None):
        self.input_sharding = input_sharding
        specs = _specs(input_sharding)
        self.default_mesh = get_global_mesh() or get_1d_mesh()  # replicated tensors without a spec
        for mesh in {self.default_mesh, *(s.mesh for s in specs)}:
            mesh.get_jax_mesh()  # built (and cached) here, not concurrently on a worker thread
        self._warned_ranks: set = set()  # (spec, rank) pairs already reported as replicated
        index = runtime.process_index()
        self.local_device_ids = tuple(
            a["id"] for a in runtime.global_runtime_device_attributes() if a["process_index"] == index
        )

    def upload_batch(self, batch):
        """``batch`` with each CPU tensor uploaded (an ``Uploaded``); other leaves unchanged."""
        spec = self.input_sharding
        if not _holds_tensor(batch):  # None, numbers, strings...: nothing to move, whatever the spec
            return batch
        if isinstance(spec, Mapping):
            if not isinstance(batch, Mapping):  # a ValueError, as in PyTorch/XLA
                raise ValueError("input batch should be a dict when input sharding is a dict.")  # noqa: TRY004
            missing = [k for k, v in batch.items() if k not in spec and _holds_tensor(v)]
            if missing:
                raise KeyError(f"Keys: {missing} are missing from input_sharding.")
            return mapping_with(batch, {k: self._upload_tree(v, spec.get(k)) for k, v in batch.items()})
        return self._upload_tree(batch, spec)

    def _upload_tree(self, tree, spec: ShardingSpec | None):
        return map_leaves(lambda leaf: self._upload_leaf(leaf, spec), tree)

    def _upload_leaf(self, leaf, spec: ShardingSpec | None):
        if not _moves(leaf):
            return leaf
        host = torch_to_numpy(leaf.detach().resolve_conj().resolve_neg())
        if spec is not None and spec.can_apply(leaf):
            local_ids = self.local_device_ids if spec.minibatch else None
            shape = spec.global_shape(host.shape, local_ids)
            tiles = sh.minibatch_local_tiles(spec.mesh, spec.partition_spec, local_ids) if spec.minibatch else None
            mesh, stored_spec = spec.mesh, tuple(spec.partition_spec)
            array = upload(host, mesh, stored_spec, shape, tiles)
        else:  # no spec, or one of another rank: replicated (its layout left to XLA later)
            if spec is not None:
                self._warn_replicated(spec, leaf)
            mesh, stored_spec, shape = (spec.mesh if spec is not None else self.default_mesh), None, host.shape
            array = upload(host, mesh, (None,) * host.ndim, shape, None)
        return Uploaded(array, tuple(shape), leaf.dtype, mesh, stored_spec, leaf.requires_grad)

    def _warn_replicated(self, spec: ShardingSpec, leaf: torch.Tensor) -> None:
        # PyTorch/XLA's rule (a spec applies to tensors of its rank only) is kept, but said once
        key = (id(spec), leaf.dim())
        if key in self._warned_ranks:
            return
        self._warned_ranks.add(key)
        warnings.warn(
            f"MpDeviceLoader: input_sharding's ShardingSpec has {len(spec.partition_spec)} dimension(s) but a "
            f"batch tensor of shape {tuple(leaf.shape)} has {leaf.dim()}: that tensor is uploaded replicated. "
            "Give a spec of its rank (a dict of specs for dict batches) to shard it.",
            UserWarning,
            stacklevel=2,
        )


def _specs(input_sharding) -> list:
    if input_sharding is None:
        return []
    if isinstance(input_sharding, ShardingSpec):
        return [input_sharding]
    if isinstance(input_sharding, Mapping):
        bad = {k: type(v).__name__ for k, v in input_sharding.items() if not isinstance(v, ShardingSpec)}
        if bad:
            raise TypeError(f"input_sharding as a dict maps batch keys to ShardingSpecs; not these: {bad}")
        return list(input_sharding.values())
    raise TypeError(
        "input_sharding is a ShardingSpec (for every tensor of its rank), a dict of ShardingSpecs "
        f"keyed like the batch, or None (replicated); got {type(input_sharding).__name__}."
    )


@runtime.with_x64  # on the loader's own thread: JAX's setting is per thread
def upload(host: np.ndarray, mesh, spec, global_shape, local_tiles=None):
    """A jax array of ``global_shape`` laid out as (mesh, spec), padded at the end of uneven dims.

    ``host`` is the whole tensor, or with ``local_tiles`` (minibatch) this process's rows: equal
    blocks, in order, for those dimension-0 shards. Uses jax only (each device receives a copy of
    its own shard), so it is safe on any thread.
    """
    padded = tuple(sh.padded_shape(global_shape, mesh, spec))
    host_padded = (host.shape[0],) + padded[1:] if local_tiles is not None else padded
    if tuple(host.shape) != host_padded:
        host = np.pad(host, [(0, p - n) for n, p in zip(host.shape, host_padded)])
    block = padded[0] // sh.shard_counts(mesh, spec, len(padded))[0] if padded else 0

    def shard_of(index):
        if local_tiles is not None and block:  # global rows of one dim-0 shard -> its local block
            start, stop, _ = index[0].indices(padded[0])
            local_start = local_tiles.index(start // block) * block
            index = (slice(local_start, local_start + stop - start),) + tuple(index[1:])
        # a copy: on CPU jax may otherwise alias the loader's memory, which it may reuse
        return private_copy(host[index])

    with counters.timed("TransferToDeviceTime"):  # (wrap_upload counts it, on the recording thread)
        return jax.make_array_from_callback(padded, named_sharding(mesh, spec, len(padded)), shard_of)


def wrap_batch(uploaded):
    """The batch of ShardedTensors for an uploaded batch (on the thread that records ops).

    Example::

        batch = wrap_batch(layouts.upload_batch(cpu_batch))
    """
    return map_leaves(_wrap_leaf, uploaded)


def _wrap_leaf(leaf):
    if not isinstance(leaf, Uploaded):
        return leaf
    t = wrap_upload(leaf.array, leaf.shape, leaf.dtype, leaf.mesh, leaf.spec)
    if leaf.requires_grad:
        t.requires_grad_(True)
    return t
