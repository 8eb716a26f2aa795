"""shardtensor: PyTorch programs sharded over many devices, compiled by XLA through JAX.

Example::

    import torch, shardtensor as st
    mesh = st.Mesh(range(8), (4, 2), ("data", "model"))
    x = st.shard(torch.randn(64, 16), mesh, ("data", None))
"""

# The order is deliberate: runtime configures jax first, ops fills the lowering table, dispatch installs the handler.
# isort: off
from shardtensor.runtime import (  # noqa: F401  (configures jax before anything else imports it)
    use_spmd,
    is_spmd,
    global_runtime_device_count,
    addressable_runtime_device_count,
    global_runtime_device_attributes,
    runtime_device_attributes,
    process_index,
    process_count,
    Float64OnTPUWarning,
)
from shardtensor.mesh import Mesh, HybridMesh, MeshError, get_1d_mesh, set_global_mesh, get_global_mesh  # noqa: F401
from shardtensor.sharding import PartitionSpec, ShardingSpec, ShardingSpecError, ShardingType  # noqa: F401
from shardtensor import ops  # noqa: F401  (fills the lowering table)
from shardtensor.ops.checks import set_checks, checks_enabled  # noqa: F401
from shardtensor.ops.precision import set_mat_mul_precision, get_mat_mul_precision  # noqa: F401
from shardtensor.graph import sync, step, eager_mode, is_eager_mode, UnexpectedExecutionError, clear_executables  # noqa: F401
from shardtensor.graph import executable_cache_size, set_executable_cache_size  # noqa: F401
from shardtensor.graph import mark_step  # noqa: F401  (PyTorch/XLA's name of sync)
from shardtensor.graph.rng import manual_seed  # noqa: F401
from shardtensor.graph.recompile import RecompilationWarning  # noqa: F401
from shardtensor.graph.mesh_moves import MeshCopyWarning  # noqa: F401
from shardtensor.graph.memory import OutOfDeviceMemoryError, set_device_memory_limit, device_memory_limit  # noqa: F401
from shardtensor.graph.waiting import ExecutionFailedError  # noqa: F401
from shardtensor.graph.aliasing import set_param_aliasing, param_aliasing_enabled  # noqa: F401
from shardtensor.graph.inflight import ConsumedInputError  # noqa: F401
from shardtensor.tensor import ShardedTensor, LocalShard  # noqa: F401
from shardtensor.tensor.device import device, devices, xla_devices  # noqa: F401
from shardtensor.tensor.autocast import autocast  # noqa: F401  (torch.autocast on the device: its op lists)
from shardtensor import dispatch as _dispatch  # noqa: F401  (installs the op handler and factory kernels)
from shardtensor.annotate import shard, mark_sharding, clear_sharding  # noqa: F401
from shardtensor.device_alias import alias_device, DeviceAlias  # noqa: F401
from shardtensor.compiler import compile, CompiledFunction  # noqa: F401
from shardtensor.jax_ops import call_jax, jax_op  # noqa: F401
from shardtensor import manual  # noqa: F401  (st.manual.all_reduce ...: collectives inside a manual region)
from shardtensor.manual import shard_map  # noqa: F401
from shardtensor.exporter import export, deserialize, ExportedProgram, ExportError  # noqa: F401
from shardtensor.metrics import counter_value, counter_names, counters, clear_counters  # noqa: F401
from shardtensor.metrics import (  # noqa: F401
    metrics_report,
    short_metrics_report,
    metric_data,
    metric_names,
    clear_metrics,
    clear_all,
)
from shardtensor.runtime import initialize_cache  # noqa: F401
from shardtensor.data import MpDeviceLoader  # noqa: F401
from shardtensor.nn_utils import clip_grad_norm_, keep_optimizer_state_sharded, place_optimizer_state  # noqa: F401
from shardtensor.optim_prime import prime_optimizer  # noqa: F401
from shardtensor.debug import visualize_sharding, visualize_tensor_sharding  # noqa: F401
from shardtensor.explain import explain, Explanation  # noqa: F401
from shardtensor import serialization  # noqa: F401
from shardtensor.serialization import torch_save as save, save_file, load_file  # noqa: F401
from shardtensor import dynamo_backend  # noqa: F401  (torch.compile(backend="shardtensor"); light: no torch._dynamo)
from shardtensor import checkpoint  # noqa: F401  (torch.distributed.checkpoint support for ShardedTensor)
from shardtensor.distributed import launch, LaunchError, rendezvous, mesh_reduce  # noqa: F401
from shardtensor.distributed import all_reduce, all_gather, reduce_scatter, all_to_all, collective_permute  # noqa: F401
from shardtensor.distributed import REDUCE_SUM, REDUCE_MUL, REDUCE_AND, REDUCE_OR, REDUCE_MIN, REDUCE_MAX  # noqa: F401
from shardtensor.distributed import optimizer_step, reduce_gradients  # noqa: F401
from shardtensor.generation import generate  # noqa: F401  (Hugging Face generate in two programs)
from shardtensor.integrations import transformers as _transformers_integration
from shardtensor.tensor_parallel import Shard, Replicate, Partial, distribute_tensor, init_device_mesh  # noqa: F401
from shardtensor.tensor_parallel import from_local  # noqa: F401
from shardtensor.tensor_parallel import placements_to_spec, spec_to_placements, local_map  # noqa: F401
from shardtensor.tensor_parallel import parallelize_module, loss_parallel, ParallelStyle  # noqa: F401
from shardtensor.tensor_parallel import ColwiseParallel, RowwiseParallel, SequenceParallel  # noqa: F401
from shardtensor.tensor_parallel import PrepareModuleInput, PrepareModuleOutput  # noqa: F401
from shardtensor import kernels  # noqa: F401  (Pallas kernels as JAX functions and torch ops: st.kernels)
# isort: on

