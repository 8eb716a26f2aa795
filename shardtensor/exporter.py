"""``st.export``: a traced function as StableHLO with sharding annotations, runnable without Python.

``export(fn, *example_args)`` runs ``fn`` (a function or an ``nn.Module``) once in lazy mode on the
example arguments and keeps the program that computes what it returns. Tensor arguments become the
program's inputs, each with the sharding it had; everything else the program reads (parameters,
buffers, constants, Python numbers) is captured with its current value. The result prints as
StableHLO, serializes to bytes (jax.export's format plus the captured values), and
``st.deserialize(bytes)`` gives back a callable that runs in another process without the model's code.

Example::

    exported = st.export(model, st.shard(x, mesh, ("data", None)))
    print(exported.mlir_text())          # func.func public @main(%arg0: tensor<8x16xf32> {... sharding ...
    blob = exported.serialize()
    # later, in a fresh process with the same devices:
    y = st.deserialize(blob)(x)          # a ShardedTensor laid out as when exported
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch
from jax import export as jax_export
from torch.utils import _pytree as pytree

from shardtensor import runtime
from shardtensor.compiler import CompiledFunction
from shardtensor.dtypes import torch_to_numpy
from shardtensor.graph import mesh_moves
from shardtensor.graph.capture import capture, lower
from shardtensor.graph.execute import run_cells
from shardtensor.graph.ir import Cell
from shardtensor.graph.program import to_mesh
from shardtensor.graph.state import check_execution_allowed, pending_cells
from shardtensor.mesh import Mesh
from shardtensor.sharding import ShardingSpec
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.upload import cell_from_host

_FORMAT = "shardtensor-export"
_VERSION = 1


class ExportError(RuntimeError):
    """The function cannot be exported as it is (the message says what to change)."""


def export(fn: Callable[..., Any], *example_args: Any, **example_kwargs: Any) -> ExportedProgram:
    """Trace ``fn(*example_args, **example_kwargs)`` into one program with its shardings.

    Tensor arguments must be ShardedTensors (their sharding is the input sharding of the program);
    ``fn`` must return its results rather than update existing tensors in place. An ``st.compile``'d
    function is refused before anything runs (export the function it wraps, ``f.__wrapped__``).

    Example::

        exported = st.export(lambda a, b: a @ b, st.shard(a, mesh, ("x", None)), b_sharded)
        exported.mlir_text(); blob = exported.serialize()
    """
    if isinstance(fn, CompiledFunction):  # its calls run their program: nothing would be left to export
        raise ExportError(
            f"st.export({fn.name}): {fn.name} is an st.compile'd function; calling it runs its program at once "
            "(a training step would change the weights), so nothing was run or exported. Export the function "
            f"it compiles, st.export({fn.name}.__wrapped__, ...): that traces the program st.compile runs. It "
            "must return its results without updating tensors in place (a forward pass, not an optimizer step)."
        )
    check_execution_allowed("st.export")
    run_cells(pending_cells())
    flat_args, in_tree = pytree.tree_flatten((example_args, example_kwargs))
    for i, a in enumerate(flat_args):
        if isinstance(a, torch.Tensor) and not isinstance(a, ShardedTensor):
            raise ExportError(
                f"st.export: argument {i} is a {a.device} tensor; pass ShardedTensors (st.shard(t, mesh, spec)) "
                "so the program knows each input's sharding"
            )
    with capture() as seen:
        out = fn(*example_args, **example_kwargs)
        out_flat, out_tree = pytree.tree_flatten(out)
        # a returned view, argument or parameter is not a node of its own: give it one
        out_flat = [_as_own_value(x) for x in out_flat]
    return _export_captured(seen, flat_args, in_tree, out_flat, out_tree)


@runtime.with_x64  # fn ran with the caller's JAX setting; lowering and exporting need 64-bit types
def _export_captured(seen, flat_args, in_tree, out_flat, out_tree) -> ExportedProgram:
    """The ExportedProgram of what an ``export`` call captured."""
    _check_no_side_effects(seen, out_flat)
    out_cells = [x._cell for x in out_flat if isinstance(x, ShardedTensor)]
    if not out_cells:
        raise ExportError("st.export: the function returns no tensor computed on the devices")
    # no on-device checks in an exported program: its outputs are exactly the function's, and the
    # runtime that loads it has nothing that would read them
    lowered = lower(out_cells, checks=False)
    program, arrays, scalars, leaf_cells = lowered.program, lowered.arrays, lowered.scalars, lowered.leaf_cells
    jitted = _with_output_shardings(lowered)
    arg_of_cell = {id(a._cell): i for i, a in enumerate(flat_args) if isinstance(a, ShardedTensor)}
    inputs, constants = [], []
    for k, (_array, cell) in enumerate(zip(arrays, leaf_cells)):
        if cell is not None and id(cell) in arg_of_cell and not flat_args[arg_of_cell[id(cell)]]._chain:
            inputs.append((k, arg_of_cell[id(cell)]))
        else:
            constants.append(k)
    exported = jax_export.export(jitted)(
        [],
        [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in arrays],
        {kind: jax.ShapeDtypeStruct(v.shape, v.dtype) for kind, v in scalars.items()},
    )
    meta = {
        "format": _FORMAT,
        "version": _VERSION,
        "mesh": _mesh_meta(program.mesh),
        "in_tree": pytree.treespec_dumps(in_tree),
        "out_tree": pytree.treespec_dumps(out_tree),
        "n_leaves": len(arrays),
        "inputs": [_input_meta(k, i, flat_args[i]) for k, i in inputs],
        "constants": constants,
        "outputs": [_output_meta(x) for x in out_flat],
        "scalar_kinds": sorted(scalars),
    }
    values = {f"leaf{k}": np.asarray(jax.device_get(arrays[k])) for k in constants}
    values.update({f"scalars_{kind}": v for kind, v in scalars.items()})
    return ExportedProgram(exported, meta, values)


MAX_SIZE = 2**30  # default bound on what st.deserialize inflates: 1 GiB
_MEMBERS = ("meta.json", "program.bin", "values.npz")


@runtime.with_x64
def deserialize(blob: bytes, *, max_size: int | None = MAX_SIZE) -> ExportedProgram:
    """Load what ``ExportedProgram.serialize()`` wrote; the result is callable like the function.

    The bytes may come from anywhere: an archive that declares or inflates to more than ``max_size``
    bytes in all (default 1 GiB; ``None``: no bound, for bytes you trust) is refused before it is
    inflated, and anything that is not a well-formed program (truncated or random bytes, missing
    members, wrong JSON, inconsistent values) raises ``ValueError``.

    Example::

        run = st.deserialize(open("model.stx", "rb").read())
        y = run(x)
        big = st.deserialize(blob, max_size=8 * 2**30)   # a program with 8 GiB of captured weights
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"st.deserialize takes bytes, got {type(blob).__name__}")
    if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1):
        raise ValueError(f"st.deserialize: max_size is a positive number of bytes or None, got {max_size!r}")
    budget = _Budget(max_size)
    try:
        members = _read_zip(bytes(blob), _MEMBERS, budget, "the archive")
        meta = json.loads(members["meta.json"])
    except _TooBig as e:
        raise ValueError(f"st.deserialize: {e}; pass max_size=... (bytes) if you trust these bytes") from None
    except MemoryError:
        raise
    except Exception as e:  # zipfile, zlib, json and utf-8 each raise their own
        raise ValueError(
            f"st.deserialize: these bytes are not a serialized st.export program ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
        what = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"st.deserialize: unsupported format {what!r}: not an st.export program of version {_VERSION}")
    try:
        values = _read_npz(members.pop("values.npz"), budget)
        exported = jax_export.deserialize(bytearray(members.pop("program.bin")))
        _check_meta(meta, values)
    except _TooBig as e:
        raise ValueError(f"st.deserialize: {e}; pass max_size=... (bytes) if you trust these bytes") from None
    except MemoryError:
        raise
    except Exception as e:  # numpy, jax's flatbuffers and the checks raise their own
        raise ValueError(f"st.deserialize: a malformed st.export program ({type(e).__name__}: {e})") from e
    return ExportedProgram(exported, meta, values)


