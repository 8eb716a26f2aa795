"""``dist.init_process_group("shardtensor")``: torch.distributed's process group of a multi-process job.

Importing shardtensor registers the backend name "shardtensor" (``Backend.register_backend``) for the
devices "cpu" and "shardtensor", and PyTorch/XLA's name "xla" as an alias of it (unless torch_xla registered
its own first); nothing else of torch.distributed changes. A group of this backend
has one rank per process of the job (rank ``st.process_index()``, world size ``st.process_count()``):

* device tensors (``st.device()``): torch.distributed's collectives on them are recorded as
  shardtensor collectives (``shardtensor/dispatch/c10d_ops.py``) before any backend sees them;
* CPU tensors: gloo, which this backend creates from the same store.

Start the processes with `st.launch` (which sets torchrun's variables) or torchrun; the default
``env://`` initialisation then works as it does under torchrun.

Example::

    def train(index):
        dist.init_process_group("shardtensor")
        x = torch.full((2,), float(dist.get_rank())).to(st.device())
        dist.all_reduce(x)            # on the device, in the step's program
        y = torch.ones(2)
        dist.all_reduce(y)            # on the CPU, through gloo

    st.launch(train, nprocs=2)
"""

from __future__ import annotations

import importlib
import itertools
import os
import time
import urllib.parse

import torch

import shardtensor.runtime as rt

BACKEND = "shardtensor"
DEVICES = ("cpu", "shardtensor")
ALIAS = "xla"  # PyTorch/XLA's backend name: dist.init_process_group("xla") gives the same group


def _check_rank_is_process(rank: int, world_size: int) -> None:
    if (rank, world_size) != (rt.process_index(), rt.process_count()):
        raise RuntimeError(
            f"init_process_group('shardtensor'): rank {rank} of world size {world_size}, but this process is "
            f"process {rt.process_index()} of {rt.process_count()} of shardtensor's job; each rank must be the "
            "process of the same index. Start the processes with st.launch, or with torchrun and "
            "SHARDTENSOR_AUTO_DISTRIBUTED=1 (or st.initialize_distributed() before anything runs), and keep "
            "torchrun's RANK and WORLD_SIZE."
        )


def _create_backend(options, backend_options):
    """The creator torch.distributed calls for each group of the "shardtensor" backend: checks that the
    ranks are the job's processes, and returns gloo (for CPU tensors; device tensors never reach a
    backend)."""
    import torch.distributed as dist
    from torch.distributed import ProcessGroupGloo

    if not dist.is_initialized():  # the default (world) group: its ranks must be the processes
        _check_rank_is_process(options.group_rank, options.group_size)
    return ProcessGroupGloo(options.store, options.group_rank, options.group_size, options.timeout)


_INIT_KEY = "shardtensor/init_process_group"
_inits = itertools.count()  # init_process_group calls of this process (every process makes the same ones)


def _checked_rendezvous(handler):
    """torch's rendezvous ``handler`` (env://, tcp://), which in a job of several processes
    (jax.distributed) first checks with every process that each asks for its own rank and the job's
    world size: otherwise torch's store waits for processes that never come (a world size too large)
    or fails with EADDRINUSE (two ranks 0)."""

    def rendezvous(url: str, **kwargs):
        from jax._src import distributed as jax_distributed

        state = jax_distributed.global_state
        if state.client is not None:
            parsed = urllib.parse.urlparse(url)
            query = dict(pair.split("=", 1) for pair in parsed.query.split("&") if "=" in pair)
            environ = os.environ if parsed.scheme == "env" else {}  # (what env:// falls back on, as torch)
            asked = tuple(
                int(query.get(name, "-1")) if query.get(name, "-1") != "-1" else int(environ.get(env, "-1"))
                for name, env in (("rank", "RANK"), ("world_size", "WORLD_SIZE"))
            )
            timeout = kwargs.get("timeout")
            seconds = timeout.total_seconds() if timeout is not None else 1800.0
            _check_ranks_across_the_job(state.client, state.process_id, state.num_processes, asked, seconds)
        return handler(url, **kwargs)

    rendezvous.__wrapped__ = handler  # type: ignore[attr-defined]
    return rendezvous


def _check_ranks_across_the_job(client, index: int, count: int, asked: tuple[int, ...], seconds: float) -> None:
    """Every process publishes the (rank, world size) it asked for and reads the others' (within the
    init timeout): each raises the same error if any is not (its process index, the job's size)."""
    call = next(_inits)
    prefix = f"{_INIT_KEY}/{call}/"
    client.key_value_set(f"{prefix}{index}", f"{asked[0]},{asked[1]}")
    everyone = {}
    deadline = time.monotonic() + seconds
    for p in range(count):
        left_ms = max(int((deadline - time.monotonic()) * 1000), 1)
        try:
            text = client.blocking_key_value_get(f"{prefix}{p}", left_ms)
        except Exception as error:  # noqa: BLE001  (jaxlib raises its own error types for a timeout)
            raise TimeoutError(
                f"init_process_group: process {p} of this job of {count} processes did not call "
                f"init_process_group within the init timeout ({seconds:.0f} s); every process must call it."
            ) from error
        rank, world = (int(v) for v in text.split(","))
        everyone[p] = (rank, world)
    wrong = [p for p, (r, w) in everyone.items() if r not in (-1, p) or w not in (-1, count)]  # -1: not given
    if wrong:
        said = ", ".join(f"process {p}: rank {r} of world size {w}" for p, (r, w) in sorted(everyone.items()))
        raise ValueError(
            f"init_process_group: this process is process {index} of a job of {count} processes "
            f"(jax.distributed), but the processes asked for ({said}); each rank must be its process's "
            f"index and the world size {count}, else torch's store waits for ranks that never come. Leave "
            "rank and world_size out (st.launch and torchrun set RANK and WORLD_SIZE), or pass "
            "rank=st.process_index(), world_size=st.process_count()."
        )


def _check_rendezvous_handlers() -> None:
    # (torch.distributed.rendezvous is also the name of a function: the module, by its full name)
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    for scheme in ("env", "tcp"):
        handler = handlers.get(scheme)
        if handler is not None and not hasattr(handler, "__wrapped__"):
            handlers[scheme] = _checked_rendezvous(handler)


def register() -> None:
    """Register the backend name "shardtensor" with torch.distributed (done on import; again is a no-op).

    Example::

        register()
        dist.init_process_group("shardtensor")
    """
    if not torch.distributed.is_available():
        return
    from torch.distributed import Backend

    if BACKEND.upper() in Backend._plugins:
        return
    _check_rendezvous_handlers()
    Backend.register_backend(BACKEND, _create_backend, extended_api=True, devices=list(DEVICES))


register()


def register_alias() -> None:
    """Register "xla" (PyTorch/XLA's name) for the same backend, unless that name is taken (torch_xla
    imported first): torch's own backends and devices are left as they are.

    Example::

        register_alias()
        dist.init_process_group("xla")   # = dist.init_process_group("shardtensor")
    """
    if not torch.distributed.is_available():
        return
    from torch.distributed import Backend

    if ALIAS.upper() in Backend._plugins or hasattr(Backend, ALIAS.upper()):
        return
    Backend.register_backend(ALIAS, _create_backend, extended_api=True, devices=list(DEVICES))


register_alias()
