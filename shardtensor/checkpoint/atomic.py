"""An atomic ``dcp.save``: a temporary directory renamed into place when complete."""

from __future__ import annotations

import os
import pathlib
import shutil
from typing import Any

from shardtensor import runtime


def save(state_dict: dict, checkpoint_id: str | os.PathLike, **kwargs: Any) -> None:
    """``dcp.save`` made atomic: writes into a temporary directory next to ``checkpoint_id`` and renames
    it into place only when the save (metadata last) finished, so an exception or a killed process
    leaves the previous checkpoint at ``checkpoint_id`` readable and no half-written one there.
    One process, local paths (several processes: call ``dcp.save`` itself). ``kwargs`` go to ``dcp.save``.

    Example::

        st.checkpoint.save({"model": model.state_dict()}, "ckpt/step_100")
    """
    import torch.distributed.checkpoint as dcp

    if runtime.process_count() > 1:
        raise NotImplementedError(
            "shardtensor.checkpoint.save renames the directory from one process; with "
            f"{runtime.process_count()} processes call torch.distributed.checkpoint.save directly"
        )
    path = pathlib.Path(checkpoint_id)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dcp.save(state_dict, checkpoint_id=tmp, **kwargs)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        os.replace(path, old)  # (a directory cannot be renamed over a non-empty one)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
