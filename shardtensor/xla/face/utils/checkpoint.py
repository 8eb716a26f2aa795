"""``torch_xla.utils.checkpoint`` under the face: activation checkpointing is torch's own
(``torch.utils.checkpoint``), which runs on shardtensor's device."""

from torch.utils.checkpoint import checkpoint, checkpoint_sequential  # noqa: F401
