"""``torch.compile(model, backend="shardtensor")``: Dynamo's graph of a model, run as one JAX program.

What happens, in order:

1. **Capture.** While Dynamo compiles, ``ShardedTensor`` is a traceable wrapper subclass
   (``__tensor_flatten__`` in ``tensor.py``): Dynamo replaces each ShardedTensor input and parameter by
   a ``_TracingShardedTensor`` — a wrapper around a fake *meta* tensor of the same shape, dtype and
   strides — and runs the model's Python on those. Their ``__torch_dispatch__`` only computes output
   metadata, so Dynamo never inlines shardtensor's own dispatch code and a plain MLP or transformer
   block is captured whole (0 graph breaks). The graph the backend receives is the model's *torch-level*
   FX graph (``torch._C._nn.linear``, ``torch.nn.functional.gelu``, methods, ...), with sharded
   parameters and inputs as graph inputs.
2. **Guards.** Dynamo guards on each input's ``__tensor_flatten__`` context — the mesh and partition
   spec given with ``st.shard``/``st.mark_sharding`` — so calling with an input sharded another way
   (same shape) recompiles, as does any change Dynamo itself guards on (shapes, dtypes, grad mode).
3. **Run.** Without grad, the backend runs ``st.compile(graph)``: the first calls run the graph's ops on the real
   ShardedTensors in lazy mode, through the same lowerings as eager code, and run everything the graph
   computes as **one JAX program** at the end of the call. Once two calls record the same program from
   the same tensors, and no output requires grad, the graph is frozen: later calls run the cached
   executable without running the graph's Python at all (see ``shardtensor/compiler.py``).

**Training.** Autograd is torch's own: a compiled forward records its backward like eager code does.
A graph whose outputs require grad does not run at the end of its call; its work stays pending, so in
``torch.compile(train_step)`` — where Dynamo breaks the graph at ``loss.backward()`` (run eagerly, it
records the backward lazily on top of the forward) and around the optimizer's step — the optimizer's
graph records onto both and runs **forward, backward and update as one program** when it returns
(``_DynamoGraph``). The same holds when only the model is compiled: ``loss.backward()`` and
``opt.step()`` join the forward's program, which runs at the next sync (``st.step()``, ``.item()``,
or the same compiled forward called again, which first syncs what its last call left). Such a step
re-runs the graphs' Python each call (one cached executable: no recompile); unlike ``st.compile``,
it is never frozen, because ``backward()`` between the graphs always runs. Dynamo does not trace
shardtensor itself: the functions torch calls back from C++ (``__torch_dispatch__``, the device's
factory kernels, its ``torch.autocast`` kernels, the wrapper around autograd's engine) run untraced
even between graphs.

**Autocast.** ``torch.autocast(st.device().type, ...)`` inside the compiled function is part of the
graph (Dynamo records entering and leaving it); one around the call is global state Dynamo guards on
(enabled, dtype and cache per device type): entering or leaving it recompiles, as on CUDA.

A graph break (``print``, ``.item()``, unsupported Python) splits the model into several graphs;
without grad each runs as its own program, with the code between them run lazily as usual.

Limits: only this backend knows ShardedTensor. AOTAutograd-based backends (``inductor``,
``aot_eager``) would compile for the meta placeholders, so they stop with a clear error. Dynamo guards
on the sharding the *user* gave; a computed input whose layout XLA chose is not guarded, but
shardtensor's own executable cache keys on actual layouts, so such a change still compiles a new
program (``UncachedCompile``) and gives the right result.

Example::

    import torch, shardtensor as st
    mesh = st.Mesh(range(8), (4, 2), ("data", "model"))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU()).to(st.device())
    st.mark_sharding(model[0].weight, mesh, ("model", None))
    compiled = torch.compile(model, backend="shardtensor")
    y = compiled(st.shard(torch.randn(8, 16), mesh, ("data", None)))   # one program per call

Importing this module does not import ``torch._dynamo`` (about 3 s); the backend name is registered
when Dynamo's backend registry is imported (and is also announced through the
``torch_dynamo_backends`` entry point).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import itertools
import sys
import threading
from typing import Any

import torch
from torch.utils import _pytree as pytree

from shardtensor import annotate, ops
from shardtensor import metrics as counters
from shardtensor import sharding as sh
from shardtensor.compiler import CompiledFunction
from shardtensor.dispatch import entry as dispatch_entry
from shardtensor.dispatch import factories
from shardtensor.graph import checks
from shardtensor.graph.execute import run_cells
from shardtensor.graph.state import STATE, check_execution_allowed, has_pending, pending_cells
from shardtensor.ops import elementwise
from shardtensor.tensor import ShardedTensor, backward_errors
from shardtensor.tensor import autocast as device_autocast
from shardtensor.tensor import device as torch_device
from shardtensor.tensor.sharded import set_dynamo_unflatten

BACKEND_NAME = "shardtensor"
_META = torch.device("meta")
_graph_ids = itertools.count()


def shardtensor_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """The Dynamo backend: returns ``st.compile`` of the captured graph (one JAX program per call).

    ``torch.compile`` calls it once per captured graph; normally used by name::

        compiled = torch.compile(model, backend="shardtensor")

    ``mode`` is accepted and ignored (XLA picks its own optimisations); ``options`` may hold
    ``{"full_graph": True}``, which makes anything that needs a value inside the graph an error (as
    ``st.compile(full_graph=True)``), and ``{"raise_on_call": False}``: a failed on-device check
    raises at the next call, sync or read instead of on its call, which then does not wait for the
    device (as ``st.compile(raise_on_call=False)``).
    """
    options = dict(kwargs.get("options") or {})
    full_graph = bool(options.pop("full_graph", False))
    raise_on_call = bool(options.pop("raise_on_call", True))
    if options:
        raise TypeError(
            f"the shardtensor backend has no options {sorted(options)} (it knows 'full_graph' and 'raise_on_call')"
        )
    counters.increment("DynamoGraph")
    name = f"dynamo_graph_{next(_graph_ids)}"
    return _DynamoGraph(gm, full_graph=full_graph, name=name, raise_on_call=raise_on_call)


# --- running a captured graph ---------------------------------------------------------------------
class _StepState(threading.local):
    opener: _DynamoGraph | None = None  # the graph whose call left a training step pending


_STEP = _StepState()


class _DynamoGraph:
    """One captured graph, run as one program — or, in a training step, as part of one.

    A graph whose outputs require grad (a forward) leaves its work pending: Dynamo breaks the graph at
    ``loss.backward()``, which records the backward lazily on top of it, and the next graph (the
    optimizer's step) records onto both and runs the whole step — forward, backward, update — as one
    program when it returns no tensor that requires grad. Whatever syncs first ends such a step as
    well (``.item()``, ``st.step()``, or this forward called again, which syncs what its last call
    left). Any other graph is ``st.compile`` of the graph (frozen replay of one cached program).

    Example (what ``torch.compile(train_step, backend="shardtensor")`` builds)::

        forward = _DynamoGraph(gm, full_graph=False, name="dynamo_graph_0")
        loss = forward(x, y)   # pending; runs with the backward and update that follow
    """

    def __init__(self, gm: torch.fx.GraphModule, *, full_graph: bool, name: str, raise_on_call: bool = True) -> None:
        # gm.forward, not gm: calling the module would run nn.Module hooks machinery on every call
        self.forward = gm.forward
        self.name = name
        # Dynamo's guards check every input's requires_grad (and, for a graph without symbolic shapes,
        # its shape, strides, dtype and sharding context) before each call: its frozen replays need not
        self.compiled = CompiledFunction(
            gm.forward,
            full_graph=full_graph,
            name=name,
            guarded_state=True,
            guarded_layout=_static(gm),
            raise_on_call=raise_on_call,
        )
        self.defers = _returns_grad(gm)  # (Dynamo guards on grad mode: fixed for this graph)

    def __call__(self, *args):
        if STATE.execution_guard is not None:
            check_execution_allowed(f"compiled graph {self.name} called inside a compiled function")
        opener = _STEP.opener  # the graph that opened a still pending step
        if opener is not None and not has_pending():
            opener = None
        if opener is None and not self.defers:
            _STEP.opener = None
            return self.compiled(*args)
        if opener is self:  # its last step was never closed (no graph ran after its backward): run it
            _run_pending(self.compiled.raise_on_call)
            opener = None
        out = self.forward(*args)  # recorded onto what is pending (the step so far)
        if self.defers or _requires_grad(out):
            _STEP.opener = opener or self
            return out
        _STEP.opener = None
        _run_pending(self.compiled.raise_on_call)  # the step's forward, backward and update: one program
        return out


def _run_pending(raise_on_call: bool) -> None:
    run_cells(pending_cells())
    if raise_on_call:
        checks.verify()  # a failed on-device check raises on the call that ran it


def _returns_grad(gm: torch.fx.GraphModule) -> bool:
    """Whether a graph's outputs require grad (from the example values Dynamo traced with)."""
    output = gm.graph.output_node()
    return _requires_grad(
        [a.meta.get("example_value") for a in pytree.tree_leaves(output.args) if isinstance(a, torch.fx.Node)]
    )


def _static(gm: torch.fx.GraphModule) -> bool:
    """Whether every input of a graph is a tensor of fixed shape (Dynamo then guards each input's
    exact sizes and strides; a graph with symbolic shapes takes other sizes without a guard failing)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor) or not all(type(d) is int for d in (*value.shape, *value.stride())):
            return False
    return True


def _requires_grad(out) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(out))


# --- what Dynamo traces with ----------------------------------------------------------------------
class _TracingShardedTensor(ShardedTensor):
    """The stand-in Dynamo traces the model with: a wrapper around a fake meta tensor (``_meta``).

    It exists only while Dynamo compiles (``__tensor_unflatten__`` makes it). Its ops run torch's meta
    kernels on the inner tensor and wrap the results again, so Dynamo learns output shapes, dtypes and
    aliasing without touching shardtensor's storage, lazy graph or JAX.
    """

    _meta: torch.Tensor  # the meta tensor of the same shape, dtype and strides
    _ctx: Any  # the sharding context __tensor_flatten__ reports

    @staticmethod
    def __new__(cls, meta, ctx=None, size=None, stride=None):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape if size is None else size,
            strides=meta.stride() if stride is None else stride,
            storage_offset=meta.storage_offset(),
            dtype=meta.dtype,
            device=_st_device(),
            requires_grad=meta.requires_grad,
        )
        r._meta = meta
        r._ctx = ctx
        return r

    # the same inner attribute name as a real ShardedTensor's (Dynamo reads it from both)
    _dynamo_meta = property(lambda self: self._meta)

    def __tensor_flatten__(self):
        return ["_dynamo_meta"], self._ctx

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]  # (see ShardedTensor)
        kwargs = kwargs or {}
        _refuse_aot_autograd()
        fake_mode = torch._guards.detect_fake_mode()
        inner_args, inner_kwargs = pytree.tree_map(lambda x: _to_meta(x, fake_mode), (args, kwargs))
        out = func(*inner_args, **inner_kwargs)
        out = pytree.tree_map(_wrap_meta, out)
        # in-place ops return their input, views alias its storage, as torch's own tensors do
        from torch.utils._python_dispatch import return_and_correct_aliasing

        return return_and_correct_aliasing(func, args, kwargs, out)

    # the sharding metadata code under trace reads (FSDPv2's output sharding asks partition_spec):
    # what the traced input was given, from the context its real tensor reported; nothing for
    # values computed while tracing, as for a pending ShardedTensor
    @property
    def mesh(self):
        return None

    @property
    def partition_spec(self) -> sh.PartitionSpec | None:
        return None if self._ctx is None else sh.PartitionSpec(*self._ctx[1])

    @property
    def sharding_spec(self) -> str:
        return ""

    def __repr__(self, *, tensor_contents=None):
        return f"_TracingShardedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, sharding={self._ctx})"


def _st_device():
    return torch_device.device()


def _to_meta(x, fake_mode=None):
    if isinstance(x, _TracingShardedTensor):
        return x._meta
    if isinstance(x, ShardedTensor):
        # a real one reaching tracing code (torch.tensor(data, device=st.device()) runs its device
        # kernels for real, outside the fake mode): its metadata is enough, as a fake tensor of the
        # fake mode the others belong to (fake and plain meta tensors do not mix)
        meta = x._dynamo_meta
        return meta if fake_mode is None else fake_mode.from_tensor(meta)
    if isinstance(x, torch.Tensor) and x.device.type == _st_device().type:
        return x.to(_META)  # a fake tensor Dynamo made with a factory (torch.zeros(device=...))
    if isinstance(x, torch.device) and x.type == _st_device().type:
        return _META
    return x


def _traced_fresh(t: ShardedTensor):
    """What ``torch.tensor(data, device=st.device())`` gives while Dynamo traces: the tracing stand-in
    of the real tensor torch's kernels just made (the graph calls ``torch.tensor`` again when it
    runs), so what the trace does with it goes through the stand-ins' metadata-only dispatch, as
    with ``torch.zeros(device=...)`` — never through a real tensor meeting Dynamo's fake ones."""
    fake_mode = torch._guards.detect_fake_mode()
    if fake_mode is None:  # not tracing: the real tensor
        return None
    return _TracingShardedTensor(fake_mode.from_tensor(t._dynamo_meta))


