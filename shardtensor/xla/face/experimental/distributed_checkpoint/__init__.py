"""``torch_xla.experimental.distributed_checkpoint`` under the face: ``CheckpointManager`` (shardtensor's,
with PyTorch/XLA's signature and its checkpoint on preemption), the SPMD planners (DCP's default
planners: ShardedTensors speak DCP's tensor protocol), ``prime_optimizer``."""

from __future__ import annotations

import signal
import threading
from typing import Any

import shardtensor as st

prime_optimizer = st.prime_optimizer


class _SigtermWatch:
    """Notes a SIGTERM (a preemption notice) instead of ending the process, so the training loop can
    checkpoint at its next step; a second SIGTERM goes to the handler there was before."""

    def __init__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "CheckpointManager(chkpt_on_preemption=True) must be created in the main thread (it handles "
                "SIGTERM there); create it there, or pass chkpt_on_preemption=False."
            )
        self.step: int | None = None
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        if self.received:  # a second notice: do what was done before
            signal.signal(signal.SIGTERM, self._previous)
            signal.raise_signal(signal.SIGTERM)
        self.received = True


class CheckpointManager(st.checkpoint.CheckpointManager):
    """PyTorch/XLA's ``CheckpointManager(path, save_interval, max_to_keep=0, max_pending_async=1,
    num_of_threads=1, process_group=None, chkpt_on_preemption=True)``: shardtensor's manager (checkpoints
    every ``save_interval`` steps, the newest ``max_to_keep`` kept, background saves), and with
    ``chkpt_on_preemption`` a checkpoint at the first step after a preemption notice (SIGTERM in a
    single process; JAX's preemption sync point across processes). ``num_of_threads``: saves are
    written by one thread."""

    def __init__(
        self,
        path: str,
        save_interval: int,
        max_to_keep: int | None = 0,
        max_pending_async: int | None = 1,
        num_of_threads: int | None = 1,
        process_group: Any = None,
        chkpt_on_preemption: bool = True,
    ) -> None:
        super().__init__(
            path,
            save_interval,
            max_to_keep=max_to_keep or 0,
            async_queue_size=max_pending_async or 1,
            process_group=process_group,
        )
        self.chkpt_on_preemption = chkpt_on_preemption
        self._watch = _SigtermWatch() if chkpt_on_preemption and st.process_count() == 1 else None
        self._preempted_at: int | None = None

    def reached_preemption(self, step: int) -> bool:
        """Whether ``step`` is the step to checkpoint at after a preemption notice."""
        if not self.chkpt_on_preemption:
            return False
        if self._preempted_at is not None:
            return step == self._preempted_at
        if self._watch is not None:
            reached = self._watch.received
        else:
            from jax.experimental import multihost_utils

            reached = bool(multihost_utils.reached_preemption_sync_point(step))
        if reached:
            self._preempted_at = step
        return reached

    def should_save(self, step: int) -> bool:
        """A multiple of ``save_interval``, or the step after a preemption notice."""
        return super().should_save(step) or self.reached_preemption(step)


def __getattr__(name: str) -> Any:
    # DCP's planners are imported when asked for (DCP takes ~0.8 s to import)
    if name in ("SPMDSavePlanner", "SPMDLoadPlanner"):
        from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

        classes = {
            "SPMDSavePlanner": type(
                "SPMDSavePlanner",
                (DefaultSavePlanner,),
                {"__doc__": "DCP's default save planner: a ShardedTensor writes each distinct shard once."},
            ),
            "SPMDLoadPlanner": type(
                "SPMDLoadPlanner",
                (DefaultLoadPlanner,),
                {"__doc__": "DCP's default load planner: a ShardedTensor reads the shards its devices hold."},
            ),
        }
        globals().update(classes)
        return classes[name]
    raise AttributeError(f"module 'torch_xla.experimental.distributed_checkpoint' has no attribute {name!r}")
