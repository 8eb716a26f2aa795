"""``torch_xla.core`` under the face: ``xla_model`` (``xm``) and ``xla_env_vars``."""

from shardtensor.xla.face.core import xla_env_vars, xla_model  # noqa: F401