class _TooBig(Exception):
    """An archive member would take the inflated total past ``max_size``."""


class _Budget:
    """How many more bytes may be inflated (None: no bound)."""

    def __init__(self, max_size):
        self.max_size, self.left = max_size, max_size

    def check(self, n: int, what: str) -> None:
        if self.left is not None and n > self.left:
            raise _TooBig(
                f"{what} declares {n} bytes, which would take what it inflates past max_size={self.max_size} bytes"
            )

    def take(self, n: int) -> None:
        if self.left is not None:
            self.left -= n


def _read_zip(data: bytes, names, budget: _Budget, where: str) -> dict:
    """The members ``names`` of the zip archive ``data``: their declared sizes are checked against the
    budget before anything is inflated, and each is read with a bound, so a header that lies about
    its size cannot inflate more."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        infos = {i.filename: i for i in z.infolist()}
        missing = [n for n in names if n not in infos]
        if missing:
            raise KeyError(f"{where} has no member {', '.join(missing)}")
        budget.check(sum(infos[n].file_size for n in names), where)
        out = {}
        for n in names:
            size = infos[n].file_size
            with z.open(infos[n]) as f:
                content = f.read(size + 1)  # at most one byte past what the header declares
            if len(content) != size:
                raise zipfile.BadZipFile(
                    f"{where}: member {n} holds {'more' if len(content) > size else 'less'} "
                    f"than the {size} bytes its header declares"
                )
            budget.take(size)
            out[n] = content
    return out


def _read_npz(data: bytes, budget: _Budget) -> dict:
    """The arrays of an ``np.savez`` archive, with the same bounds, and each ``.npy`` header checked
    against its data before numpy allocates the array it describes."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        names = [i.filename for i in z.infolist()]
    values = {}
    for name, content in _read_zip(data, names, budget, "values.npz").items():
        if not name.endswith(".npy"):
            raise ValueError(f"values.npz holds {name!r}, not a .npy array")
        f = io.BytesIO(content)
        version = np.lib.format.read_magic(f)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(
            version
        )
        if read_header is None:
            raise ValueError(f"values.npz: {name} has .npy version {version}, expected 1.0 or 2.0")
        shape, _, dtype = read_header(f)
        if dtype.hasobject or math.prod(shape) * dtype.itemsize != len(content) - f.tell():
            raise ValueError(
                f"values.npz: {name}'s header ({shape}, {dtype}) does not match its "
                f"{len(content) - f.tell()} bytes of data"
            )
        values[name.removesuffix(".npy")] = np.load(io.BytesIO(content), allow_pickle=False)
    return values


