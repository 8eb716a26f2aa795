"""Lowerings of aten ops to jax, one module per op family; importing this package fills the table."""
import importlib
import importlib.util

from shardtensor.ops.registry import Lowering, lookup, register, registered_ops  # noqa: F401

_FAMILIES = ("elementwise", "activation", "reduction", "creation", "random", "foreach",
             "matmul", "shape", "indexing", "nn", "conv", "pooling", "norm", "loss", "attention")
for _name in _FAMILIES:
    if importlib.util.find_spec(f"shardtensor.ops.{_name}") is not None:  # TODO(lead): explicit list
        importlib.import_module(f"shardtensor.ops.{_name}")
