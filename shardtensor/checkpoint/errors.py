"""What a checkpoint that cannot be loaded raises (each names the key, file or path at fault)."""

from __future__ import annotations


class CheckpointNotFoundError(FileNotFoundError):
    """No complete checkpoint at the path: it does not exist, or has no ``.metadata`` (DCP writes the
    metadata last, so a save that was interrupted leaves none).

    Example::

        try:
            st.checkpoint.load(state, "ckpt/step_7")
        except st.checkpoint.CheckpointNotFoundError:
            ...  # start from scratch
    """


class CheckpointCorruptError(ValueError):
    """A checkpoint file is shorter than its metadata says, or its metadata cannot be read.

    Example::

        st.checkpoint.load(state, "ckpt")   # CheckpointCorruptError: ckpt/__0_0.distcp is truncated ...
    """


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the target state dict: keys missing on either side, another shape
    or another dtype. Raised before anything is read, so the target is unchanged.

    Example::

        st.checkpoint.load({"model": other_model.state_dict()}, "ckpt")   # names every such key
    """