def _check_meta(meta: dict, values: dict) -> None:
    """Raise ValueError unless ``meta`` describes a program these values can run (what ``__call__``
    reads), so a malformed archive fails here and not at its first call."""

    def need(ok, what):
        if not ok:
            raise ValueError(f"meta.json: {what}")

    def ints(x):
        return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x)

    mesh = meta.get("mesh")
    need(
        isinstance(mesh, dict)
        and ints(mesh.get("device_ids"))
        and ints(mesh.get("shape"))
        and isinstance(mesh.get("axis_names"), list)
        and len(mesh["axis_names"]) == len(mesh["shape"])
        and math.prod(mesh["shape"]) == len(mesh["device_ids"]) > 0,
        "mesh is not a valid mesh",
    )
    for tree in ("in_tree", "out_tree"):
        need(isinstance(meta.get(tree), str), f"{tree} is not a tree description")
        pytree.treespec_loads(meta[tree])
    n = meta.get("n_leaves")
    need(isinstance(n, int) and not isinstance(n, bool) and n >= 0, "n_leaves is not a count")
    need(
        ints(meta.get("constants")) and all(k < n and f"leaf{k}" in values for k in meta["constants"]),
        "constants do not match the stored values",
    )
    need(isinstance(meta.get("inputs"), list) and isinstance(meta.get("outputs"), list), "inputs or outputs missing")
    for spec in meta["inputs"] + [o for o in meta["outputs"] if not (isinstance(o, dict) and "value" in o)]:
        need(
            isinstance(spec, dict)
            and ints(spec.get("shape"))
            and isinstance(spec.get("dtype"), str)
            and (spec.get("spec") is None or isinstance(spec["spec"], list)),
            f"bad tensor description {spec!r}",
        )
        _dtype(spec["dtype"])
    for spec in meta["inputs"]:
        need(ints([spec.get("leaf"), spec.get("arg")]) and spec["leaf"] < n, f"bad input {spec!r}")
    need(
        isinstance(meta.get("scalar_kinds"), list) and all(f"scalars_{k}" in values for k in meta["scalar_kinds"]),
        "scalars do not match the stored values",
    )


