"""ShardedTensor: a torch tensor whose value lives in JAX, sharded over a mesh.

Each ShardedTensor points at a storage ``Cell`` and, for views, a chain of view ops from the Cell's
value to its own. What ``__torch_dispatch__`` does with an op is the dispatch layer's: it fills the
op-handler slot (``set_op_handler``) when imported.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from types import EllipsisType
from typing import Any, cast

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from shardtensor import metrics as counters
from shardtensor import runtime
from shardtensor import sharding as sh
from shardtensor.dtypes import numpy_to_torch
from shardtensor.graph.interrupts import import_whole
from shardtensor.graph.ir import Cell
from shardtensor.mesh import Mesh, default_mesh
from shardtensor.tensor import backward_errors, readback, storage
from shardtensor.tensor import device as torch_device
from shardtensor.tensor.geometry import contiguous_strides, meta_like


def _no_handler(func: Any, args: tuple, kwargs: dict) -> Any:
    raise RuntimeError(
        f"{func} reached a ShardedTensor before shardtensor.dispatch installed the op handler "
        "(while shardtensor itself is being imported)"
    )


# what __torch_dispatch__ calls: (func, args, kwargs) -> result; set by the dispatch layer
_HANDLER: Callable[[Any, tuple, dict], Any] = _no_handler
_DYNAMO_UNFLATTEN = None  # Dynamo's __tensor_unflatten__, set by shardtensor.dynamo_backend
# DTensor's words (.placements, .redistribute) are L7's (shardtensor.tensor_parallel): it fills these slots
_PLACEMENTS_FROM_SPEC: Callable[[Mesh, Any, int], Any] | None = None
_REDISTRIBUTE: Callable[[Any, Any, Any], Any] | None = None
_TO_LOCAL: Callable[[Any], torch.Tensor] | None = None
_FROM_LOCAL: Callable[..., Any] | None = None


# What a process's first step imports lazily, made whole before its first ShardedTensor exists (a
# Ctrl-C in that step would leave it half imported: graph.interrupts): torch imports DTensor (and
# sympy, ~0.5 s) at the first op on a tensor subclass, JAX its MLIR dialects at the first compile.
FIRST_IMPORTS = ("torch.distributed.tensor", "jaxlib.mlir.dialects.builtin")
_first_made = False
# what higher layers set up once a process uses shardtensor (its optimizer step hooks): not at import
FIRST_TENSOR_CALLBACKS: list[Callable[[], None]] = []


def _before_the_first_tensor() -> None:
    global _first_made
    import_whole(*FIRST_IMPORTS)
    _first_made = True
    for callback in FIRST_TENSOR_CALLBACKS:
        callback()


def set_op_handler(handler: Callable[[Any, tuple, dict], Any]) -> None:
    """Install the function that handles every aten op on a ShardedTensor (the dispatch layer's).

    Example: ``set_op_handler(dispatch.handle)``.
    """
    global _HANDLER
    _HANDLER = handler


def set_dynamo_unflatten(unflatten) -> None:
    """Install ``__tensor_unflatten__`` for Dynamo (the torch.compile backend's)."""
    global _DYNAMO_UNFLATTEN
    _DYNAMO_UNFLATTEN = unflatten


def set_placement_hooks(
    placements_from_spec: Callable[[Mesh, Any, int], Any],
    redistribute: Callable,
    to_local: Callable[[Any], torch.Tensor] | None = None,
    from_local: Callable[..., Any] | None = None,
) -> None:
    """Install DTensor's placement words: ``placements_from_spec(mesh, spec, ndim)``,
    ``redistribute(tensor, mesh, placements)``, ``to_local(tensor)`` and ``from_local(local, mesh,
    placements, ...)`` (shardtensor.tensor_parallel's).

    Example: ``set_placement_hooks(placements.spec_to_placements, distribute.redistribute)``.
    """
    global _PLACEMENTS_FROM_SPEC, _REDISTRIBUTE, _TO_LOCAL, _FROM_LOCAL
    _PLACEMENTS_FROM_SPEC, _REDISTRIBUTE = placements_from_spec, redistribute
    if to_local is not None:
        _TO_LOCAL = to_local
    if from_local is not None:
        _FROM_LOCAL = from_local


def _placement_hook(hook):
    if hook is None:
        raise RuntimeError("placements need shardtensor.tensor_parallel, which `import shardtensor` imports")
    return hook


class _OnlyWhileCompiling:
    """A class attribute that exists only while Dynamo compiles (hasattr is False otherwise)."""

    def __get__(self, obj, owner=None):
        if torch._guards.CompileContext.try_get() is None or _DYNAMO_UNFLATTEN is None:
            raise AttributeError("__tensor_unflatten__ (ShardedTensor is traceable only while Dynamo compiles)")
        return _DYNAMO_UNFLATTEN


class ShardedTensor(torch.Tensor):
    """A tensor on ``st.device()`` whose data is a (possibly sharded) JAX array.

    Create one with ``st.shard(t, mesh, spec)``, ``t.to(st.device())`` or a factory with
    ``device=st.device()``::

        x = st.shard(torch.randn(8, 4), mesh, ("x", None))
        x.sharding_spec   # '{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}'
    """

    _cell: Cell
    # view ops from the cell's value to this tensor's value; the class's () is a result's (no chain),
    # and the class's _vcache a tensor's before its first read through the chain (views.read): defaults
    # here, so the commonest tensors made (every op's result) skip setting them
    _chain: tuple = ()
    _vcache: tuple | None = None
    # ("T", shape, dtype, strides, storage offset): this tensor's entry in a recorded op's template
    # (dispatch.record), known when the tensor is made; None when not known (then read from torch).
    # Whatever changes the geometry in place (.data =, the in-place view ops) sets it back to None.
    _sig: tuple | None = None

    @staticmethod
    def __new__(
        cls,
        cell: Cell,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        chain: tuple = (),
        requires_grad: bool = False,
        strides: Sequence[int] | None = None,
        storage_offset: int = 0,
    ) -> ShardedTensor:
        if not _first_made:
            _before_the_first_tensor()
        shape = tuple(cell.shape if shape is None else shape)
        dtype = dtype or cell.dtype
        # strides are torch's (views report theirs), so .contiguous()/.view() behave as in torch;
        # the values themselves are always logical jax arrays
        contiguous = contiguous_strides(shape)
        strides = tuple(strides) if strides else contiguous
        if strides == contiguous and not storage_offset:
            # (the shortest call: torch makes these strides itself; this runs for every op's result)
            r = torch.Tensor._make_wrapper_subclass(
                cls, shape, dtype=dtype, device=torch_device._DEVICE, requires_grad=requires_grad
            )
        else:
            r = torch.Tensor._make_wrapper_subclass(
                cls,
                shape,
                strides=strides,
                storage_offset=storage_offset,
                dtype=dtype,
                device=torch_device._DEVICE,
                requires_grad=requires_grad,
            )
            if not chain and cell.root is None:
                # the storage layout of the cell (as_strided and resize_ address storage)
                cell.root = (strides, storage_offset)
        r._cell = cell
        r._chain = chain
        r._vcache = None
        r._sig = ("T", shape, dtype, strides, storage_offset)
        return r

    @classmethod
    def _result(cls, cell: Cell, sig: tuple) -> ShardedTensor:
        """A new contiguous tensor over ``cell`` whose template entry ``sig`` (``("T", shape, dtype,
        contiguous strides, 0)``, kept by the recorded op's plan and shared by all its results) is
        known: a recorded op's result, the commonest tensor made, by the shortest way.

        Example: ``ShardedTensor._result(cell, ("T", (2, 3), torch.float32, (3, 1), 0)).shape == (2, 3)``.
        """
        if not _first_made:
            _before_the_first_tensor()
        r = torch.Tensor._make_wrapper_subclass(cls, sig[1], dtype=sig[2], device=torch_device._DEVICE)
        r._cell = cell
        r._sig = sig
        return r

    @classmethod
    def _view(cls, cell: Cell, chain: tuple, sig: tuple, contiguous: bool) -> ShardedTensor:
        """A new view over ``cell`` through ``chain`` whose template entry ``sig`` (``("T", shape,
        dtype, strides, storage offset)``, kept by the view op's plan) is known; ``contiguous``: its
        strides are the contiguous ones at offset 0. A view op's result, by the shortest way.

        Example: ``ShardedTensor._view(x._cell, chain, ("T", (3, 2), torch.float32, (1, 3), 0), False)``.
        """
        if contiguous:
            r = torch.Tensor._make_wrapper_subclass(cls, sig[1], dtype=sig[2], device=torch_device._DEVICE)
        else:
            r = torch.Tensor._make_wrapper_subclass(
                cls, sig[1], strides=sig[3], storage_offset=sig[4], dtype=sig[2], device=torch_device._DEVICE
            )
        r._cell = cell
        r._chain = chain
        r._sig = sig
        return r

    # (torch's documented way for a subclass; its stubs give the two attributes other types)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        return _HANDLER(func, args, kwargs or {})

    # --- sharding metadata ---------------------------------------------------------------
    @property
    def mesh(self) -> Mesh | None:
        """The Mesh this tensor was sharded over (``None`` when XLA chose its layout)."""
        return self._cell.mesh if not self._chain else None

    @property
    def partition_spec(self) -> sh.PartitionSpec | None:
        """The PartitionSpec given to ``shard``/``mark_sharding`` (``None`` if none)."""
        spec = self._cell.spec if not self._chain else None
        return None if spec is None else sh.PartitionSpec(*spec)

    @property
    def sharding_spec(self) -> str:
        """PyTorch/XLA's sharding string, e.g. ``'{devices=[4,2]0,1,2,3,4,5,6,7}'``; ``''`` if unknown."""
        cell = self._cell
        if self._chain:
            return ""
        if cell.spec is not None:
            return sh.sharding_string(cell.mesh, cell.spec, len(cell.shape))
        if cell.is_pending():
            return ""
        return sh.array_sharding(cell.value, len(cell.shape))[0]

    @property
    def sharding_type(self) -> sh.ShardingType | None:
        """PyTorch/XLA's sharding type of this tensor: ``REPLICATED``, ``PARTIAL`` (split and
        replicated), ``TILED`` or ``MAXIMAL``; ``None`` while it has none (a pending result with no
        annotation, whose layout XLA chooses when it runs, or a view).

        Example: ``st.shard(torch.ones(8, 4), mesh42, ("x", None)).sharding_type == st.ShardingType.PARTIAL``.
        """
        cell = self._cell
        if self._chain:
            return None
        if cell.spec is not None:
            return sh.sharding_type(cell.mesh, cell.spec, len(cell.shape))
        text = self.sharding_spec
        if not text:
            return None
        parsed = sh.parse_sharding_string(text)
        if parsed.kind != "tiled":
            return sh.ShardingType.REPLICATED if parsed.kind == "replicated" else sh.ShardingType.MAXIMAL
        return sh.ShardingType.PARTIAL if parsed.replicas > 1 else sh.ShardingType.TILED

    @property
    def global_tensor(self) -> ShardedTensor:
        """The tensor itself: PyTorch/XLA's ``XLAShardedTensor.global_tensor`` (the whole logical
        tensor behind a sharded wrapper); a ShardedTensor is already the whole tensor.

        Example: ``st.mark_sharding(t, mesh, ("x", None)).global_tensor is t``.
        """
        return self

    @property
    def pending(self) -> bool:
        """Whether this tensor's value is recorded but not computed yet (lazy mode, before
        ``st.sync()``): PyTorch/XLA's "IR value" as against device data. ``mark_sharding`` on a
        pending tensor adds a sharding constraint; on a computed one it moves the data.

        Example: ``(x + 1).pending`` is True until ``st.sync()``; ``st.shard(t, mesh, spec).pending`` is False.
        """
        return self._cell.is_pending()

    @property
    def device_mesh(self) -> Mesh:
        """The mesh this tensor's data is laid out over (DTensor's ``device_mesh``).

        Example: ``st.shard(torch.ones(8), mesh, ("x",)).device_mesh == mesh``.
        """
        partial = self._partial_state()
        return partial.mesh if partial is not None else self._layout()[0]

    @property
    def placements(self) -> tuple:
        """DTensor's placements, one per mesh axis: ``Shard(dim)``, ``Replicate()`` or, for a
        partial tensor (``st.from_local``/``st.distribute_tensor`` with ``Partial()``), ``Partial()``.

        Example: ``st.shard(torch.ones(8, 4), mesh42, ("x", None)).placements == (Shard(0), Replicate())``.
        """
        partial = self._partial_state()
        if partial is not None:
            return partial.placements
        mesh, spec = self._layout()
        return _placement_hook(_PLACEMENTS_FROM_SPEC)(mesh, spec, self.dim())

    def _partial_state(self):
        """The record of this tensor's pending reduction (shardtensor.tensor_parallel.partial), or None;
        an in-place change (or ``.data =``) since it was made leaves an ordinary tensor."""
        state = self.__dict__.get("_partial")
        if state is None or state.cell is not self._cell or state.version != self._version or self._chain:
            return None
        return state

    def redistribute(self, device_mesh: Mesh | None = None, placements: Sequence | None = None) -> ShardedTensor:
        """A new tensor with the same values laid out as ``placements`` over ``device_mesh``
        (DTensor's ``redistribute``; the compiler chooses the collectives).

        Example: ``y = x.redistribute(mesh, [st.Replicate(), st.Shard(0)])``.
        """
        return _placement_hook(_REDISTRIBUTE)(self, device_mesh, placements)

    def to_local(self, *, grad_placements: Sequence | None = None) -> torch.Tensor:
        """This process's block of the value as a CPU torch tensor (DTensor's ``to_local``, where a
        process drives several devices): the whole value in a job of one process, the part the
        process's devices hold together in a job of several; a partial tensor's: this process's
        summand. Autograd flows through (``grad_placements`` is accepted for DTensor's signature).

        Example: ``st.from_local(t, mesh, [st.Shard(0)]).to_local()`` is ``t`` in every process.
        """
        return _placement_hook(_TO_LOCAL)(self)

    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: Mesh | None = None,
        placements: Sequence | None = None,
        *,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
    ) -> ShardedTensor:
        """A global tensor from each process's block ``local_tensor`` laid out as ``placements``
        (DTensor's ``from_local``; see ``st.from_local``).

        Example: ``x = ShardedTensor.from_local(torch.ones(4, 2), mesh, [st.Shard(0)])``.
        """
        return _placement_hook(_FROM_LOCAL)(
            local_tensor, device_mesh, placements, run_check=run_check, shape=shape, stride=stride
        )

    def full_tensor(self) -> torch.Tensor:
        """The whole value as a CPU torch tensor (DTensor's ``full_tensor``; autograd flows through it).

        Example: ``torch.testing.assert_close(st.distribute_tensor(t, mesh, [st.Shard(0)]).full_tensor(), t)``.
        """
        return self.cpu()

    @property
    def local_shards(self) -> list[LocalShard]:
        """Each addressable device's shard: ``data`` (padded CPU tensor), ``indices``, ``unpadded_data``,
        ``device`` and ``replica_id`` (of a partial tensor: each device's summand piece).

        Example::

            [s.indices for s in x.local_shards]
        """
        partial = self._partial_state()
        if partial is not None:  # each device's summand piece, as DTensor's rank there holds it
            return partial.local_shards()
        array = self._concrete_array()
        mesh, spec = self._layout()
        by_id = {p.device_id: p for p in sh.placements(self.shape, mesh, spec)}
        shards = []
        for s in sorted(array.addressable_shards, key=lambda s: s.device.id):
            p = by_id[runtime.device_id(s.device)]
            data = numpy_to_torch(np.asarray(s.data))
            shards.append(LocalShard(data, p.indices, f"{s.device.platform.upper()}:{p.device_id}", p.replica_id))
        counters.increment("TransferFromDevice")
        return shards

    def _layout(self):
        """(mesh, spec) of this tensor's stored array, deriving them from jax when XLA chose."""
        cell = self._cell
        if cell.spec is not None and not self._chain:
            return cell.mesh, cell.spec
        array = self._concrete_array()
        _, mesh, spec = sh.array_sharding(array, array.ndim)
        if mesh is None or spec is None:
            return default_mesh(), (None,) * array.ndim
        return mesh, sh.normalize_spec(mesh, tuple(spec), array.ndim)

    def _concrete_array(self):
        """The stored jax array of this tensor (views and pending values are computed first)."""
        return readback.materialize(self)

    # --- conversions ---------------------------------------------------------------------
    def untyped_storage(self) -> torch.UntypedStorage:
        # identified by the storage cell, so safetensors and transformers can group tensors by storage
        cell = getattr(self, "_cell", None)
        if cell is None:  # (torch.compile's tracing subclass has no cell: torch's storage)
            return super().untyped_storage()
        nbytes = math.prod(cell.shape) * cell.dtype.itemsize
        return storage.storage_of(super().untyped_storage(), id(cell), nbytes)

    def data_ptr(self) -> int:
        # consistent with untyped_storage(): safetensors' save_model keeps a tensor that starts its storage
        cell = getattr(self, "_cell", None)
        if cell is None:
            return super().data_ptr()
        return id(cell) + int(self.storage_offset()) * self.element_size()

    def numpy(self, *, force: bool = False) -> np.ndarray:
        return self.cpu().numpy()

    def tolist(self) -> list:  # (a Python number for a 0-d tensor, as torch's)
        return self.cpu().tolist()

    # (torch's stubs declare `data` a plain Tensor attribute; it is a getset descriptor)
    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)  # type: ignore[attr-defined]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # torch's set_data swaps the C++ impl but not our Python attributes: move those too
        torch._C.TensorBase.data.__set__(self, value)  # type: ignore[attr-defined]
        self._sig = None  # a new geometry
        if isinstance(value, ShardedTensor):
            self._cell, self._chain, self._vcache = value._cell, value._chain, None

    def register_hook(self, hook: Callable[[torch.Tensor], torch.Tensor | None]) -> RemovableHandle:
        return super().register_hook(_guarded_hook(hook))

    def register_post_accumulate_grad_hook(self, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
        return super().register_post_accumulate_grad_hook(_guarded_hook(hook))

    # (_guarded_hook only matters when the C++ device guard could not be built)

    def __format__(self, format_spec):
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __repr__(self, *, tensor_contents=None):
        value = self.detach().cpu()
        grad = f", grad_fn=<{self.grad_fn.name()}>" if self.grad_fn is not None else ""
        req = ", requires_grad=True" if self.requires_grad and self.grad_fn is None else ""
        return f"ShardedTensor({value!r}, sharding={self.sharding_spec!r}{grad}{req})"

    def __reduce_ex__(self, protocol):
        # torch.save of a ShardedTensor writes a plain CPU tensor that loads without shardtensor, an
        # nn.Parameter a plain CPU Parameter (FSDPv2 records its parameters' sharding beside them).
        cpu = self.detach().cpu()
        if getattr(self, "_is_param", False):
            return (torch._utils._rebuild_parameter, (cpu, self.requires_grad, collections.OrderedDict()))
        if self.requires_grad:
            cpu.requires_grad_(True)
        return cpu.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = cast(ShardedTensor, self.clone())  # (torch's stubs say Tensor)
        if self._cell.spec is not None and not self._chain:
            new._cell.sharding = self._cell.sharding
        new.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            new._is_param = True
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        memo[id(self)] = new
        return new

    # --- torch.compile (Dynamo) -----------------------------------------------------------
    # Dynamo captures a ShardedTensor only if it is a traceable wrapper subclass (otherwise it
    # inlines shardtensor's own dispatch Python and graph-breaks on every op). The protocol:
    #  - __tensor_flatten__, always present: Dynamo's guards call it on every compiled call to compare
    #    the sharding context, so an input sharded another way recompiles;
    #  - __tensor_unflatten__, present only while Dynamo compiles: torch treats a class as traceable
    #    only when it has both, and outside compilation it must not, or nn.Module.to(st.device())
    #    would switch to torch.utils.swap_tensors (which fails whenever autograd still references a
    #    parameter).
    # The inner "tensor" is a meta tensor of the same shape, dtype and strides: Dynamo fakeifies it
    # and traces with shardtensor.dynamo_backend's tracing subclass.
    def __tensor_flatten__(self):
        cell = self._cell
        if self._chain or cell.spec is None or cell.mesh is None:
            return ["_dynamo_meta"], None
        return ["_dynamo_meta"], (cell.mesh._key(), tuple(cell.spec))

    __tensor_unflatten__ = _OnlyWhileCompiling()

    @property
    def _dynamo_meta(self):
        # cached, so repeated reads return one object (Dynamo's aliasing guards compare ids)
        key = (tuple(self.shape), self.stride(), self.dtype, self.storage_offset())
        cached = self.__dict__.get("_dynamo_meta_cache")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_dynamo_meta_cache"] = (key, meta_like(self))
        return cached[1]


def _guarded_hook(hook):
    """A backward hook whose exception is kept and re-raised after backward (on our device, an
    exception escaping a hook on autograd's device thread would abort the process)."""
    if torch_device.CPP_GUARD:
        return hook

    @functools.wraps(hook)
    def guarded(*args, **kwargs):
        try:
            return hook(*args, **kwargs)
        except Exception as e:
            if torch._C._current_autograd_node() is None:
                raise
            backward_errors.remember(e)
            return None

    return guarded


@dataclasses.dataclass
class LocalShard:
    """One device's piece of a ShardedTensor (PyTorch/XLA's XLAShard; ``Shard`` before DTensor's ``Shard``)."""

    data: torch.Tensor  # padded to the shard shape
    indices: tuple[slice, ...] | EllipsisType  # slices into the global tensor, or Ellipsis when replicated
    device: str
    replica_id: int

    @property
    def unpadded_data(self) -> torch.Tensor:
        """The shard without its padding: ``t[shard.indices]``."""
        if isinstance(self.indices, EllipsisType):
            return self.data
        return self.data[tuple(slice(0, s.stop - s.start) for s in self.indices)]


# === torch.compile (Dynamo) support ===============================================================
# Dynamo captures a ShardedTensor only if it is a traceable wrapper subclass (otherwise it inlines
# shardtensor's own dispatch Python and graph-breaks on every op). The protocol is:
#  - __tensor_flatten__, always present: Dynamo's guards call it on every compiled call to compare the
#    sharding context, so an input sharded another way recompiles;
#  - __tensor_unflatten__, present only while Dynamo compiles: torch treats a class as traceable only
#    when it has both, and outside compilation it must not, or nn.Module.to(st.device()) would switch
#    to torch.utils.swap_tensors (which fails whenever autograd still references a parameter).
# The inner "tensor" is a meta tensor of the same shape, dtype and strides: Dynamo fakeifies it and
# traces with shardtensor.dynamo_backend._TracingShardedTensor. See shardtensor/dynamo_backend.py.


def __getattr__(name: str) -> Any:
    # the old name of LocalShard, kept for a while: st.Shard is now DTensor's placement
    if name == "Shard":
        warnings.warn(
            "shardtensor.tensor.sharded.Shard was renamed LocalShard (st.Shard is now DTensor's placement)",
            DeprecationWarning,
            stacklevel=2,
        )
        return LocalShard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
