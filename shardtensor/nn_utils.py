"""``clip_grad_norm_`` for sharded gradients, with no host round trip; ``place_optimizer_state`` and
``keep_optimizer_state_sharded``, which make an optimizer load its state with its parameters' sharding.

``torch.nn.utils.clip_grad_norm_`` works on ShardedTensor gradients as well (its foreach path uses
``_foreach_norm``/``_foreach_mul_``, which have lowerings); this one is the same computation written
with per-tensor ops only, so it does not depend on torch's device grouping or foreach support.
Each gradient's norm is a reduction over its shards that XLA partitions; the total norm and the clip
factor stay on the devices, so in lazy mode the whole step — backward, clipping, optimizer — remains
one program.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, TypeVar

import torch

from shardtensor.annotate import shard
from shardtensor.tensor import ShardedTensor


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so that their joint norm is at most ``max_norm``.

    Same arguments, result and numerics as ``torch.nn.utils.clip_grad_norm_`` (gradients are
    multiplied by ``min(1, max_norm / (total_norm + 1e-6))``); returns the total norm as a tensor on
    the gradients' device. ``foreach`` is accepted for compatibility and ignored.
    ``error_if_nonfinite=True`` must read the norm on the host, which ends the lazy graph there.

    Example::

        loss.backward()
        norm = st.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    with torch.no_grad():  # clipping is not part of the graph autograd differentiates
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                "anyway, set `error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)  # a 0-d factor keeps each gradient's dtype, as in torch
    return total


def place_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
    """An ``Optimizer.register_load_state_dict_pre_hook``: state tensors go straight to the devices with
    their parameter's sharding.

    Without it, ``optimizer.load_state_dict`` of a ``torch.load``-ed (CPU) state dict moves each state
    tensor with ``value.to(param.device)``, which replicates it on every device (``n`` times the
    memory) until a step rewrites it. With the hook, each state tensor of a ShardedTensor parameter's
    shape (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``...) is cast to the parameter's dtype as
    torch does and sent sharded like the parameter; a ShardedTensor value laid out differently is
    resharded. ``step`` and tensors of other shapes are left to torch. The given state dict is not
    changed, and a state dict torch rejects (another number of groups or parameters) is passed through
    unchanged so torch raises its own error.

    Why a hook the user registers: torch casts the state in ``Optimizer.load_state_dict`` with
    ``value.to(dtype=param.dtype, device=param.device)``, and a device carries no sharding; the only
    automatic alternative would patch ``torch.optim.Optimizer`` for every program (docs/fsdp.md,
    "Optimizer state"). ``keep_optimizer_state_sharded(optimizer)`` registers it once.

    Example::

        opt = torch.optim.AdamW(model.parameters())
        opt.register_load_state_dict_pre_hook(st.place_optimizer_state)
        opt.load_state_dict(torch.load("opt.pt"))   # exp_avg, exp_avg_sq sharded like their params
    """
    saved_groups = state_dict.get("param_groups")
    saved_state = state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
        return None
    if len(saved_groups) != len(optimizer.param_groups):
        return None
    param_of: dict[Any, torch.Tensor] = {}
    for saved, group in zip(saved_groups, optimizer.param_groups):
        if len(saved["params"]) != len(group["params"]):
            return None
        param_of.update(zip(saved["params"], group["params"]))
    placed_state = {}
    for param_id, entries in saved_state.items():
        param = param_of.get(param_id)
        if isinstance(param, ShardedTensor) and isinstance(entries, dict):
            entries = {key: _placed_like(param, key, value) for key, value in entries.items()}
        placed_state[param_id] = entries
    return {**state_dict, "state": placed_state}


_Optimizer = TypeVar("_Optimizer")
_KEEPING: weakref.WeakSet = weakref.WeakSet()  # optimizers that have place_optimizer_state registered here


def keep_optimizer_state_sharded(optimizer: _Optimizer) -> _Optimizer:
    """Make ``optimizer.load_state_dict`` send each state tensor sharded like its parameter; returns
    ``optimizer``.

    Registers ``place_optimizer_state`` as the optimizer's load-state-dict pre-hook (once: calling it
    again does nothing). A wrapper that keeps the real optimizer as ``.optimizer`` and loads through
    it (accelerate's ``AcceleratedOptimizer``) gets the hook on the optimizer it wraps. Register it
    before loading; a state dict loaded before stays as torch placed it (replicated) until a step
    rewrites it.

    Example::

        opt = st.keep_optimizer_state_sharded(torch.optim.AdamW(model.parameters()))
        opt.load_state_dict(torch.load("opt.pt"))   # exp_avg, exp_avg_sq sharded like their params
    """
    target: Any = optimizer
    while isinstance(getattr(target, "optimizer", None), torch.optim.Optimizer):
        target = target.optimizer  # a wrapper that loads through the optimizer it holds
    if not isinstance(target, torch.optim.Optimizer):
        raise TypeError(
            "keep_optimizer_state_sharded expects a torch.optim.Optimizer (or a wrapper holding one as "
            f".optimizer), got {type(optimizer).__name__}."
        )
    if target not in _KEEPING:
        target.register_load_state_dict_pre_hook(place_optimizer_state)
        _KEEPING.add(target)
    return optimizer


def _placed_like(param: ShardedTensor, key: Any, value: Any) -> Any:
    """``value`` (one optimizer state entry of ``param``) on the devices with ``param``'s sharding, or
    ``value`` itself when torch's own cast is right for it."""
    if key == "step" or not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return value
    if isinstance(value, ShardedTensor):
        if value.sharding_spec and value.sharding_spec == param.sharding_spec:
            return value
    elif value.device.type != "cpu":
        return value
    mesh, spec = param.mesh, param.partition_spec
    if mesh is None or spec is None:  # XLA chose the parameter's layout: read it back
        mesh, spec = param._layout()
    with torch.no_grad():
        if param.is_floating_point() and value.dtype != param.dtype:
            value = value.to(param.dtype)  # as torch's cast, done on the host (or before resharding)
        return shard(value.detach(), mesh, tuple(spec))