class ExportedProgram:
    """An exported program: ``mlir_text()``, ``serialize()``, and calling it runs it."""

    def __init__(self, exported: jax_export.Exported, meta: dict[str, Any], values: dict[str, np.ndarray]) -> None:
        self._exported, self._meta, self._values = exported, meta, values
        self._mesh: Mesh | None = None
        self._device_constants: list[jax.Array] | None = None

    def mlir_text(self) -> str:
        """The StableHLO module; inputs and results carry their sharding annotations."""
        return self._exported.mlir_module()

    def serialize(self) -> bytes:
        """Bytes that ``st.deserialize`` turns back into this program (in any process with the devices)."""
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("meta.json", json.dumps(self._meta))
            z.writestr("program.bin", bytes(self._exported.serialize()))
            values = io.BytesIO()
            np.savez(values, **self._values)  # type: ignore[arg-type]  # (numpy's stub: a key could be allow_pickle)
            z.writestr("values.npz", values.getvalue())
        return buf.getvalue()

    @property
    def mesh(self) -> Mesh:
        """The mesh the program runs on (rebuilt from its device ids when deserialized)."""
        if self._mesh is None:
            m = self._meta["mesh"]
            n = len(jax.devices())
            if max(m["device_ids"]) >= n:
                raise RuntimeError(
                    f"this program was exported for device ids {m['device_ids']}, but this process has {n} devices"
                )
            self._mesh = Mesh(m["device_ids"], tuple(m["shape"]), tuple(m["axis_names"]))
        return self._mesh

    @runtime.with_x64
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, tree = pytree.tree_flatten((args, kwargs))
        if pytree.treespec_dumps(tree) != self._meta["in_tree"]:
            raise TypeError("the arguments do not have the structure of the exported example arguments")
        run_cells(pending_cells())
        leaves = [None] * self._meta["n_leaves"]
        for k, array in zip(self._meta["constants"], self._constants()):
            leaves[k] = array
        for spec in self._meta["inputs"]:
            leaves[spec["leaf"]] = self._input_array(flat[spec["arg"]], spec)
        scalars = {kind: self._values[f"scalars_{kind}"] for kind in self._meta["scalar_kinds"]}
        outs = self._exported.call([], leaves, scalars)
        results, k = [], 0
        for spec in self._meta["outputs"]:
            if "value" in spec:  # a plain Python value the function returned
                results.append(spec["value"])
                continue
            results.append(_wrap_output(outs[k], spec, self.mesh))
            k += 1
        return pytree.tree_unflatten(results, pytree.treespec_loads(self._meta["out_tree"]))

    def _constants(self):
        """The captured values on the devices, uploaded once with the shardings they were exported with."""
        if self._device_constants is None:
            # flat over (donated=[], kept=leaves, scalar vectors): the leaves come first
            leaf_shardings = list(self._exported.in_shardings_jax(self.mesh.get_jax_mesh()))
            self._device_constants = [
                jax.device_put(self._values[f"leaf{k}"], leaf_shardings[k]) for k in self._meta["constants"]
            ]
        return self._device_constants

    def _input_array(self, value, spec):
        shape, dtype = tuple(spec["shape"]), _dtype(spec["dtype"])
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.dtype != dtype:
            got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(f"argument {spec['arg']}: expected a tensor of shape {shape} and dtype {dtype}, got {got}")
        mesh, part = self.mesh, tuple(spec["spec"]) if spec["spec"] is not None else None
        if isinstance(value, ShardedTensor):
            value = value.detach()
            if part is not None and (value._chain or value._cell.spec != part or value._cell.mesh != mesh):
                value = value.cpu()
        if not isinstance(value, ShardedTensor):
            cell = cell_from_host(
                torch_to_numpy(value.detach().contiguous()), mesh, part or (None,) * len(shape), dtype
            )
            return cell.value
        array = value._concrete_array()
        on_mesh = to_mesh(array, mesh.get_jax_mesh())
        if on_mesh is not array:  # keep the copy in the tensor's storage: the next call finds it there
            mesh_moves.keep_moved(value._cell, array, on_mesh, mesh.get_jax_mesh())
        return on_mesh


