"""Nested Python values (a batch, an op's arguments, a model's output): one map over their leaves.

Built on torch's pytree, so every container torch knows — tuple, list, dict, OrderedDict,
defaultdict, deque, named tuples, torch's return types — and every one a library registers with it
(transformers registers its ``ModelOutput`` classes) is taken apart and rebuilt the way its owner
says. Two kinds that torch's pytree leaves whole are opened here too, as users' batches and outputs
hold them: other mappings (``UserDict``-based ones such as transformers' ``BatchEncoding``: a copy
with the new values) and dataclass instances (a copy with the new field values); so are tuple and
list subclasses torch does not know.

Example::

    map_leaves(lambda v: v * 10, {'a': [1, (2, 3)]})        # {'a': [10, (20, 30)]}
    [t.shape for t in tensors_in((x, {'y': y}, 'text'))]    # [x.shape, y.shape]
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree


def _opened_here(value) -> bool:
    """A container torch's pytree leaves whole but this module opens."""
    if pytree._get_node_type(value) in pytree.SUPPORTED_NODES:
        return False
    return isinstance(value, (Mapping, tuple, list)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    )


def map_leaves(fn: Callable[[Any], Any], tree):
    """``tree`` rebuilt with ``fn`` applied to every leaf (a tensor is a leaf; so is any value that is
    not a container). Containers are new objects of their own type; the input is not changed.

    Example::

        map_leaves(str, ([1, 2], {'k': 3.5}))    # (['1', '2'], {'k': '3.5'})
    """

    def visit(value):  # a leaf of torch's pytree: a true leaf, or a container opened here
        return _rebuild(value, lambda child: map_leaves(fn, child)) if _opened_here(value) else fn(value)

    return pytree.tree_map(visit, tree, is_leaf=_opened_here)


def leaves(tree) -> list:
    """Every leaf of ``tree`` in order (containers depth first, in their own order).

    Example::

        leaves({'a': [1, (2, 3)], 'b': None})    # [1, 2, 3, None]
    """
    out: list[Any] = []
    map_leaves(out.append, tree)
    return out


def tensors_in(tree) -> list[torch.Tensor]:
    """The tensors among ``tree``'s leaves, in order.

    Example::

        tensors_in((x, 'text', [y]))    # [x, y]
    """
    return [v for v in leaves(tree) if isinstance(v, torch.Tensor)]


def mapping_with(mapping: Mapping, items: dict) -> Mapping:
    """A mapping of ``mapping``'s type (a copy, keeping its extras) holding ``items`` instead;
    a plain dict if the type cannot be copied or assigned.

    Example::

        mapping_with(OrderedDict(a=1), {'a': 2})    # OrderedDict([('a', 2)])
    """
    if type(mapping) is dict:
        return items
    try:
        out: Any = copy.copy(mapping)  # a MutableMapping, or the except below
        for k, v in items.items():
            out[k] = v
        return out
    except Exception:  # noqa: BLE001 — any failure of a foreign type's copy or __setitem__
        return items


def _rebuild(value, visit):
    if isinstance(value, Mapping):
        return mapping_with(value, {k: visit(v) for k, v in value.items()})
    if isinstance(value, (tuple, list)):
        items = [visit(v) for v in value]
        try:
            return type(value)(items)
        except TypeError:
            return (tuple if isinstance(value, tuple) else list)(items)
    out = copy.copy(value)  # a dataclass instance
    for field in dataclasses.fields(value):
        object.__setattr__(out, field.name, visit(getattr(value, field.name)))  # frozen ones too
    return out
