"""``st.parallelize_module``: apply a tensor-parallel plan (module paths -> styles), and
``st.loss_parallel``: cross-entropy on logits split over the vocabulary."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from fnmatch import fnmatch

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import shardtensor as st
from shardtensor.mesh import Mesh
from shardtensor.tensor_parallel.distribute import as_mesh
from shardtensor.tensor_parallel.layouts import TensorParallelMesh, is_tensor_parallel, relayout
from shardtensor.tensor_parallel.placements import Shard
from shardtensor.tensor_parallel.style import ParallelStyle


def parallelize_module(
    module: nn.Module,
    device_mesh: Mesh | None = None,
    parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle] | None = None,
    *,
    tp_axis: str | int | None = None,
) -> nn.Module:
    """Apply tensor-parallel styles to ``module`` (DTensor's ``parallelize_module``) and return it.

    ``parallelize_plan`` is one style (for ``module`` itself) or a dict from module paths to styles;
    each dot-separated part of a path is matched against child names with ``fnmatch``
    (``"layers.*.self_attn.q_proj"``), ``""`` is ``module`` itself. Unlike DTensor, which warns and
    skips, a path that matches no submodule is an error.

    ``device_mesh`` is a ``st.Mesh`` (default: the global mesh). Styles speak of one axis of it, the
    tensor-parallel one: ``tp_axis``, else the only axis of a 1-D mesh, else the axis named ``"tp"``.
    Other axes are data parallel: parameters keep what they do (wrap with ``FSDPv2`` before or after
    to shard them over ``"fsdp"`` too) and activations keep dim 0 (the batch) split over them.
    Parameters not in the plan stay as they are; the module then moves to ``st.device()``.

    Example::

        mesh = st.init_device_mesh("cpu", (4, 2), mesh_dim_names=("fsdp", "tp"))
        st.parallelize_module(model, mesh, {
            "layers.*.mlp.up_proj": st.ColwiseParallel(),
            "layers.*.mlp.down_proj": st.RowwiseParallel(),
        })
        model.layers[0].mlp.up_proj.weight.partition_spec   # PartitionSpec('tp', None)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize_module takes an nn.Module, got {type(module).__name__}")
    tp = TensorParallelMesh.of(as_mesh(device_mesh), tp_axis)
    # resolve and check the whole plan first, so a bad entry leaves the module untouched
    steps = [(style, sub) for path, style in _plan_items(parallelize_plan) for sub in _matching_modules(module, path)]
    for style, sub in steps:
        style.check(sub)
    owners = _owners_of_shared_parameters(module)
    for style, sub in steps:
        style.apply(sub, tp)
    _retie(owners)
    module.to(st.device())
    return module


def _plan_items(plan) -> list[tuple[str, ParallelStyle]]:
    """``plan`` as (module path, style) pairs, each checked."""
    if isinstance(plan, ParallelStyle):
        return [("", plan)]
    if not isinstance(plan, Mapping):
        raise TypeError(f"parallelize_plan must be a style or a dict {{module path: style}}, got {type(plan).__name__}")
    for path, style in plan.items():
        if not isinstance(path, str):
            raise TypeError(f"parallelize_plan keys are module paths (strings), got {path!r}")
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"parallelize_plan[{path!r}] is {style!r}, not a style (st.ColwiseParallel(), "
                "st.RowwiseParallel(), st.SequenceParallel(), st.PrepareModuleInput/Output(...))"
            )
    return list(plan.items())


def _owners_of_shared_parameters(module: nn.Module) -> list[list[tuple[str, nn.Module, str]]]:
    """For each parameter held by several modules (tied weights): its (path, module, name) owners."""
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        for name, p in sub.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((f"{path}.{name}" if path else name, sub, name))
    return [group for group in owners.values() if len({id(m) for _, m, _ in group}) > 1]