def _with_output_shardings(lowered):
    """The program jitted with every output's sharding explicit: the user's annotation where there is
    one, else the layout XLA's propagation chose (so the exported text states it)."""
    program = lowered.program
    chosen = program.make_executable().lower(*lowered.abstract_arguments()).compile().output_shardings
    program.outputs = [
        (code, pad, sharding if sharding is not None else chosen[i])
        for i, (code, pad, sharding) in enumerate(program.outputs)
    ]
    return program.make_executable()


def _as_own_value(x):
    if isinstance(x, ShardedTensor) and (x._chain or not x._cell.is_pending()):
        with torch.no_grad():
            return x.clone()
    return x


def _check_no_side_effects(seen, out_flat):
    returned = {id(x._cell) for x in out_flat if isinstance(x, ShardedTensor)}
    updated = [c for c in seen.updated() if id(c) not in returned]
    if updated:
        raise ExportError(
            f"st.export: the function updates {len(updated)} existing tensor(s) in place (for example an "
            "optimizer step, or BatchNorm running statistics in training mode). An exported program only "
            "returns values: call model.eval(), or return the updated tensors."
        )


def _mesh_meta(jax_mesh):
    return {
        "device_ids": [runtime.device_id(d) for d in np.asarray(jax_mesh.devices).reshape(-1)],
        "shape": [int(n) for n in jax_mesh.devices.shape],
        "axis_names": list(jax_mesh.axis_names),
    }


def _input_meta(leaf, arg, tensor):
    cell = tensor._cell
    spec = list(cell.spec) if cell.spec is not None else None
    return {"leaf": leaf, "arg": arg, "shape": list(tensor.shape), "dtype": _dtype_name(tensor.dtype), "spec": spec}


def _output_meta(x):
    if isinstance(x, ShardedTensor):
        spec = list(x._cell.spec) if x._cell.spec is not None else None
        return {"shape": list(x.shape), "dtype": _dtype_name(x.dtype), "spec": spec}
    if isinstance(x, (int, float, bool, str, type(None))):
        return {"value": x}
    raise ExportError(
        f"st.export: the function returns a {type(x).__name__}; exported programs return "
        "tensors on the devices and plain Python numbers or strings"
    )


def _wrap_output(array, spec, mesh):
    shape, dtype = tuple(spec["shape"]), _dtype(spec["dtype"])
    part = tuple(spec["spec"]) if spec["spec"] is not None else None
    # an annotated output is stored as (mesh, spec), padded where uneven, like any ShardedTensor
    sharding = ShardingSpec(mesh, part) if part else None
    return ShardedTensor(Cell(array, shape, dtype, sharding, owned=True))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"st.deserialize: unknown dtype {name!r}")
    return dtype
