"""Saving state dicts to files plain PyTorch and safetensors read: PyTorch/XLA's ``xr.save`` and
``xser`` (``torch_xla.utils.serialization``), and safetensors files written and read one tensor at a time.

- ``st.save(obj, path)``: every ShardedTensor of ``obj`` copied to CPU, then one ``torch.save``.
- ``save(obj, path)`` / ``load(path)`` here (``xser``): the structure in ``path``, each tensor in its own
  file under ``path + '.tensors/<save id>/'``, copied to the host and written alone, so the extra host
  memory stays near the largest tensor instead of the whole state dict.
- ``st.save_file(state_dict, path)`` / ``st.load_file(path, device, specs)``: the safetensors format,
  one tensor on the host at a time; ``specs`` shards each tensor as it is loaded.

In a job of several processes every process must call a save (reading a sharded tensor back is a
collective); only process 0 writes unless ``master_only=False``.

Every save is atomic: it writes under a temporary name in the same folder, flushes it to disk and
renames it into place, so a process killed while saving leaves the previous file at ``path`` whole.
Loading never runs code the files hold (``torch.load(weights_only=True)``, safetensors).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import pickle
import re
import shutil
import struct
import uuid
import zlib
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
    ``master_only=False`` (then give each process its own path). A path is replaced atomically: a
    process killed while saving leaves the previous file there (``path`` may also be a file object).

    Example::

        st.save(model.state_dict(), "model.pt")
        model_cpu.load_state_dict(torch.load("model.pt", weights_only=True))
    """
    host = trees.map_leaves(_to_host, obj)
    if not _writes_here(master_only):
        return
    if isinstance(path, str | os.PathLike):
        _write_atomically(path, lambda file: torch.save(host, file))
    else:
        torch.save(host, path)


def _write_atomically(path: str | os.PathLike, write: Callable[[Any], None]) -> None:
    """``write(file)`` into a temporary file next to ``path``, flushed to disk, then renamed to
    ``path``: a reader, or a process killed half-way, sees the old file or the new one, never a part."""
    from shardtensor.checkpoint.atomic import leftovers, owner_tag

    path = os.fspath(path)
    folder, name = os.path.split(path)
    temporary = os.path.join(folder, f".{name}.tmp-{owner_tag()}")
    for stale in leftovers(pathlib.Path(path), "tmp"):  # (of saves that were killed)
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise
    _sync_folder(folder or ".")


def _sync_folder(folder: str) -> None:
    """Flush a folder's entries (a rename) to disk, where the platform can."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # (a platform without directory handles)
    try:
        with contextlib.suppress(OSError):
            os.fsync(descriptor)
    finally:
        os.close(descriptor)


class TensorReference:
    """Where ``save`` put a tensor: ``<path>.tensors/<save_id>/tensor_<index>.pt`` (files of earlier
    versions: ``<path>.tensors/tensor_<index>.pt``), with its shape, dtype and the crc32 of its bytes,
    which ``load`` checks.

    (A plain class, not a dataclass: trees open dataclasses as containers.)

    Example::

        TensorReference(0, "3f2a...", (4, 8), torch.float32, 123456789)
    """

    save_id: str | None = None  # (class defaults: references of earlier versions have none)
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    crc32: int | None = None

    def __init__(
        self,
        index: int,
        save_id: str | None = None,
        shape: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
        crc32: int | None = None,
    ) -> None:
        self.index = index
        self.save_id, self.shape, self.dtype, self.crc32 = save_id, shape, dtype, crc32

    def __repr__(self) -> str:
        return f"TensorReference({self.index})"


def _crc32(tensor: torch.Tensor) -> int | None:
    """The crc32 of a dense CPU tensor's bytes (None for a layout without plain bytes)."""
    if tensor.layout != torch.strided or tensor.is_quantized:
        return None
    data = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return zlib.crc32(data.view(torch.uint8).numpy().data) if data.numel() else 0


def _tensors_dir(path: str | os.PathLike) -> str:
    return os.fspath(path) + ".tensors"


