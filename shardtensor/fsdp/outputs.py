"""FSDPv2's default ``shard_output``: shard the batch dimension of a module's outputs.

PyTorch/XLA's default handles a tensor or the first element of a tuple and gives up on anything
else. Here every tensor of the output that has the batch dimension is sharded, wherever it sits: in
tuples, lists, dicts, dataclasses or Hugging Face ``ModelOutput``s (an ``OrderedDict`` subclass whose
items are also attributes).

Example::

    shard = batch_output_sharder()              # what FSDPv2 uses when shard_output=None
    out = shard(model(x), mesh)                 # logits sharded ('fsdp', None, None)
"""

from __future__ import annotations

import dataclasses
import functools

import torch

import shardtensor as st
from shardtensor.trees import map_leaves, tensors_in


def batch_output_sharder(extra_data_axis: str | None = None):
    """A ``shard_output(output, mesh)`` callable that shards the batch dimension of every output tensor.

    The batch size is dim 0 of the first output tensor that has a dimension (a 0-d loss in front of
    the logits, as in a ``ModelOutput``, is skipped). Each tensor whose dim 0 equals it is sharded
    ``('fsdp', None, ...)`` — ``((extra_data_axis, 'fsdp'), None, ...)`` when an extra data axis is
    given —; other tensors and non-tensor values are left alone. It returns the output rebuilt,
    each container of its own type (a ``ModelOutput`` stays one, items and attributes alike), with
    the sharded tensors in place of the old (a view replaced by a sharded copy, see ``shard_batch``).

    Example::

        FSDPv2(model, shard_output=batch_output_sharder("data"))  # same as extra_data_axis="data"
    """
    data_axis = "fsdp" if extra_data_axis is None else (extra_data_axis, "fsdp")
    # a partial of a module-level function, not a closure: torch.save of a whole FSDPv2 model pickles it
    return functools.partial(_shard_batch_outputs, data_axis=data_axis)


def _shard_batch_outputs(output, mesh, *, data_axis):
    """``batch_output_sharder``'s callable: ``output`` with its batch-dim tensors sharded over ``data_axis``."""
    if not _is_container(output) and not isinstance(output, torch.Tensor):
        raise RuntimeError(
            f"The output type is not supported: {type(output)}. Please provide your own "
            "shard_output callable (shard_output(output, mesh), which may return a new output)."
        )
    batch = _batch_size(output)
    if batch is None:
        return output

    def shard(t):  # every leaf: tensors with the batch dimension are sharded
        if isinstance(t, st.ShardedTensor) and t.dim() > 0 and t.shape[0] == batch:
            return shard_batch(t, mesh, data_axis)
        return t

    return map_leaves(shard, output)


def shard_batch(t: torch.Tensor, mesh, data_axis="fsdp") -> torch.Tensor:
    """``t`` sharded on dim 0 over ``data_axis`` (other dims replicated); returns the sharded tensor.

    ``st.mark_sharding`` works in place and refuses views (``linear`` on a 3-D input returns one).
    So a view is first copied — a copy the compiler removes — and the copy is returned; so is a
    tensor that must not be re-annotated in place: a parameter or input that requires grad, or one
    that already carries another sharding (a module may return its input). Autograd flows through.

    Example::

        logits = shard_batch(logits, mesh)       # ('fsdp', None, None)
    """
    target = (data_axis,) + (None,) * (t.dim() - 1)
    spec = t.partition_spec if isinstance(t, st.ShardedTensor) else None
    annotated_otherwise = spec is not None and tuple(spec) != target
    if t._is_view() or annotated_otherwise or (t.is_leaf and t.requires_grad):
        t = t.clone()
    return st.mark_sharding(t, mesh, target)


def _is_container(x) -> bool:
    return isinstance(x, (tuple, list, dict)) or (dataclasses.is_dataclass(x) and not isinstance(x, type))


def _batch_size(output):
    for t in tensors_in(output):
        if t.dim() > 0:
            return t.shape[0]
    return None
