"""DTensor's tensor-parallel styles as sharding annotations: ``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``, ``PrepareModuleInput`` and ``PrepareModuleOutput``.

A style places a module's parameters (``st.shard`` with the spec of its placements) and adds
forward hooks that constrain the module's inputs and outputs to the style's layouts. The compiler
then inserts the collectives DTensor would run by hand: a row-wise layer's partial sums become an
all-reduce (output ``Replicate()``) or a reduce-scatter (output ``Shard(dim)``), a sequence-sharded
input of a column-wise layer an all-gather. Gradients go through the same layouts in reverse.

All tensors stay ShardedTensors with their global shapes. ``use_local_output`` is accepted for
DTensor's signatures but has nothing to do: SPMD has no local tensors, the output is always the
whole value laid out as ``output_layouts``.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

import shardtensor as st
from shardtensor.tensor_parallel.layouts import TensorParallelMesh, checked_layouts, mark_tensor_parallel, relayout
from shardtensor.tensor_parallel.placements import Placement, Replicate, Shard

# one placement, or one per input/output (None: that one is left alone)
Layouts = Placement | Sequence[Placement | None] | None


class ParallelStyle(ABC):
    """What ``st.parallelize_module`` applies to one module (DTensor's ``ParallelStyle``)."""

    @abstractmethod
    def apply(self, module: nn.Module, tp: TensorParallelMesh) -> nn.Module:
        """Place ``module``'s parameters and add its hooks; returns ``module``."""

    def check(self, module: nn.Module) -> None:
        """Raise a clear error if this style cannot apply to ``module`` (any module, by default).

        Example: ``ColwiseParallel().check(nn.LayerNorm(4))`` raises a TypeError.
        """
        return None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class _LinearOrEmbeddingStyle(ParallelStyle):
    def check(self, module: nn.Module) -> None:
        """A TypeError unless ``module`` is an nn.Linear or nn.Embedding. Example: ``style.check(fc)``."""
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise TypeError(
                f"{type(self).__name__} applies to nn.Linear and nn.Embedding, not to {type(module).__name__}; "
                "give this module another style (SequenceParallel, PrepareModuleInput/Output) or plan its "
                "Linear/Embedding children"
            )


def _place(module: nn.Module, name: str, tp: TensorParallelMesh, placement: Placement) -> None:
    """Replace ``module.<name>`` by a parameter laid out as ``placement`` on the tensor-parallel axis."""
    p = getattr(module, name, None)
    if p is None:
        return
    spec = tp.parameter_spec(p, placement)
    new = nn.Parameter(st.shard(p.detach(), tp.mesh, spec), requires_grad=p.requires_grad)
    mark_tensor_parallel(new)
    setattr(module, name, new)


# Hooks are partials of module-level functions, not closures, so a parallelized model pickles.
def _lay_out_first_input(tp: TensorParallelMesh, layouts: tuple, module: nn.Module, args: tuple) -> tuple:
    if not args:
        raise ValueError(f"{type(module).__name__} got no positional input to lay out")
    return (relayout(args[0], tp, layouts, f"input of {type(module).__name__}"), *args[1:])


def _lay_out_output(tp: TensorParallelMesh, layouts: tuple, module: nn.Module, args: tuple, output: Any) -> Any:
    return relayout(output, tp, layouts, f"output of {type(module).__name__}")


def _add_hooks(module: nn.Module, tp: TensorParallelMesh, inputs: tuple, outputs: tuple) -> None:
    module.register_forward_pre_hook(functools.partial(_lay_out_first_input, tp, inputs))
    module.register_forward_hook(functools.partial(_lay_out_output, tp, outputs))


class ColwiseParallel(_LinearOrEmbeddingStyle):
    """Split an ``nn.Linear``'s output features (weight and bias ``Shard(0)``) or an
    ``nn.Embedding``'s embedding dimension (weight ``Shard(1)``) over the tensor-parallel axis.

    The input is taken as ``input_layouts`` (default ``Replicate()``) and made replicated; the
    output is laid out as ``output_layouts`` (default ``Shard(-1)``, the features split).

    Example::

        st.parallelize_module(mlp, mesh, {"up": st.ColwiseParallel(), "down": st.RowwiseParallel()})
    """

    def __init__(
        self, *, input_layouts: Layouts = None, output_layouts: Layouts = None, use_local_output: bool = True
    ) -> None:
        self.input_layouts = checked_layouts(input_layouts or Replicate(), "input_layouts")
        self.output_layouts = checked_layouts(output_layouts or Shard(-1), "output_layouts")
        self.desired_input_layouts = (Replicate(),)
        self.use_local_output = use_local_output  # nothing to do in SPMD (module docstring)

    def apply(self, module: nn.Module, tp: TensorParallelMesh) -> nn.Module:
        """Place the parameters and add the hooks. Example: ``ColwiseParallel().apply(fc, tp)``."""
        self.check(module)
        if isinstance(module, nn.Linear):
            _place(module, "weight", tp, Shard(0))
            _place(module, "bias", tp, Shard(0))
        else:  # an nn.Embedding (check)
            _place(module, "weight", tp, Shard(1))
        _add_hooks(module, tp, self.input_layouts + self.desired_input_layouts, self.output_layouts)
        return module


class RowwiseParallel(_LinearOrEmbeddingStyle):
    """Split an ``nn.Linear``'s input features (weight ``Shard(1)``, bias replicated) or an
    ``nn.Embedding``'s rows, the vocabulary (weight ``Shard(0)``), over the tensor-parallel axis.

    The input is taken as ``input_layouts`` (default ``Shard(-1)``) and laid out as the layer wants
    it (``Shard(-1)`` for a Linear, ``Replicate()`` for an Embedding); the partial sums of the output
    are resolved into ``output_layouts`` (default ``Replicate()``: an all-reduce; ``Shard(1)`` with
    sequence parallelism: a reduce-scatter).

    Example::

        st.RowwiseParallel(output_layouts=st.Shard(1))   # o_proj / down_proj before a SequenceParallel norm
    """

    def __init__(
        self, *, input_layouts: Layouts = None, output_layouts: Layouts = None, use_local_output: bool = True
    ) -> None:
        self.input_layouts = checked_layouts(input_layouts or Shard(-1), "input_layouts")
        self.output_layouts = checked_layouts(output_layouts or Replicate(), "output_layouts")
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, tp: TensorParallelMesh) -> nn.Module:
        """Place the parameters and add the hooks. Example: ``RowwiseParallel().apply(fc, tp)``."""
        self.check(module)
        desired: Placement
        if isinstance(module, nn.Linear):
            _place(module, "weight", tp, Shard(1))
            _place(module, "bias", tp, Replicate())
            desired = Shard(-1)
        else:  # an nn.Embedding (check)
            _place(module, "weight", tp, Shard(0))
            desired = Replicate()
        _add_hooks(module, tp, self.input_layouts + (desired,), self.output_layouts)
        return module


