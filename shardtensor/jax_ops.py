"""JAX functions (and Pallas kernels) as torch ops: ``st.call_jax`` and ``st.jax_op``.

``st.call_jax(jax_fn, *tensors, **static)`` runs ``jax_fn(*arrays, **static)`` on torch tensors and
returns a tensor, or a tuple of tensors when ``jax_fn`` returns a tuple. It is one torch op
(``torch.ops.shardtensor.call_jax``), so it

* records into a lazy step as one node of the one program, runs at once in eager mode, and traces
  (and freezes) under ``st.compile``: the same function with equal static arguments is the same node;
* is one op, not a graph break, under ``torch.compile(backend="shardtensor")``;
* runs on plain CPU tensors too (JAX on its CPU device, CPU tensors back);
* has a gradient: ``jax.vjp`` of the function (which honours a ``jax.custom_vjp`` the function has),
  recorded as another ``call_jax`` op, so a backward is part of the program as well.

Inside the function, values have the exact torch dtypes (int64 and float64 stay 64-bit: shardtensor
runs JAX with 64-bit types on). Static keyword arguments must be hashable (they key the program).

Partitioning. By default the function is an ordinary piece of the global program: XLA (GSPMD)
partitions it from the shardings of its inputs and outputs, as it does every op. An opaque kernel
(a Pallas call, a custom call) cannot be partitioned, so it runs replicated: every device gathers the
inputs and computes the whole result. To run a kernel on each shard instead, give
``mesh``/``in_specs``/``out_specs`` to ``st.jax_op``: the function then runs under ``jax.shard_map``
and sees local blocks (it may use ``jax.lax`` collectives over the mesh's axis names).

Example::

    import jax.numpy as jnp, shardtensor as st

    y = st.call_jax(lambda a, b: jnp.sin(a) * b, x, w)

    @st.jax_op(mesh=mesh, in_specs=(st.P("data", None),), out_specs=st.P("data", None))
    def scale_rows(a, *, factor):
        return a * factor             # a is this device's block of rows

    z = scale_rows(x, factor=2.0)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch

from shardtensor import mesh as mesh_lib
from shardtensor.ops import jax_call
from shardtensor.sharding import PartitionSpec

__all__ = ["call_jax", "jax_op", "jax_partition_spec"]


def call_jax(jax_fn: Callable, *tensors: torch.Tensor, **static: Any) -> Any:
    """``jax_fn(*tensors, **static)`` as one torch op (see the module's doc): a tensor, or a tuple.

    Example::

        y = st.call_jax(jnp.sin, x)                             # like torch.sin(x)
        top = st.call_jax(lambda a, *, k: jax.lax.top_k(a, k), x, k=2)   # (values, indices)
    """
    return _run(jax_fn, tensors, static, _NO_PARTITION)


def jax_op(
    jax_fn: Callable | None = None,
    *,
    mesh=None,
    in_specs: Sequence | None = None,
    out_specs=None,
) -> Any:
    """A JAX function as a torch-callable op: ``@st.jax_op`` or ``@st.jax_op(mesh=..., in_specs=..., out_specs=...)``.

    The op takes torch tensors positionally and static keyword arguments, like ``st.call_jax``. With
    ``mesh`` (an ``st.Mesh`` or a ``jax.sharding.Mesh``), ``in_specs`` (one partition spec per tensor
    argument, over the mesh's axis names) and ``out_specs`` (a spec, or a tuple of specs for a tuple of
    outputs), the function runs per shard under ``jax.shard_map``. A single output's spec is best
    written ``st.P(...)``: a bare tuple of specs means one spec per output.

    Example::

        @st.jax_op
        def gelu(x):
            return jax.nn.gelu(x)

        @st.jax_op(mesh=mesh, in_specs=(st.P("x"),), out_specs=st.P())
        def total(a):
            return jax.lax.psum(a.sum(), "x")
    """
    if jax_fn is None:
        return functools.partial(jax_op, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    if not callable(jax_fn):
        raise TypeError(f"st.jax_op takes a JAX function, got {type(jax_fn).__name__}.")
    partition = _partition(mesh, in_specs, out_specs)
    n_specs = -1 if in_specs is None else len(in_specs)
    partition_key = _register_partition(partition)

    @functools.wraps(jax_fn)
    def op(*tensors: torch.Tensor, **static: Any) -> Any:
        if n_specs >= 0 and n_specs != len(tensors):
            raise ValueError(
                f"{_name(jax_fn)}: in_specs has {n_specs} specs but the op got {len(tensors)} tensors; "
                "give one partition spec per tensor argument."
            )
        return _run(jax_fn, tensors, static, partition_key)

    op.jax_fn = jax_fn  # type: ignore[attr-defined]
    return op


def _run(jax_fn: Callable, tensors: tuple, static: dict, partition_key: int) -> Any:
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"call_jax({_name(jax_fn)}): positional argument {i} is a {type(t).__name__}, not a tensor. "
                "Tensors go positionally; pass other values as keyword arguments (static: part of the program)."
            )
    if not tensors:
        raise TypeError(f"call_jax({_name(jax_fn)}): give at least one tensor argument.")
    key = _key(jax_fn, tuple(sorted(static.items())), partition_key)
    out = torch.ops.shardtensor.call_jax(list(tensors), key)
    return out[0] if _returns_single(key) else tuple(out)


# Partitionings (jax mesh, in specs, out specs) by int, so that the key of a call is computed from
# constants only: Dynamo runs the two functions below at trace time and bakes their results into the
# graph (``_dynamo_marked_constant`` is what torch.compiler.assume_constant_result sets; setting it
# here spares importing torch._dynamo with shardtensor).
_PARTITIONS: list[tuple] = [(None, None, None)]
_NO_PARTITION = 0


def _register_partition(partition: tuple) -> int:
    if partition == _PARTITIONS[0]:
        return _NO_PARTITION
    _PARTITIONS.append(partition)
    return len(_PARTITIONS) - 1


def _key(jax_fn: Callable, static_items: tuple, partition_key: int) -> int:
    return jax_call.key_for(jax_call.JaxCall(jax_fn, static_items, *_PARTITIONS[partition_key]))


def _returns_single(key: int) -> bool:
    return jax_call.returns_single(key)


_key._dynamo_marked_constant = True  # type: ignore[attr-defined]
_returns_single._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _partition(mesh, in_specs, out_specs) -> tuple:
    """(jax mesh, in specs, out specs, check_vma) for JaxCall, or Nones without a mesh."""
    if mesh is None:
        if in_specs is not None or out_specs is not None:
            raise ValueError("st.jax_op: in_specs/out_specs need a mesh (mesh=...) to run the function per shard.")
        return (None, None, None)
    if in_specs is None or out_specs is None:
        raise ValueError("st.jax_op(mesh=...): give in_specs (one spec per tensor) and out_specs too.")
    jmesh = mesh if isinstance(mesh, jax.sharding.Mesh) else _jax_mesh(mesh)
    names = tuple(jmesh.axis_names)
    ins = tuple(jax_partition_spec(s, names) for s in in_specs)
    outs = (
        tuple(jax_partition_spec(s, names) for s in out_specs)
        if _is_spec_sequence(out_specs)
        else jax_partition_spec(out_specs, names)
    )
    return (jmesh, ins, outs)


def _jax_mesh(mesh) -> jax.sharding.Mesh:
    if isinstance(mesh, mesh_lib.Mesh):
        return mesh.get_jax_mesh()
    raise TypeError(f"mesh must be an st.Mesh or a jax.sharding.Mesh, got {type(mesh).__name__}.")


def _is_spec_sequence(specs) -> bool:
    if isinstance(specs, (PartitionSpec, jax.sharding.PartitionSpec)) or specs is None:
        return False
    return isinstance(specs, (tuple, list)) and all(
        isinstance(s, (PartitionSpec, jax.sharding.PartitionSpec, tuple, list)) for s in specs
    )


def jax_partition_spec(spec, axis_names: Sequence[str]) -> jax.sharding.PartitionSpec:
    """A jax PartitionSpec from a shardtensor spec (names, mesh axis indices, tuples of them, None).

    Example: ``jax_partition_spec(("x", None), ("x", "y")) == jax.P("x", None)``; ``None`` is ``jax.P()``.
    """
    if spec is None:
        return jax.sharding.PartitionSpec()
    if not isinstance(spec, (jax.sharding.PartitionSpec, tuple, list)):
        raise TypeError(f"a partition spec is a tuple of mesh axis names (or None per dimension), got {spec!r}.")
    entries = tuple(spec)

    def axis(a):
        if isinstance(a, int) and not isinstance(a, bool) and 0 <= a < len(axis_names):
            return axis_names[a]
        if isinstance(a, str) and a in axis_names:
            return a
        raise ValueError(f"partition spec {spec!r}: {a!r} is not an axis of the mesh (axes: {tuple(axis_names)}).")

    out: list = []
    for e in entries:
        if e is None:
            out.append(None)
        elif isinstance(e, (tuple, list)):
            out.append(tuple(axis(a) for a in e))
        else:
            out.append(axis(e))
    return jax.sharding.PartitionSpec(*out)
