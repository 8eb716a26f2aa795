"""``torch_xla.debug`` under the face: ``metrics`` (shardtensor's counters and timers) and ``profiler``
(JAX's profiler)."""

from shardtensor.xla.face.debug import metrics, profiler  # noqa: F401
