"""Saving state dicts to files plain PyTorch and safetensors read: PyTorch/XLA's ``xr.save`` and
``xser`` (``torch_xla.utils.serialization``), and safetensors files written and read one tensor at a time.

- ``st.save(obj, path)``: every ShardedTensor of ``obj`` copied to CPU, then one ``torch.save``.
- ``save(obj, path)`` / ``load(path)`` here (``xser``): the structure in ``path``, each tensor in its own
  file under ``path + '.tensors/'``, copied to the host and written alone, so the extra host memory
  stays near the largest tensor instead of the whole state dict.
- ``st.save_file(state_dict, path)`` / ``st.load_file(path, device, specs)``: the safetensors format,
  one tensor on the host at a time; ``specs`` shards each tensor as it is loaded.

In a job of several processes every process must call a save (reading a sharded tensor back is a
collective); only process 0 writes unless ``master_only=False``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardtensor import runtime, trees
from shardtensor.annotate import shard
from shardtensor.mesh import Mesh
from shardtensor.tensor.device import device as shardtensor_device

__all__ = ["save", "load", "save_file", "load_file", "torch_save", "TensorReference"]


def _writes_here(master_only: bool) -> bool:
    return not master_only or runtime.process_index() == 0


def _to_host(value: Any) -> Any:
    """A CPU copy of a tensor on st.device() (detached, keeping requires_grad); other values as they are."""
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        cpu = value.detach().cpu()
        return cpu.requires_grad_(True) if value.requires_grad and cpu.is_floating_point() else cpu
    return value


def torch_save(obj: Any, path: str | os.PathLike, master_only: bool = True) -> None:
    """Save ``obj`` with ``torch.save`` after copying every tensor on ``st.device()`` to CPU
    (PyTorch/XLA's ``xr.save``; exported as ``st.save``). The file loads with
    ``torch.load(path, weights_only=True)``, without shardtensor.

    In a job of several processes every process must call it; only process 0 writes unless
    ``master_only=False`` (then give each process its own path).

    Example::

        st.save(model.state_dict(), "model.pt")
        model_cpu.load_state_dict(torch.load("model.pt", weights_only=True))
    """
    host = trees.map_leaves(_to_host, obj)
    if _writes_here(master_only):
        torch.save(host, path)


class TensorReference:
    """Where ``save`` put a tensor: ``<path>.tensors/tensor_<index>.pt``.

    (A plain class, not a dataclass: trees open dataclasses as containers.)
    """

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"TensorReference({self.index})"


def _tensors_dir(path: str | os.PathLike) -> str:
    return os.fspath(path) + ".tensors"


def save(obj: Any, path: str | os.PathLike, master_only: bool = True) -> None:
    """Save ``obj`` streaming its tensors (PyTorch/XLA's ``xser.save``): ``path`` holds the structure with a
    ``TensorReference`` for each tensor, and ``path + '.tensors/tensor_<i>.pt'`` each tensor, copied to the
    host and written one at a time, so the extra host memory stays near the largest tensor.

    Every process must call it in a job of several processes; only process 0 writes unless
    ``master_only=False``. Read it back with ``load``.

    Example::

        st.serialization.save(model.state_dict(), "ckpt.pt")
        model.load_state_dict(st.serialization.load("ckpt.pt"))
    """
    writes = _writes_here(master_only)
    directory = _tensors_dir(path)
    if writes:
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
    count = 0

    def write_one(value):
        nonlocal count
        if not isinstance(value, torch.Tensor):
            return value
        host = _to_host(value)  # (a collective for a sharded tensor: every process reads it)
        if writes:
            torch.save(host, os.path.join(directory, f"tensor_{count}.pt"))
        del host
        count += 1
        return TensorReference(count - 1)

    structure = trees.map_leaves(write_one, obj)
    if writes:
        torch.save(structure, path)


def load(path: str | os.PathLike) -> Any:
    """Load what ``save`` wrote: the same structure, with CPU tensors (as ``xser.load``).

    Example::

        state = st.serialization.load("ckpt.pt")
        model.load_state_dict(state)     # a sharded model keeps its shardings
    """
    with torch.serialization.safe_globals([TensorReference]):
        structure = torch.load(path, weights_only=True)
    directory = _tensors_dir(path)

    def read_one(value):
        if not isinstance(value, TensorReference):
            return value
        file = os.path.join(directory, f"tensor_{value.index}.pt")
        if not os.path.exists(file):
            raise FileNotFoundError(f"{file} is missing: {path} refers to tensor {value.index}, saved in that file")
        return torch.load(file, weights_only=True)

    return trees.map_leaves(read_one, structure)


# --- safetensors -------------------------------------------------------------------------------
# The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a
# JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}} padded
# with spaces to a multiple of 8, then the tensors' bytes back to back, in the header's order.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}


def save_file(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
    master_only: bool = True,
) -> None:
    """Write ``state_dict`` as a safetensors file, copying one tensor at a time to the host
    (``safetensors.torch.save_file`` copies all of them first). The file loads with
    ``safetensors.torch.load_file`` without shardtensor, or with ``load_file`` here. Unlike safetensors'
    ``save_file`` it does not refuse tensors that share storage: each name is written in full.

    Every process must call it in a job of several processes; only process 0 writes unless
    ``master_only=False``.

    Example::

        st.save_file(model.state_dict(), "model.safetensors")
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"save_file: {name!r} is a {type(tensor).__name__}, not a tensor (safetensors holds tensors only)"
            )
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"save_file: {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    if not _writes_here(master_only):
        for tensor in state_dict.values():
            _to_host(tensor)  # (reading a sharded tensor is a collective: every process takes part)
        return
    temporary = os.fspath(path) + ".partial"
    try:
        with open(temporary, "wb") as file:
            file.write(struct.pack("<Q", len(encoded)))
            file.write(encoded)
            for tensor in state_dict.values():
                host = _to_host(tensor).detach().contiguous()
                if host.numel():
                    file.write(host.reshape(-1).view(torch.uint8).numpy().data)
                del host
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise
    os.replace(temporary, path)  # a reader never sees a half-written file under the final name


Specs = Mapping[str, tuple[Mesh, Any]] | Callable[[str, torch.Tensor], "tuple[Mesh, Any] | None"]


def load_file(
    path: str | os.PathLike,
    device: torch.device | str | None = None,
    specs: Specs | None = None,
) -> dict[str, torch.Tensor]:
    """Read a safetensors file one tensor at a time onto ``device`` (default ``st.device()``).

    ``specs`` shards tensors as they arrive: a mapping from name to ``(mesh, partition_spec)``, or a
    callable ``(name, cpu_tensor) -> (mesh, partition_spec) | None``; tensors without one are replicated.
    ``device="cpu"`` returns plain CPU tensors (``specs`` must then be None).

    Example::

        mesh = st.get_1d_mesh("fsdp")
        rows = lambda name, t: (mesh, ("fsdp",) + (None,) * (t.dim() - 1)) if t.dim() else None
        sd = st.load_file("model.safetensors", specs=rows)   # dimension 0 of each tensor over 'fsdp'
    """
    from safetensors import safe_open  # (optional dependency: installed with transformers)

    target = shardtensor_device() if device is None else torch.device(device)
    if target.type == "cpu" and specs is not None:
        raise ValueError("load_file: specs shard tensors on st.device(); with device='cpu' pass specs=None")
    if target.type not in ("cpu", shardtensor_device().type):
        raise ValueError(f"load_file: device must be st.device() or 'cpu', got {target}")
    result: dict[str, torch.Tensor] = {}
    with safe_open(os.fspath(path), framework="pt") as opened:
        for name in opened.keys():  # noqa: SIM118  (safe_open is not a mapping)
            host = opened.get_tensor(name)
            if target.type == "cpu":
                result[name] = host
                continue
            placement = None
            if callable(specs):
                placement = specs(name, host)
            elif specs is not None:
                placement = specs.get(name)
            result[name] = host.to(target) if placement is None else shard(host, placement[0], placement[1])
            del host
    return result
