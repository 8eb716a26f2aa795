"""``FSDPv2``: fully sharded data parallel in the SPMD style (PyTorch/XLA's SpmdFullyShardedDataParallel).

There is no gathering or scattering code here: each parameter is annotated as sharded over the mesh
axis ``'fsdp'`` and the module's outputs as sharded on their batch dimension, and XLA's partitioner
inserts the all-gathers (forward, backward) and reduce-scatters (gradients) itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

import shardtensor as st
from shardtensor.fsdp.outputs import batch_output_sharder
from shardtensor.fsdp.state_dict import (
    add_wrapper_prefix,
    drop_wrapper_prefix,
    keep_sharding_on_load,
    name_keys_as_state_dict,
    parameter_layouts,
    restore_parameter_layouts,
)
from shardtensor.fsdp.wrap import recursive_wrap
from shardtensor.tensor_parallel import is_tensor_parallel, mark_tensor_parallel


class _ModuleForwardSignature:
    """``FSDPv2.__signature__``: on a wrapper, the wrapped module's forward signature, looked up at
    each ask (so it follows a forward replaced later, e.g. by ``checkpoint_module``); on the class
    itself None, so that ``inspect.signature(FSDPv2)`` still reads ``__init__``."""

    def __get__(self, wrapper, owner=None):
        return None if wrapper is None else inspect.signature(wrapper._orig_module.forward)


class FSDPv2(nn.Module):
    """Shard ``module``'s parameters over the mesh axis ``'fsdp'`` and its outputs on the batch dim.

    Args:
        module: the module to wrap; it must define its own ``forward`` (not a ModuleList/ModuleDict).
        mesh: a ``st.Mesh`` with an axis named ``'fsdp'``; defaults to ``st.get_global_mesh()``.
        shard_output: ``shard_output(output, mesh)`` called on each forward output. It may mark
            tensors in place and return None, or return the output to use instead. The default
            shards every tensor that has the batch dimension (see ``batch_output_sharder``).
        auto_wrap_policy: wraps submodules first (``transformer_auto_wrap_policy``,
            ``size_based_auto_wrap_policy``...); children get ``mesh`` and ``shard_output`` (the
            default one built for ``extra_data_axis`` when none is given).
        auto_wrapper_callable: what wraps those children instead of ``FSDPv2``; called as
            ``auto_wrapper_callable(child, mesh=..., shard_output=...)``.
        extra_data_axis: another mesh axis the batch is also split over (multislice); used for the
            outputs only (of this wrapper and of auto-wrapped children) — parameters stay sharded
            over ``'fsdp'`` and replicated across it.

    The wrapper shows the wrapped module's forward signature: ``inspect.signature(wrapper.forward)``
    and ``inspect.signature(wrapper)`` are ``inspect.signature(module.forward)``, so tools that
    choose arguments by it (Hugging Face ``Trainer``'s unused-column filter) see the real names.

    The module is moved to ``st.device()``. Parameters that already carry a sharding (given by
    ``st.shard``/``st.mark_sharding``, or by an inner FSDPv2) are left alone, but for those that a
    tensor-parallel plan (``st.parallelize_module`` on the same mesh) placed over another axis: they
    are also sharded over ``'fsdp'``, on their largest dimension the plan left whole. Every other parameter is
    sharded over ``'fsdp'`` on its largest dimension (ties: the lowest index; 0-d parameters are
    replicated). CPU parameters go to the devices already sharded, so a model too big to replicate
    on one device can still be wrapped.

    Example::

        mesh = st.Mesh(range(8), (8, 1), ("fsdp", "model"))
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        model = FSDPv2(model, mesh=mesh, auto_wrap_policy=policy)
        model.module.blocks[0].module.fc.weight.partition_spec   # PartitionSpec(None, 'fsdp')
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        mesh: st.Mesh | None = None,
        shard_output: Callable | None = None,
        auto_wrap_policy: Callable | None = None,
        auto_wrapper_callable: Callable | None = None,
        extra_data_axis: str | None = None,
    ):
        # the checks, in PyTorch/XLA's order
        if isinstance(module, FSDPv2):
            raise RuntimeError(
                "Cannot wrap a module that is already wrapped with FSDPv2. For nested wrapping, wrap the "
                "inner child modules first and then the outer parent module."
            )
        if type(module).forward is nn.Module.forward:
            raise RuntimeError(
                f"The module wrapped by FSDPv2 must define its own forward method and be called through it; "
                f"{type(module).__name__} has none. Do not wrap nn.ModuleList or nn.ModuleDict: wrap the "
                "modules inside them, or the module that calls them."
            )
        if mesh is None:
            mesh = st.get_global_mesh()
            if mesh is None:
                raise ValueError("No mesh is provided and no global mesh is set. Please provide a mesh.")
        axes = mesh.axis_names or ()
        if "fsdp" not in axes:
            raise ValueError("The mesh must have an axis named 'fsdp'.")
        if extra_data_axis and extra_data_axis not in axes:
            raise ValueError(f"The provided {extra_data_axis} axis is not in the mesh.")
        super().__init__()
        # Unlike PyTorch/XLA, auto-wrapped children get the root's resolved shard_output, so with an
        # extra data axis their outputs are split over it too (instead of replicated across it).
        shard_output = shard_output or batch_output_sharder(extra_data_axis)

        if auto_wrap_policy is not None:
            for name, sub in module.named_modules():
                if isinstance(sub, FSDPv2):
                    raise ValueError(
                        f"Expected {name} to NOT be FSDPv2 if using an `auto_wrap_policy`: "
                        "either wrap submodules by hand or let the policy do it, not both."
                    )
            recursive_wrap(
                module,
                auto_wrap_policy,
                auto_wrapper_callable or FSDPv2,
                only_wrap_children=True,
                mesh=mesh,
                shard_output=shard_output,
            )

        _shard_parameters(module, mesh)
        module.register_load_state_dict_pre_hook(keep_sharding_on_load)
        self._orig_module = module
        self._mesh = mesh
        self._shard_output = shard_output
        self.forward = _ForwardShowingModuleSignature(self)  # type: ignore[method-assign]
        # state dicts name the wrapped module's keys without "_orig_module." (see fsdp/state_dict.py)
        self.register_state_dict_post_hook(drop_wrapper_prefix)
        self.register_load_state_dict_pre_hook(add_wrapper_prefix)
        self.register_load_state_dict_post_hook(name_keys_as_state_dict)

    @property
    def module(self) -> nn.Module:
        """The wrapped module (as ``DistributedDataParallel.module``)."""
        return self._orig_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward, then ``shard_output`` on its output (each instance calls it
        through a ``forward`` attribute that shows the module's signature)."""
        output = self._orig_module(*args, **kwargs)
        sharded = self._shard_output(output, self._mesh)
        return output if sharded is None else sharded

    __signature__ = _ModuleForwardSignature()

    def __getstate__(self) -> dict[str, Any]:
        # a pickled ShardedTensor parameter is a plain CPU nn.Parameter: keep the shardings beside them
        return {**super().__getstate__(), "_saved_parameter_layouts": parameter_layouts(self._orig_module)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        layouts = state.pop("_saved_parameter_layouts", {})
        super().__setstate__(state)
        restore_parameter_layouts(self._orig_module, layouts)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules of the wrapper itself
        except AttributeError:
            if name == "_orig_module":  # not set yet (e.g. while copy/pickle rebuild the object)
                raise
            return getattr(self._orig_module, name)

    def __getitem__(self, key):
        return self._orig_module[key]  # type: ignore[index]  # a wrapped container (nn.Sequential, ...)


class _ForwardShowingModuleSignature:
    """An FSDPv2 instance's ``forward``: runs ``FSDPv2.forward``, and ``inspect.signature`` of it is the
    wrapped module's forward signature (a bound method's signature would be ``(*args, **kwargs)``).
    An object holding the wrapper rather than a closure, so ``copy.deepcopy`` of the wrapper gives a
    copy whose forward runs the copy."""

    def __init__(self, wrapper: FSDPv2):
        self.wrapper = wrapper

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return FSDPv2.forward(self.wrapper, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.wrapper)


def largest_dim_spec(shape) -> tuple:
    """FSDPv2's parameter spec: ``'fsdp'`` on the largest dimension (ties: the lowest index), None
    elsewhere; ``()`` (replicated) for a 0-d tensor.

    Example::

        largest_dim_spec((64, 128))   # (None, 'fsdp')
    """
    shape = tuple(shape)
    if not shape:
        return ()
    spec: list[str | None] = [None] * len(shape)
    spec[shape.index(max(shape))] = "fsdp"
    return tuple(spec)


def _shard_parameters(module: nn.Module, mesh: st.Mesh) -> None:
    """Move ``module`` to ``st.device()``, sharding each parameter that has no sharding yet.

    CPU parameters are sent sharded straight from the host (``st.shard``), never replicated first;
    buffers and anything else go through ``module.to``. Tied parameters stay tied.
    """
    replaced: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            if p.device.type != "cpu":
                continue
            new = replaced.get(id(p))
            if new is None:
                spec = largest_dim_spec(p.shape)
                new = nn.Parameter(st.shard(p.detach(), mesh, spec), requires_grad=p.requires_grad)
                if p.grad is not None:
                    new.grad = st.shard(p.grad, mesh, spec)
                replaced[id(p)] = new
            setattr(sub, name, new)
    module.to(st.device())
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            if not isinstance(p, st.ShardedTensor):
                continue
            if p.partition_spec is None:
                with torch.no_grad():
                    st.mark_sharding(p, mesh, largest_dim_spec(p.shape))
            elif is_tensor_parallel(p) and "fsdp" not in _axes_of(p):
                new = replaced.get(id(p))
                if new is None:
                    new = _also_over_fsdp(p, mesh)
                    replaced[id(p)] = new
                setattr(sub, name, new)


def _axes_of(p: st.ShardedTensor) -> set:
    return {a for e in p.partition_spec or () for a in (e if isinstance(e, tuple) else (e,)) if a is not None}


def _also_over_fsdp(p: Any, mesh: st.Mesh) -> nn.Parameter:
    """A tensor-parallel parameter (``st.parallelize_module``) sharded over ``'fsdp'`` as well: on its
    largest dimension the plan left whole (ties: the lowest), else on its largest dimension, split
    over both axes. The plan must have used FSDPv2's mesh: one program spans one mesh."""
    if p.device_mesh != mesh:
        raise ValueError(
            f"a parameter placed by st.parallelize_module on the mesh {p.device_mesh} cannot be sharded by an "
            f"FSDPv2 on the mesh {mesh}: give both the same 2-D mesh (e.g. axes ('fsdp', 'tp'))"
        )
    placements = list(p.placements)
    taken = {q.dim for q in placements if isinstance(q, st.Shard)}
    free = [d for d in range(p.dim()) if d not in taken] or list(range(p.dim()))
    if not free:
        return p  # a 0-d parameter stays as the plan placed it
    dim = max(free, key=lambda d: (p.shape[d], -d))
    placements[(mesh.axis_names or ()).index("fsdp")] = st.Shard(dim)
    spec = st.placements_to_spec(placements, mesh, p.dim())
    new = nn.Parameter(st.shard(p.detach(), mesh, spec), requires_grad=p.requires_grad)
    mark_tensor_parallel(new)
    return new
