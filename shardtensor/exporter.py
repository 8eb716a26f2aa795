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
import zipfile

import jax
import numpy as np
import torch
from jax import export as jax_export
from torch.utils import _pytree as pytree

from shardtensor import runtime
from shardtensor.dtypes import torch_to_numpy
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


def export(fn, *example_args, **example_kwargs) -> "ExportedProgram":
    """Trace ``fn(*example_args, **example_kwargs)`` into one program with its shardings.

    Tensor arguments must be ShardedTensors (their sharding is the input sharding of the program);
    ``fn`` must return its results rather than update existing tensors in place.

    Example::

        exported = st.export(lambda a, b: a @ b, st.shard(a, mesh, ("x", None)), b_sharded)
        exported.mlir_text(); blob = exported.serialize()
    """
    check_execution_allowed("st.export")
    run_cells(pending_cells())
    flat_args, in_tree = pytree.tree_flatten((example_args, example_kwargs))
    for i, a in enumerate(flat_args):
        if isinstance(a, torch.Tensor) and not isinstance(a, ShardedTensor):
            raise ExportError(
                f"st.export: argument {i} is a {a.device} tensor; pass ShardedTensors (st.shard(t, mesh, spec)) "
                "so the program knows each input's sharding")
    with capture() as seen:
        out = fn(*example_args, **example_kwargs)
        out_flat, out_tree = pytree.tree_flatten(out)
        # a returned view, argument or parameter is not a node of its own: give it one
        out_flat = [_as_own_value(x) for x in out_flat]
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
    for k, (array, cell) in enumerate(zip(arrays, leaf_cells)):
        if cell is not None and id(cell) in arg_of_cell and not flat_args[arg_of_cell[id(cell)]]._chain:
            inputs.append((k, arg_of_cell[id(cell)]))
        else:
            constants.append(k)
    exported = jax_export.export(jitted)(
        [], [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in arrays],
        {kind: jax.ShapeDtypeStruct(v.shape, v.dtype) for kind, v in scalars.items()})
    meta = {
        "format": _FORMAT, "version": _VERSION,
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


def deserialize(blob: bytes) -> "ExportedProgram":
    """Load what ``ExportedProgram.serialize()`` wrote; the result is callable like the function.

    Example::

        run = st.deserialize(open("model.stx", "rb").read())
        y = run(x)
    """
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            meta = json.loads(z.read("meta.json"))
            exported = jax_export.deserialize(bytearray(z.read("program.bin")))
            with z.open("values.npz") as f:
                npz = np.load(io.BytesIO(f.read()), allow_pickle=False)
                values = {k: npz[k] for k in npz.files}
    except (zipfile.BadZipFile, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"st.deserialize: these bytes are not a serialized st.export program ({e})") from e
    if meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
        raise ValueError(f"st.deserialize: unsupported format {meta.get('format')!r} version {meta.get('version')!r}")
    return ExportedProgram(exported, meta, values)


class ExportedProgram:
    """An exported program: ``mlir_text()``, ``serialize()``, and calling it runs it."""

    def __init__(self, exported, meta, values):
        self._exported, self._meta, self._values = exported, meta, values
        self._mesh = None
        self._device_constants = None

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
            np.savez(values, **self._values)
            z.writestr("values.npz", values.getvalue())
        return buf.getvalue()

    @property
    def mesh(self) -> Mesh:
        """The mesh the program runs on (rebuilt from its device ids when deserialized)."""
        if self._mesh is None:
            m = self._meta["mesh"]
            n = len(jax.devices())
            if max(m["device_ids"]) >= n:
                raise RuntimeError(f"this program was exported for device ids {m['device_ids']}, "
                                   f"but this process has {n} devices")
            self._mesh = Mesh(m["device_ids"], tuple(m["shape"]), tuple(m["axis_names"]))
        return self._mesh

    def __call__(self, *args, **kwargs):
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
            self._device_constants = [jax.device_put(self._values[f"leaf{k}"], leaf_shardings[k])
                                      for k in self._meta["constants"]]
        return self._device_constants

    def _input_array(self, value, spec):
        shape, dtype = tuple(spec["shape"]), _dtype(spec["dtype"])
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.dtype != dtype:
            got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(f"argument {spec['arg']}: expected a tensor of shape {shape} and dtype {dtype}, "
                            f"got {got}")
        mesh, part = self.mesh, tuple(spec["spec"]) if spec["spec"] is not None else None
        if isinstance(value, ShardedTensor):
            value = value.detach()
            if part is not None and (value._chain or value._cell.spec != part or value._cell.mesh != mesh):
                value = value.cpu()
        if not isinstance(value, ShardedTensor):
            cell = cell_from_host(torch_to_numpy(value.detach().contiguous()), mesh, part or (None,) * len(shape),
                                  dtype)
            return cell.value
        array = value._concrete_array()
        return to_mesh(array, mesh.get_jax_mesh())


def _with_output_shardings(lowered):
    """The program jitted with every output's sharding explicit: the user's annotation where there is
    one, else the layout XLA's propagation chose (so the exported text states it)."""
    program = lowered.program
    chosen = program.make_executable().lower(*lowered.abstract_arguments()).compile().output_shardings
    program.outputs = [(code, pad, sharding if sharding is not None else chosen[i])
                       for i, (code, pad, sharding) in enumerate(program.outputs)]
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
            "returns values: call model.eval(), or return the updated tensors.")


def _mesh_meta(jax_mesh):
    return {"device_ids": [runtime.device_id(d) for d in np.asarray(jax_mesh.devices).reshape(-1)],
            "shape": [int(n) for n in jax_mesh.devices.shape], "axis_names": list(jax_mesh.axis_names)}


def _input_meta(leaf, arg, tensor):
    cell = tensor._cell
    spec = list(cell.spec) if cell.spec is not None else None
    return {"leaf": leaf, "arg": arg, "shape": list(tensor.shape), "dtype": _dtype_name(tensor.dtype),
            "spec": spec}


def _output_meta(x):
    if isinstance(x, ShardedTensor):
        spec = list(x._cell.spec) if x._cell.spec is not None else None
        return {"shape": list(x.shape), "dtype": _dtype_name(x.dtype), "spec": spec}
    if isinstance(x, (int, float, bool, str, type(None))):
        return {"value": x}
    raise ExportError(f"st.export: the function returns a {type(x).__name__}; exported programs return "
                      "tensors on the devices and plain Python numbers or strings")


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
