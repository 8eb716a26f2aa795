"""Auto-wrap policies and the recursive wrap that FSDPv2's ``auto_wrap_policy`` uses.

A policy is called as ``policy(module, recurse, unwrapped_params)``: with ``recurse=True`` it says
whether to look inside ``module``'s children, with ``recurse=False`` whether to wrap ``module``
itself; ``unwrapped_params`` counts the parameters of ``module`` not yet inside a wrapper. The
arguments are passed by position, so policies written for PyTorch/XLA (``unwrapped_params``) and
for ``torch.distributed.fsdp`` (``nonwrapped_numel``) both work.

Example::

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDPv2(model, auto_wrap_policy=policy)      # each Block gets its own FSDPv2
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.nn as nn


def always_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int) -> bool:
    """Wrap every submodule (each leaf gets its own wrapper).

    Example::

        FSDPv2(model, auto_wrap_policy=always_wrap_policy)
    """
    return True


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, unwrapped_params: int, lambda_fn: Callable[[nn.Module], bool]
) -> bool:
    """Wrap the submodules for which ``lambda_fn(module)`` is true.

    Example::

        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear))
    """
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module, recurse: bool, unwrapped_params: int, transformer_layer_cls: Iterable[type]
) -> bool:
    """Wrap every submodule that is an instance of one of ``transformer_layer_cls``.

    Example::

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})
    """
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    min_num_params: int = int(1e8),
    force_leaf_modules=None,
    exclude_wrap_modules=None,
) -> bool:
    """Wrap a submodule once it holds at least ``min_num_params`` parameters not yet wrapped.

    ``force_leaf_modules`` (default ``{nn.MultiheadAttention}``) are never looked into;
    ``exclude_wrap_modules`` (default ``{nn.ModuleList, nn.ModuleDict}``, which have no forward)
    are never wrapped themselves.

    Example::

        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=10_000)
    """
    force_leaf = tuple(force_leaf_modules if force_leaf_modules is not None else {nn.MultiheadAttention})
    exclude = tuple(exclude_wrap_modules if exclude_wrap_modules is not None else {nn.ModuleList, nn.ModuleDict})
    large = unwrapped_params >= min_num_params
    if recurse:
        return large and not isinstance(module, force_leaf)
    return large and not isinstance(module, exclude)


def recursive_wrap(
    module: nn.Module,
    auto_wrap_policy: Callable,
    wrapper_cls: Callable,
    ignored_modules=(),
    ignored_params=(),
    only_wrap_children: bool = False,
    **wrapper_kwargs,
) -> tuple[nn.Module, int]:
    """Wrap the submodules of ``module`` that ``auto_wrap_policy`` picks, innermost first.

    Children are replaced in place (``setattr`` on their parent) by ``wrapper_cls(child,
    **wrapper_kwargs)``. Returns ``(module or its wrapper, number of parameters now wrapped)``;
    ``only_wrap_children=True`` never wraps ``module`` itself (FSDPv2 wraps the root itself).

    Example::

        model, n = recursive_wrap(model, policy, FSDPv2, only_wrap_children=True, mesh=mesh)
    """
    ignored_modules = set(ignored_modules)
    ignored_ids = {id(p) for p in ignored_params}
    total = sum(p.numel() for p in module.parameters() if id(p) not in ignored_ids)
    if not auto_wrap_policy(module, True, total):
        return module, 0
    wrapped = 0
    for name, child in module.named_children():
        if child in ignored_modules:
            continue
        new_child, n = recursive_wrap(
            child, auto_wrap_policy, wrapper_cls, ignored_modules, ignored_params, **wrapper_kwargs
        )
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped += n
    if not only_wrap_children and auto_wrap_policy(module, False, total - wrapped):
        return wrapper_cls(module, **wrapper_kwargs), total
    return module, wrapped
