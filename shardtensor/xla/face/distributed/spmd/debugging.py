"""``torch_xla.distributed.spmd.debugging`` under the face: PyTorch/XLA's ``rich`` tables of which device
holds which block (``st.visualize_sharding``, ``st.visualize_tensor_sharding``)."""

from __future__ import annotations

import torch

import shardtensor as st

visualize_sharding = st.visualize_sharding
visualize_tensor_sharding = st.visualize_tensor_sharding


def construct_v1_sharding_str(t: torch.Tensor) -> str:
    """The tensor's sharding string in HLO's V1 form (explicit device ids), as shardtensor reports it."""
    if not isinstance(t, st.ShardedTensor):
        raise TypeError(f"construct_v1_sharding_str needs a tensor on torch_xla.device(), got one on {t.device}.")
    return t.sharding_spec
