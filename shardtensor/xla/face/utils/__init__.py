"""``torch_xla.utils`` under the face: ``serialization`` (``xser``), ``utils`` (``SampleGenerator`` ...)
and ``checkpoint``."""

from shardtensor.xla.face.utils import checkpoint, serialization, utils  # noqa: F401