class SequenceParallel(ParallelStyle):
    """Run a module (a norm, dropout: anything working per position) on activations split along the
    sequence dimension; its parameters are replicated over the tensor-parallel axis.

    Input and output are laid out as ``Shard(sequence_dim)`` (default dim 1: ``(batch, seq, hidden)``).

    Example::

        plan = {"layers.*.input_layernorm": st.SequenceParallel(), "norm": st.SequenceParallel()}
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, tp: TensorParallelMesh) -> nn.Module:
        """Replicate the parameters, add the hooks. Example: ``SequenceParallel().apply(norm, tp)``."""
        for name, _ in list(module.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            _place(module.get_submodule(owner), leaf, tp, Replicate())
        _add_hooks(module, tp, self.sequence_sharding, self.sequence_sharding)
        return module


def _per_input(layouts, what: str) -> tuple | None:
    return None if layouts is None else checked_layouts(layouts, what, allow_none=True)


class PrepareModuleInput(ParallelStyle):
    """Lay out a module's inputs: each positional input is taken as ``input_layouts[i]`` and laid out
    as ``desired_input_layouts[i]`` (``None``: left alone); keyword inputs likewise with
    ``input_kwarg_layouts`` / ``desired_input_kwarg_layouts`` (dicts by name). No parameter moves.

    Example (a Hugging Face attention, called with ``hidden_states=`` as a keyword)::

        st.PrepareModuleInput(input_kwarg_layouts={"hidden_states": st.Shard(1)},
                              desired_input_kwarg_layouts={"hidden_states": st.Replicate()})
    """

    def __init__(
        self,
        *,
        input_layouts: Layouts = None,
        desired_input_layouts: Layouts = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ) -> None:
        self.input_layouts = _per_input(input_layouts, "input_layouts")
        self.desired_input_layouts = _per_input(desired_input_layouts, "desired_input_layouts")
        if (self.input_layouts is None) != (self.desired_input_layouts is None) or (
            self.input_layouts is not None and len(self.input_layouts) != len(self.desired_input_layouts or ())
        ):
            raise ValueError(
                "PrepareModuleInput needs input_layouts and desired_input_layouts of the same length "
                f"(None where an input is left alone), got {input_layouts!r} and {desired_input_layouts!r}"
            )
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if self.input_kwarg_layouts.keys() != self.desired_input_kwarg_layouts.keys():
            raise ValueError(
                "PrepareModuleInput needs input_kwarg_layouts and desired_input_kwarg_layouts for the same names, "
                f"got {sorted(self.input_kwarg_layouts)} and {sorted(self.desired_input_kwarg_layouts)}"
            )
        for name in self.input_kwarg_layouts:
            checked_layouts(self.input_kwarg_layouts[name], f"input_kwarg_layouts[{name!r}]")
            checked_layouts(self.desired_input_kwarg_layouts[name], f"desired_input_kwarg_layouts[{name!r}]")
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, tp: TensorParallelMesh) -> nn.Module:
        """Add the input hook. Example: ``PrepareModuleInput(...).apply(attn, tp)``."""
        module.register_forward_pre_hook(functools.partial(self._lay_out, tp), with_kwargs=True)
        return module

    def _lay_out(self, tp: TensorParallelMesh, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.input_layouts is not None:
            if len(args) < len(self.input_layouts):
                raise ValueError(
                    f"PrepareModuleInput on {type(module).__name__} has layouts for {len(self.input_layouts)} "
                    f"positional inputs, the call passed {len(args)} (keyword inputs take input_kwarg_layouts)"
                )
            laid_out = [
                relayout(a, tp, (given, want), f"input {i} of {type(module).__name__}") if want is not None else a
                for i, (a, given, want) in enumerate(zip(args, self.input_layouts, self.desired_input_layouts or ()))
            ]
            args = (*laid_out, *args[len(laid_out) :])
        kwargs = dict(kwargs)
        for name, given in self.input_kwarg_layouts.items():
            if name in kwargs:
                want = self.desired_input_kwarg_layouts[name]
                kwargs[name] = relayout(kwargs[name], tp, (given, want), f"input {name!r} of {type(module).__name__}")
        return args, kwargs


class PrepareModuleOutput(ParallelStyle):
    """Lay out a module's outputs: each output (a tensor, or the items of a tuple) is taken as
    ``output_layouts[i]`` and laid out as ``desired_output_layouts[i]`` (``None``: left alone).

    Example::

        st.PrepareModuleOutput(output_layouts=st.Shard(1), desired_output_layouts=st.Replicate())
    """

    def __init__(
        self, *, output_layouts: Layouts, desired_output_layouts: Layouts, use_local_output: bool = True
    ) -> None:
        self.output_layouts = checked_layouts(output_layouts, "output_layouts", allow_none=True)
        self.desired_output_layouts = checked_layouts(desired_output_layouts, "desired_output_layouts", allow_none=True)
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(
                "PrepareModuleOutput needs output_layouts and desired_output_layouts of the same length, "
                f"got {output_layouts!r} and {desired_output_layouts!r}"
            )
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, tp: TensorParallelMesh) -> nn.Module:
        """Add the output hook. Example: ``PrepareModuleOutput(...).apply(block, tp)``."""
        module.register_forward_hook(functools.partial(self._lay_out, tp))
        return module

    def _lay_out(self, tp: TensorParallelMesh, module: nn.Module, args: tuple, output: Any) -> Any:
        single = isinstance(output, torch.Tensor)
        outputs = (output,) if single else output
        if not isinstance(outputs, tuple) or len(outputs) != len(self.output_layouts):
            raise ValueError(
                f"PrepareModuleOutput on {type(module).__name__} has layouts for {len(self.output_layouts)} "
                f"output(s); the module returned {type(output).__name__}"
                + ("" if not isinstance(output, tuple) else f" of {len(output)}")
            )
        laid_out = tuple(
            relayout(o, tp, (given, want), f"output {i} of {type(module).__name__}") if want is not None else o
            for i, (o, given, want) in enumerate(zip(outputs, self.output_layouts, self.desired_output_layouts))
        )
        return laid_out[0] if single else laid_out
