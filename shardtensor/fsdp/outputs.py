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

import torch

import shardtensor as st


def batch_output_sharder(extra_data_axis: str | None = None):
    """A ``shard_output(output, mesh)`` callable that shards the batch dimension of every output tensor.

    The batch size is dim 0 of the first output tensor that has a dimension (a 0-d loss in front of
    the logits, as in a ``ModelOutput``, is skipped). Each tensor whose dim 0 equals it is sharded
    ``('fsdp', None, ...)`` — ``((extra_data_axis, 'fsdp'), None, ...)`` when an extra data axis is
    given —; other tensors and non-tensor values are left alone. It returns the output (with any
    view replaced by a sharded copy, see ``shard_batch``).

    Example::

        FSDPv2(model, shard_output=batch_output_sharder("data"))  # same as extra_data_axis="data"
    """
    data_axis = "fsdp" if extra_data_axis is None else (extra_data_axis, "fsdp")

    def shard_output(output, mesh):
        if not _is_container(output) and not isinstance(output, torch.Tensor):
            raise RuntimeError(
                f"The output type is not supported: {type(output)}. Please provide your own "
                "shard_output callable (shard_output(output, mesh), which may return a new output).")
        batch = _batch_size(output)
        if batch is None:
            return output

        def shard(t):
            if isinstance(t, st.ShardedTensor) and t.dim() > 0 and t.shape[0] == batch:
                return shard_batch(t, mesh, data_axis)
            return t

        return _map_tensors(output, shard)

    return shard_output


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
    annotated_otherwise = t.partition_spec is not None and tuple(t.partition_spec) != target
    if t._is_view() or annotated_otherwise or (t.is_leaf and t.requires_grad):
        t = t.clone()
    return st.mark_sharding(t, mesh, target)


def _is_container(x) -> bool:
    return isinstance(x, (tuple, list, dict)) or (dataclasses.is_dataclass(x) and not isinstance(x, type))


def _leaves(x):
    """The tensors of ``x`` in order (depth first, container order)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _leaves(v)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from _leaves(getattr(x, f.name))


def _batch_size(output):
    for t in _leaves(output):
        if t.dim() > 0:
            return t.shape[0]
    return None


def _map_tensors(x, fn):
    """``x`` with ``fn`` applied to each tensor. Tuples are rebuilt (namedtuples keep their type);
    lists, dicts and dataclasses are updated in place, so a ``ModelOutput``'s items and attributes
    stay in step and the caller's object is the one returned."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        for k, v in list(x.items()):
            new = _map_tensors(v, fn)
            if new is not v:
                x[k] = new  # a ModelOutput's __setitem__ also sets the attribute
                if dataclasses.is_dataclass(x) and k in {f.name for f in dataclasses.fields(x)}:
                    object.__setattr__(x, k, new)
        return x
    if isinstance(x, tuple):
        items = [_map_tensors(v, fn) for v in x]
        if all(a is b for a, b in zip(items, x)):
            return x
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    if isinstance(x, list):
        for i, v in enumerate(x):
            x[i] = _map_tensors(v, fn)
        return x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            v = getattr(x, f.name)
            new = _map_tensors(v, fn)
            if new is not v:
                object.__setattr__(x, f.name, new)  # works for frozen dataclasses too
        return x
    return x
