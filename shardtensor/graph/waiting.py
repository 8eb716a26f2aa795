"""Waiting for results on the devices in a way that Ctrl-C can interrupt and a failure cannot hang.

``jax.block_until_ready`` waits in C++ for one shard at a time: Python never sees a Ctrl-C, and when
one device of a mesh fails (e.g. runs out of memory), the others wait forever in a collective for
it, so a wait that starts on their shards never returns. ``wait_until_ready`` polls every shard
instead, sleeping briefly between polls, and raises as soon as any shard holds an error. (On CPU,
XLA still ends the process about 40 s later if the devices left waiting in a collective never meet:
refusing programs that cannot fit before they run, ``memory``, is the real defence.)
"""

from __future__ import annotations

import time


class ExecutionFailedError(RuntimeError):
    """A program failed while it ran on the devices; the tensors it was computing have no value."""


def wait_until_ready(arrays) -> None:
    """Return when every array in ``arrays`` is computed; raise ``ExecutionFailedError`` if one failed.

    Example::

        outs = executable(*inputs)     # dispatched asynchronously
        wait_until_ready(outs)         # Ctrl-C works here; a failed device raises instead of hanging
    """
    arrays = _live(arrays)
    if all(a.is_ready() for a in arrays):
        _raise_failure(arrays)
        return
    shards = [s.data for a in arrays for s in a.addressable_shards]
    pause = 5e-5
    while shards:
        ready = [s for s in shards if s.is_ready()]
        _raise_failure(ready)
        if len(ready) < len(shards):
            ready_ids = {id(s) for s in ready}
            shards = [s for s in shards if id(s) not in ready_ids]
            time.sleep(pause)  # a Ctrl-C lands here
            pause = min(pause * 2, 1e-3)  # a long wait overshoots by at most 1 ms
        else:
            shards = []


def finished(arrays) -> bool:
    """Whether every array in ``arrays`` is computed, without waiting; raise ``ExecutionFailedError``
    if one failed. (Only whole arrays are looked at: cheap enough to ask before every run.)

    Example::

        if finished(outs): ...   # the program is done and nothing failed
    """
    arrays = _live(arrays)
    if not all(a.is_ready() for a in arrays):
        return False
    _raise_failure(arrays)
    return True


def finished_live(array) -> bool:
    """``finished([array])`` for one array known to hold its buffers (not deleted nor donated): the
    check ``inflight.settle`` makes before every run, without the filtering.

    Example::

        if finished_live(outs[0]): ...
    """
    if not array.is_ready():
        return False
    _raise_failure((array,))
    return True


def _live(arrays) -> list:
    """The jax arrays among ``arrays`` that still have buffers (``is_ready()`` on a deleted or
    donated array crashes the process in jax 0.10; a donated input has nothing left to wait for)."""
    return [a for a in arrays if hasattr(a, "is_ready") and not a.is_deleted()]


def _raise_failure(ready) -> None:
    """Raise the error of a ready array that failed (waiting on a ready array does not block)."""
    for a in ready:
        try:
            a.block_until_ready()
        except Exception as error:  # jax raises its runtime errors as several types
            raise ExecutionFailedError(
                f"a program failed while it ran on the devices ({str(error).rstrip('.')}). The tensors it "
                "was computing have no value; reading them raises this error. If it ran out of memory, set "
                "SHARDTENSOR_DEVICE_MEMORY (or st.set_device_memory_limit) to the memory a device really "
                "has, so that programs which cannot fit are refused before they run."
            ) from error