def _wrap_meta(x):
    if isinstance(x, torch.Tensor) and x.device.type == "meta":
        return _TracingShardedTensor(x)
    return x  # CPU results (.cpu() inside the graph) stay plain fake CPU tensors


def _refuse_aot_autograd():
    """AOTAutograd flattens subclasses to their inner tensors and compiles for those: for a
    ShardedTensor that is a meta placeholder, so the program would compute nothing. Say so."""
    modes = torch._C._TorchDispatchModeKey
    if (
        torch._C._get_dispatch_mode(modes.PROXY) is not None
        or torch._C._get_dispatch_mode(modes.FUNCTIONAL) is not None
    ):
        raise RuntimeError(
            "ShardedTensor works with torch.compile(backend='shardtensor') only; AOTAutograd-based "
            "backends (inductor, aot_eager, ...) cannot compile for tensors whose data lives in JAX."
        )


def unflatten(inner_tensors, ctx, outer_size, outer_stride):
    """``ShardedTensor.__tensor_unflatten__`` (only while Dynamo compiles): the tracing stand-in."""
    if not _prepared:
        _prepare_dynamo()
    return _TracingShardedTensor(inner_tensors["_dynamo_meta"], ctx, outer_size, outer_stride)


_prepared = False


def _prepare_dynamo():
    """Once, when Dynamo first meets a ShardedTensor: shardtensor's functions that read or change a
    tensor's storage cannot run on the tracing stand-ins, so Dynamo must not trace into them. Calling
    one in a compiled function is a graph break; it then runs on the real tensor between two graphs
    (``mark_sharding`` on the first graph's computed output reshards it)."""
    global _prepared
    _prepared = True
    from torch._C._dynamo.eval_frame import (
        _FrameAction,
        _FrameExecStrategy,
        set_code_exec_strategy,
    )

    # torch.compiler.disable would return a wrapper, missing every `st.mark_sharding` bound before;
    # mark the functions themselves instead: a graph break where they are called
    # (_torchdynamo_disable), and their frames and everything they call (the lazy graph, JAX) run
    # untraced (SKIP, SKIP: torch._dynamo.skip would still trace the frames they call)
    for fn in (annotate.mark_sharding, annotate.clear_sharding, annotate.shard):
        fn.__dict__.update(
            _torchdynamo_disable=True, _torchdynamo_disable_msg="shardtensor changes a tensor's sharding between graphs"
        )
        set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    # torch calls back into shardtensor from C++ (an op's __torch_dispatch__, a device factory kernel)
    # also in the eager code between two graphs, such as `loss.backward()` after a graph break. Dynamo
    # would compile those frames as user code (tracing shardtensor's engine until its recompile limit):
    # they and everything they call run untraced, as torch's own subclasses do (DTensor disables
    # Dynamo on its dispatch)
    for entry in _engine_entries():
        set_code_exec_strategy(entry.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    _register_dynamo_prims()


def _register_dynamo_prims() -> None:
    """Lower the ops Dynamo itself writes into graphs: it rewrites ``addcmul_``/``addcdiv_`` with a
    ``value`` and ``add_`` with a tensor ``alpha`` (Adam's updates) as inductor's ``prims.fma``
    (``a * b + c``), an op that exists only once Dynamo imports it, hence registered here."""
    from torch._inductor import inductor_prims  # noqa: F401  # (defines torch.ops.prims.fma)

    fma = torch.ops.prims.fma.default
    if ops.lookup(fma) is None:
        ops.register(fma)(lambda a, b, c: elementwise.addcmul(c, a, b))


def _engine_entries():
    """The Python functions torch calls from C++ on real ShardedTensors (their outermost frames)."""
    dispatch = ShardedTensor.__dict__["__torch_dispatch__"].__func__
    # (handle's outermost frame is the engine-lock wrapper, which the factory kernels share)
    entries = [dispatch, dispatch_entry.handle, factories._copy_from_kernel]
    # the device's autocast kernels (one code object for all of them), called by torch's dispatcher
    entries.extend(device_autocast.KERNELS.values())
    # the wrapper around autograd's engine (tensor/backward_errors.py), which `backward()` calls
    run_backward = torch.autograd.graph._engine_run_backward
    if run_backward.__code__.co_filename == backward_errors.__file__:  # (wraps copied torch's __module__)
        entries.append(run_backward)
    return entries


# --- registration ---------------------------------------------------------------------------------
def register() -> None:
    """Register ``backend="shardtensor"`` with Dynamo now (needed only without the entry point,
    e.g. when shardtensor is imported from a source tree that was never pip-installed)."""
    from torch._dynamo.backends import registry

    if BACKEND_NAME not in registry._COMPILER_FNS:
        registry.register_backend(shardtensor_backend, name=BACKEND_NAME)


class _RegisterWhenDynamoLoads(importlib.abc.MetaPathFinder):
    """Registers the name right after Dynamo's backend registry is imported, so that it is there
    even when Dynamo cannot see the entry point (shardtensor run from a source tree on PYTHONPATH
    without being pip-installed, or a stale ``*.egg-info`` shadowing the installed metadata)."""

    def find_spec(self, name, path=None, target=None):
        if name != _REGISTRY:
            return None
        sys.meta_path.remove(self)  # one shot; find the real spec without us
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                register()

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this one loader's
        return spec


_REGISTRY = "torch._dynamo.backends.registry"


def _register_when_dynamo_loads() -> None:
    if _REGISTRY in sys.modules:  # Dynamo already imported (so registering now costs nothing)
        register()
    elif not any(isinstance(f, _RegisterWhenDynamoLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenDynamoLoads())


_register_when_dynamo_loads()
set_dynamo_unflatten(unflatten)
factories.set_traced_fresh(_traced_fresh)
