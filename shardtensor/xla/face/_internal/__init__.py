"""``torch_xla._internal`` under the face: only ``tpu.version()``, which scripts and tests read."""

from shardtensor.xla.face._internal import tpu  # noqa: F401