_transformers_integration.install()  # transformers' mask helpers skip host reads on ShardedTensors

P = PartitionSpec

__all__ = [
    # runtime and processes
    "use_spmd",
    "is_spmd",
    "global_runtime_device_count",
    "addressable_runtime_device_count",
    "global_runtime_device_attributes",
    "runtime_device_attributes",
    "process_index",
    "process_count",
    "initialize_cache",
    "set_mat_mul_precision",
    "get_mat_mul_precision",
    "Float64OnTPUWarning",
    "launch",
    "LaunchError",
    "rendezvous",
    "mesh_reduce",
    # collectives across processes, data parallelism (PyTorch/XLA's xm.*)
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
    "REDUCE_SUM",
    "REDUCE_MUL",
    "REDUCE_AND",
    "REDUCE_OR",
    "REDUCE_MIN",
    "REDUCE_MAX",
    "optimizer_step",
    "reduce_gradients",
    # meshes and specs
    "Mesh",
    "HybridMesh",
    "MeshError",
    "get_1d_mesh",
    "set_global_mesh",
    "get_global_mesh",
    "PartitionSpec",
    "P",
    "ShardingSpec",
    "ShardingSpecError",
    "ShardingType",
    # DTensor's words (shardtensor.tensor_parallel)
    "Shard",
    "Replicate",
    "Partial",
    "distribute_tensor",
    "init_device_mesh",
    "placements_to_spec",
    "spec_to_placements",
    "from_local",
    "local_map",
    "parallelize_module",
    "loss_parallel",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    # tensors and the device
    "ShardedTensor",
    "LocalShard",
    "device",
    "autocast",
    "devices",
    "xla_devices",
    "alias_device",
    "DeviceAlias",
    "shard",
    "mark_sharding",
    "clear_sharding",
    # execution
    "sync",
    "mark_step",
    "step",
    "eager_mode",
    "is_eager_mode",
    "UnexpectedExecutionError",
    "clear_executables",
    "executable_cache_size",
    "set_executable_cache_size",
    "manual_seed",
    "RecompilationWarning",
    "MeshCopyWarning",
    "set_checks",
    "checks_enabled",
    "OutOfDeviceMemoryError",
    "set_device_memory_limit",
    "device_memory_limit",
    "ExecutionFailedError",
    "ConsumedInputError",
    "set_param_aliasing",
    "param_aliasing_enabled",
    "compile",
    "CompiledFunction",
    # JAX functions and kernels as torch ops (shardtensor.jax_ops)
    "call_jax",
    "jax_op",
    # manual regions (shardtensor.manual)
    "shard_map",
    "manual",
    "export",
    "deserialize",
    "ExportedProgram",
    "ExportError",
    # metrics
    "counter_value",
    "counter_names",
    "counters",
    "clear_counters",
    "metrics_report",
    "short_metrics_report",
    "metric_data",
    "metric_names",
    "clear_metrics",
    "clear_all",
    # data, utilities, debugging
    "MpDeviceLoader",
    "clip_grad_norm_",
    "place_optimizer_state",
    "prime_optimizer",
    "keep_optimizer_state_sharded",
    "visualize_sharding",
    "visualize_tensor_sharding",
    "explain",
    "Explanation",
    "generate",
    # saving (checkpoints: shardtensor.checkpoint)
    "serialization",
    "save",
    "save_file",
    "load_file",
]
