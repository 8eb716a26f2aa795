"""``torch_xla`` under shardtensor's face: the top-level functions of PyTorch/XLA (``torch_xla.device``,
``devices``, ``sync``, ``step``, ``compile``, ``manual_seed``, ``launch``) on shardtensor, with
PyTorch/XLA's signatures and SPMD-mode answers. Installed as ``torch_xla`` by
``shardtensor.xla.install()`` or ``python -m shardtensor.xla script.py``; see ``docs/xla.md``.

Example::

    import torch_xla                   # (under the face)
    device = torch_xla.device()        # st.device()
    step_fn = torch_xla.compile(step_fn, full_graph=True)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

import shardtensor as st
from shardtensor.xla.face import _support

# PyTorch/XLA's release that pairs with torch 2.13, marked as this face (libraries compare versions)
__version__ = "2.13.0+shardtensor"


def device(index: int | None = None) -> torch.device:
    """The XLA device: ``st.device()``, the one logical device for the whole mesh (PyTorch/XLA's SPMD
    answer, ``xla:0``, for every index)."""
    return st.device()


def devices() -> list[torch.device]:
    """The devices of this process: ``[st.device()]`` (SPMD: one logical device)."""
    return st.devices()


def real_devices() -> list[str]:
    """The physical devices this process drives, as PyTorch/XLA names them (``['CPU:0', ...]``)."""
    return [a["name"] for a in st.global_runtime_device_attributes() if a["process_index"] == st.process_index()]


def device_count() -> int:
    """The number of physical devices this process drives."""
    return st.addressable_runtime_device_count()


def sync(wait: bool = False, reset_scope: bool = True) -> None:
    """Compile and run everything pending (``st.sync``), then the step closures
    (``xm.add_step_closure``); ``wait=True`` (or ``XLA_SYNC_WAIT=1``) waits for the devices."""
    _support.sync(wait)


class _Compiled:
    """``torch_xla.compile(f)``: ``st.compile(f)`` (one cached program per input signature), with the
    step closures run on entry and exit as PyTorch/XLA's syncs there do."""

    def __init__(self, f: Callable[..., Any], full_graph: bool, name: str | None, max_graphs: int | None) -> None:
        self._f = f
        self._compiled = st.compile(self._run, full_graph=bool(full_graph), name=name)
        self._max_graphs = max_graphs
        self._signatures: set = set()
        functools.update_wrapper(self, f)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._max_graphs is not None:
            self._count_graph(args, kwargs)
        _support.run_step_closures()
        out = self._compiled(*args, **kwargs)
        _support.run_step_closures()
        return out

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        # A training step returns its loss, whose autograd graph its own backward() has used up: the
        # loss is returned detached then (it could not be backpropagated again anyway), so that
        # st.compile can replay the step without its Python (a result that requires grad would keep
        # the Python running every call).
        return torch.utils._pytree.tree_map(_detached_if_backpropagated, self._f(*args, **kwargs))

    def _count_graph(self, args: tuple, kwargs: dict) -> None:
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        key = tuple(
            (tuple(x.shape), x.dtype, getattr(x, "sharding_spec", "")) if isinstance(x, torch.Tensor) else type(x)
            for x in leaves
        )
        if key not in self._signatures:
            self._signatures.add(key)
            if self._max_graphs is not None and len(self._signatures) > self._max_graphs:
                raise RuntimeError(
                    f"torch_xla.compile: more than max_different_graphs={self._max_graphs} different graphs "
                    f"were traced for {getattr(self, '__name__', 'the function')} (its inputs' shapes, dtypes "
                    "or shardings keep changing)."
                )

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self, obj)


def _detached_if_backpropagated(x: Any, limit: int = 256) -> Any:
    """``x.detach()`` when backward has already run through ``x``'s autograd graph (without
    ``retain_graph``: some node there has freed its saved tensors), else ``x``."""
    if not isinstance(x, torch.Tensor) or x.grad_fn is None:
        return x
    seen: set = set()
    todo: list = [x.grad_fn]
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attribute in dir(node):
            if attribute.startswith("_saved_"):
                try:
                    getattr(node, attribute)
                except RuntimeError:  # "Trying to backward through the graph a second time ..."
                    return x.detach()
        todo.extend(n for n, _ in node.next_functions)
    return x


@contextlib.contextmanager
def _compile_region(full_graph: bool, name: str | None) -> Iterator[None]:
    if full_graph:
        raise NotImplementedError(
            "torch_xla.compile(full_graph=True) as a context manager is not available under shardtensor's "
            "torch_xla face: compile a function instead (torch_xla.compile(fn, full_graph=True)), which raises "
            "on any execution inside it."
        )
    sync()
    with st.eager_mode(False):
        yield
    sync()


def compile(
    f: Callable[..., Any] | None = None,
    full_graph: bool | None = False,
    name: str | None = None,
    max_different_graphs: int | None = None,
    custom_compile_options: dict[str, Any] | None = None,
) -> Any:
    """PyTorch/XLA's ``torch_xla.compile``: ``f`` traced into one program per input signature
    (``st.compile``; its Python is replayed only while that is sound), or, with no ``f``, a context
    manager whose block is recorded lazily and run at its end. ``full_graph=True`` raises on any
    execution inside; ``max_different_graphs`` raises once more input signatures than that were seen.
    XLA compiler options (``custom_compile_options``) cannot be set: only ``None`` or ``{}``."""
    if custom_compile_options:
        raise NotImplementedError(
            "torch_xla.compile(custom_compile_options=...): shardtensor compiles through JAX and does not take "
            "per-program XLA flag overrides; set XLA_FLAGS before starting instead."
        )
    if f is None:
        if max_different_graphs is not None:
            raise NotImplementedError(
                "torch_xla.compile(max_different_graphs=...) as a context manager: compile a function instead."
            )
        return _compile_region(bool(full_graph), name)
    return _Compiled(
        f, bool(full_graph), name if name is not None else getattr(f, "__name__", None), max_different_graphs
    )


def set_custom_compile_options(options: dict[str, Any]) -> None:
    """Only ``{}`` (no overrides) is accepted: XLA flag overrides per program are not available."""
    compile(lambda: None, custom_compile_options=options)


def step() -> contextlib.AbstractContextManager:
    """PyTorch/XLA's ``with torch_xla.step():``: the block is recorded and run as one program at its end."""
    return compile()


def manual_seed(seed: int, device: Any = None) -> None:
    """Seed the random numbers of the device (``st.manual_seed``)."""
    _support.as_st_device(device)
    st.manual_seed(int(seed))


def launch(
    fn: Callable[..., Any], args: tuple = (), start_method: str = "spawn", debug_single_process: bool = False
) -> Any:
    """Run ``fn(index, *args)`` in one process per device group (``st.launch``). As in PyTorch/XLA,
    not in SPMD mode (``xr.use_spmd()``): one SPMD process drives all its devices."""
    if st.is_spmd():
        raise NotImplementedError("launch function does not support SPMD at this time")
    return st.launch(fn, args=tuple(args), nprocs=1 if debug_single_process else None, start_method=start_method)


# The submodules a script reaches as attributes of torch_xla (``torch_xla.experimental.eager_mode``,
# ``torch_xla.runtime``) without importing them: imported here, as PyTorch/XLA's __init__ does.
from shardtensor.xla.face import (  # noqa: E402,F401
    _XLAC,
    amp,  # noqa: E402,F401
    core,
    debug,
    distributed,
    experimental,
    runtime,
    utils,
)
