"""L3, the engine without torch tensors: cells and nodes (``ir``), pending state and modes (``state``,
``modes``), building a program (``program``), the executable cache (``executable_cache``) and runs
(``execute``), whether programs donate what they overwrite (``aliasing``), runs in flight and what a
failed one leaves (``inflight``), view chains (``views``), the random key (``rng``), recompilation
reasons (``recompile``), and the entries that compile, export and explain build on (``capture``)."""

from shardtensor.graph.capture import Capture, Lowered, capture, lower  # noqa: F401
from shardtensor.graph.executable_cache import executable_cache_size, set_executable_cache_size  # noqa: F401
from shardtensor.graph.execute import clear_executables, run_cells  # noqa: F401
from shardtensor.graph.modes import eager_mode, is_eager_mode, mark_step, step, sync  # noqa: F401
from shardtensor.graph.state import STATE, UnexpectedExecutionError, check_execution_allowed  # noqa: F401