def _retie(groups: list[list[tuple[str, nn.Module, str]]]) -> None:
    """Tied parameters that the plan placed apart are tied again when their layouts agree; two
    different layouts for one tensor are an error."""
    for group in groups:
        held = [(path, getattr(m, name)) for path, m, name in group]
        placed = [(path, p) for path, p in held if is_tensor_parallel(p)]
        if not placed or len({id(p) for _, p in held}) == 1:
            continue
        layouts = {path: p.partition_spec if is_tensor_parallel(p) else "not in the plan" for path, p in held}
        if len({str(v) for v in layouts.values()}) > 1:
            raise ValueError(
                f"the tied parameters {list(layouts)} (one tensor) got different layouts from the plan: {layouts}. "
                "Give their modules styles that place the tensor alike, or untie them first."
            )
        for _, m, name in group:
            setattr(m, name, placed[0][1])


def _matching_modules(root: nn.Module, path: str) -> list[nn.Module]:
    """The submodules of ``root`` that ``path`` names, each part matched with fnmatch."""
    found = [root]
    done: list[str] = []
    for token in path.split(".") if path else []:
        children = [c for m in found for name, c in m.named_children() if fnmatch(name, token)]
        if not children:
            known = sorted({name for m in found for name, _ in m.named_children()})
            where = ".".join(done) or "the module"
            raise ValueError(
                f"parallelize_plan key {path!r}: no submodule of {where} matches {token!r} "
                f"(its children: {known or 'none'}); check the path against model.named_modules()"
            )
        found = children
        done.append(token)
    return found


class _VocabParallelCrossEntropy(TorchFunctionMode):
    """Under ``loss_parallel``: the logits of ``F.cross_entropy`` keep their vocabulary split, in
    forward and for their gradient (so the compiler reduces per-row maxima and sums, small, instead
    of gathering the logits)."""

    def __init__(self, tp: TensorParallelMesh | None):
        super().__init__()
        self.tp = tp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy and args and isinstance(args[0], st.ShardedTensor):
            args = (self._vocab_split(args[0]), *args[1:])
        return func(*args, **kwargs)

    def _vocab_split(self, logits: torch.Tensor) -> torch.Tensor:
        class_dim = 1 if logits.dim() >= 2 else 0  # cross_entropy's classes: dim 1 of (N, C, ...)
        tp = self.tp or _tp_of(logits, class_dim)
        if tp is None:
            return logits
        return relayout(logits, tp, (Shard(class_dim),), "logits of cross_entropy")


def _tp_of(t: torch.Tensor, dim: int) -> TensorParallelMesh | None:
    """The mesh axis that the annotation of ``t`` splits dimension ``dim`` over, if any (a tensor
    computed from an annotated one, e.g. by ``.float()`` or a view, has no annotation: None)."""
    if not isinstance(t, st.ShardedTensor) or t.partition_spec is None or t.dim() == 0:
        return None
    for axis, p in enumerate(t.placements):
        if isinstance(p, Shard) and p.dim % t.dim() == dim:
            return TensorParallelMesh(t.device_mesh, axis)
    return None


@contextlib.contextmanager
def loss_parallel(device_mesh: Mesh | None = None, *, tp_axis: str | int | None = None) -> Iterator[None]:
    """A context in which ``F.cross_entropy`` computes on logits split over the vocabulary
    (DTensor's ``loss_parallel``); run the loss and its ``backward()`` inside it.

    The result is the same with or without it (the compiler partitions any cross-entropy
    correctly); inside it the logits' classes stay split over the tensor-parallel axis, in forward
    and for their gradient, so only per-row maxima and sums cross devices. That axis is the
    tensor-parallel axis of ``device_mesh`` when given (``tp_axis``, the only axis, or ``"tp"``, as
    for ``parallelize_module``); without a mesh it is the axis the logits' annotation splits their
    classes over — a head's output carries one, a tensor computed from it (``.float()``, a view, as
    in Hugging Face's loss) does not, and is then left to the compiler. The classes are dim 1 of
    cross_entropy's input, as always: flatten ``(batch, seq, vocab)`` logits to ``(N, vocab)``.

    Example::

        with st.loss_parallel(mesh):
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
    """
    tp = None if device_mesh is None and tp_axis is None else TensorParallelMesh.of(as_mesh(device_mesh), tp_axis)
    with _VocabParallelCrossEntropy(tp):
        yield