def save(obj: Any, path: str | os.PathLike, master_only: bool = True) -> None:
    """Save ``obj`` streaming its tensors (PyTorch/XLA's ``xser.save``): ``path`` holds the structure with a
    ``TensorReference`` for each tensor, and ``path + '.tensors/tensor_<i>.pt'`` each tensor, copied to the
    host and written one at a time, so the extra host memory stays near the largest tensor.

    Every process must call it in a job of several processes; only process 0 writes unless
    ``master_only=False``. Read it back with ``load``.

    Each save writes its tensors into a new folder, ``path + '.tensors/<save id>/'``, and then the
    structure (naming that folder) atomically in place of ``path``; the previous save's folder is
    removed only then. A process killed at any point leaves ``path`` loadable: the previous save, or
    this one.

    Example::

        st.serialization.save(model.state_dict(), "ckpt.pt")
        model.load_state_dict(st.serialization.load("ckpt.pt"))
    """
    writes = _writes_here(master_only)
    save_id = uuid.uuid4().hex
    directory = os.path.join(_tensors_dir(path), save_id)
    if writes:
        os.makedirs(directory)
    count = 0

    def write_one(value):
        nonlocal count
        if not isinstance(value, torch.Tensor):
            return value
        host = _to_host(value)  # (a collective for a sharded tensor: every process reads it)
        reference = TensorReference(count, save_id, tuple(host.shape), host.dtype, _crc32(host))
        if writes:
            with open(os.path.join(directory, f"tensor_{count}.pt"), "wb") as file:
                torch.save(host, file)
                file.flush()
                os.fsync(file.fileno())
        del host
        count += 1
        return reference

    structure = trees.map_leaves(write_one, obj)
    if not writes:
        return
    _sync_folder(directory)
    _write_atomically(path, lambda file: torch.save(structure, file))
    for entry in os.listdir(_tensors_dir(path)):  # the earlier saves' tensors (and those of killed ones)
        if entry != save_id:
            stale = os.path.join(_tensors_dir(path), entry)
            if os.path.isdir(stale):
                shutil.rmtree(stale, ignore_errors=True)
            else:
                os.remove(stale)


def load(path: str | os.PathLike) -> Any:
    """Load what ``save`` wrote: the same structure, with CPU tensors (as ``xser.load``).

    Example::

        state = st.serialization.load("ckpt.pt")
        model.load_state_dict(state)     # a sharded model keeps its shardings
    """
    structure = _load_plain(path, [TensorReference])

    def read_one(value):
        if not isinstance(value, TensorReference):
            return value
        folder = _tensors_dir(path) if value.save_id is None else os.path.join(_tensors_dir(path), value.save_id)
        file = os.path.join(folder, f"tensor_{value.index}.pt")
        if not os.path.exists(file):
            raise FileNotFoundError(f"{file} is missing: {path} refers to tensor {value.index}, saved in that file")
        tensor = _load_plain(file, [])
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{file} holds a {type(tensor).__name__}, not the tensor {path} refers to")
        _check_reference(tensor, value, file, path)
        return tensor

    return trees.map_leaves(read_one, structure)


def _load_plain(file: str | os.PathLike, classes: list) -> Any:
    """``torch.load(file, weights_only=True)`` (plain data and ``classes``), naming the file if it refuses."""
    try:
        with torch.serialization.safe_globals(classes):
            return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        detail = f"it refers to {found.group(1)}" if found else str(error)
        raise pickle.UnpicklingError(
            f"{os.fspath(file)} holds objects that only running their code could load ({detail}); "
            "st.serialization.load reads plain data and tensors only, so nothing was loaded"
        ) from error


def _check_reference(tensor: torch.Tensor, reference: TensorReference, file: str, path: str | os.PathLike) -> None:
    """The tensor read from ``file`` is the one the structure recorded (same shape, dtype and bytes)."""
    recorded = (reference.shape, reference.dtype)
    if reference.shape is not None and recorded != (tuple(tensor.shape), tensor.dtype):
        problem = f"holds shape {tuple(tensor.shape)} {tensor.dtype}, not {reference.shape} {reference.dtype}"
    elif reference.crc32 is not None and _crc32(tensor) != reference.crc32:
        problem = "holds other bytes than were saved (its checksum differs)"
    else:
        return
    raise ValueError(
        f"{file} {problem}, as {os.fspath(path)} records for tensor {reference.index}: the file was damaged "
        "or replaced by another (a swapped file?); nothing was loaded. Save again"
    )


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

    def write(file) -> None:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for tensor in state_dict.values():
            host = _to_host(tensor).detach().contiguous()
            if host.numel():
                file.write(host.reshape(-1).view(torch.uint8).numpy().data)
            del host

    _write_atomically(path, write)  # a reader never sees a half-written file under the final name


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
        if isinstance(specs, Mapping):
            unknown = [name for name in specs if name not in opened.keys()]  # noqa: SIM118
            if unknown:
                raise ValueError(
                    f"load_file: specs names {unknown}, which {os.fspath(path)} does not hold; its tensors are "
                    f"{list(opened.keys())}"
                )
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
