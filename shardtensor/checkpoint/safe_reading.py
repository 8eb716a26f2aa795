"""Reading a checkpoint without running its code: DCP's ``.metadata`` through an unpickler that knows
only DCP's metadata classes, non-tensor values with ``torch.load(weights_only=True)``, and each
stored item's bytes checked against the checksum ``st.checkpoint.save`` recorded.

DCP itself unpickles ``.metadata`` with ``pickle.load`` and non-tensor values with
``torch.load(weights_only=False)``: a checkpoint someone else wrote could run any code in either.
"""

from __future__ import annotations

import functools
import io
import json
import mmap
import os
import pathlib
import pickle
import re
import warnings
import zlib
from typing import IO, Any

import torch

from shardtensor.checkpoint.errors import CheckpointCorruptError

# next to .metadata: {"save_id": DCP's id of the save, "files": {relative path: [[offset, length, crc32], ...]}}
CHECKSUMS_NAME = ".checksums.json"

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_OTHER_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # (looks a layout up by its name)
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class UnsafeCheckpointError(CheckpointCorruptError):
    """A checkpoint holds something that only running its code could read (a pickled object of a
    class that is not plain data); shardtensor refuses to load it.

    Example::

        st.checkpoint.load(state, "ckpt")   # UnsafeCheckpointError: ckpt/.metadata refers to os.system ...
    """


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only DCP's metadata classes and plain values (the way the pickle
    documentation restricts globals): nothing else can be called while reading."""

    def __init__(self, file: IO[bytes], name: str) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        if module == _DCP_METADATA_MODULE or (module, name) in _OTHER_GLOBALS:
            found = getattr(__import__(module, fromlist=[name]), name, None)
            if module != _DCP_METADATA_MODULE or (isinstance(found, type) and found.__module__ == module):
                return found
        plain = torch.dtype | torch.layout | torch.memory_format
        if module == "torch" and isinstance(getattr(torch, name, None), plain):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.name} refers to {module}.{name}, which is not part of DCP's checkpoint metadata: "
            "loading it could run code, so nothing was loaded (was the checkpoint written by "
            "torch.distributed.checkpoint? Only load checkpoints you trust with plain dcp.load)"
        )


def read_metadata(stream: IO[bytes], name: str) -> Any:
    """DCP's ``Metadata`` from the pickle in ``stream`` (``name``: the file, for errors), built
    without running any code the file names."""
    return _MetadataUnpickler(stream, name).load()


def decode_value(fqn: str, stored: io.BytesIO) -> Any:
    """A non-tensor state-dict value DCP stored (``torch.save`` bytes), read with
    ``weights_only=True``: plain values (numbers, strings, lists, dicts, tensors...) only."""
    try:
        return torch.load(stored, weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"the checkpoint's value of {fqn!r} is not plain data (torch.load with weights_only=True "
            f"refuses it: {_first_line(error)}); loading it could run code, so nothing was loaded"
        ) from error


def check_value_savable(fqn: str, value: Any) -> None:
    """Raise if ``value`` (a non-tensor state-dict entry) would not load back without running code."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception as error:
        raise TypeError(
            f"st.checkpoint.save: {fqn!r} (a {type(value).__name__}) cannot be saved: {type(error).__name__}: {error}"
        ) from error
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as error:
        raise TypeError(
            f"st.checkpoint.save: {fqn!r} is a {type(value).__name__}, which a load could read back only by "
            f"running code ({_first_line(error)}). Save plain values (numbers, strings, lists, dicts, "
            "tensors), e.g. its state_dict()"
        ) from error


def _first_line(error: BaseException) -> str:
    """What torch's weights_only unpickler refused, in a few words."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    if found:
        return f"it refers to {found.group(1)}"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def record_checksums(checkpoint_id: str | os.PathLike) -> None:
    """Write ``CHECKSUMS_NAME`` into a complete checkpoint: the crc32 of each stored item's bytes."""
    import fsspec  # type: ignore[import-untyped]  # (a dependency of torch)

    fs, root = fsspec.core.url_to_fs(os.fspath(checkpoint_id))
    with fs.open(f"{root}/.metadata", "rb") as f:
        metadata = read_metadata(f, f"{checkpoint_id}/.metadata")
    by_file: dict[str, list] = {}
    for info in metadata.storage_data.values():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length))
    local = "://" not in os.fspath(checkpoint_id)
    checksums: dict[str, list] = {}
    for relative_path, items in sorted(by_file.items()):
        with fs.open(f"{root}/{relative_path}", "rb") as f:
            # (a local file is mapped, not copied)
            whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if local and _size(f) else None
            try:
                for offset, length in sorted(items):
                    if whole is not None:
                        crc = zlib.crc32(memoryview(whole)[offset : offset + length])
                    else:
                        f.seek(offset)
                        crc = zlib.crc32(f.read(length))
                    checksums.setdefault(relative_path, []).append([offset, length, crc])
            finally:
                if whole is not None:
                    whole.close()
    recorded = {"save_id": _save_id(metadata), "files": checksums}
    fs.pipe_file(f"{root}/{CHECKSUMS_NAME}", json.dumps(recorded).encode())


def _save_id(metadata: Any) -> str | None:
    """DCP's id of the save that wrote ``metadata`` (a later ``dcp.save`` into the same directory has
    another one: the checksums are then not its own)."""
    return getattr(getattr(metadata, "storage_meta", None), "save_id", None)


def _size(file: Any) -> int:
    file.seek(0, os.SEEK_END)
    return file.tell()


def _parsed_checksums(data: bytes, name: str) -> dict:
    try:
        recorded = json.loads(data)
        files = {str(k): [(int(o), int(n), int(c)) for o, n, c in v] for k, v in recorded["files"].items()}
        return {"save_id": recorded.get("save_id"), "files": files}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointCorruptError(f"{name} cannot be read ({type(error).__name__}: {error})") from error


def _reader_methods(base: type) -> type:
    class SafeReader(base):
        """DCP's reader of ``base``'s storage, reading the metadata without running code and
        checking each item against the checksums recorded at save (if there are any)."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = read_metadata(stream, os.fspath(path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            self._names = {(i.relative_path, i.offset): index for index, i in metadata.storage_data.items()}
            self._checksums: dict[tuple[str, int], tuple[int, int]] | None = None
            path = self.fs.concat_path(self.path, CHECKSUMS_NAME)
            if self.fs.exists(path):
                with self.fs.create_stream(path, "rb") as stream:
                    recorded = _parsed_checksums(stream.read(), os.fspath(path))
                if recorded["save_id"] != _save_id(metadata):
                    warnings.warn(
                        f"{os.fspath(path)} belongs to another save than the checkpoint's metadata (dcp.save wrote "
                        "into the directory since): its items are loaded without checking their checksums",
                        stacklevel=2,
                    )
                    return
                self._checksums = {
                    (name, offset): (length, crc)
                    for name, items in recorded["files"].items()
                    for offset, length, crc in items
                }

        def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
            if self._checksums is None:
                return super()._slice_file(file, sinfo)
            data = super()._slice_file(file, sinfo).read(sinfo.length)
            expected = self._checksums.get((sinfo.relative_path, sinfo.offset))
            if expected is None or expected[0] != sinfo.length or zlib.crc32(data) != expected[1]:
                index = self._names.get((sinfo.relative_path, sinfo.offset))
                what = f"{index.fqn!r}" if index is not None else "an item"
                if index is not None and index.offset is not None and any(index.offset):
                    what += f" (its shard at offsets {tuple(index.offset)})"
                file_path = self.fs.concat_path(self.path, sinfo.relative_path)
                raise CheckpointCorruptError(
                    f"{os.fspath(file_path)!r}: the bytes of {what} do not match the checksum recorded when "
                    "the checkpoint was saved (the file is damaged, or comes from another checkpoint); "
                    "nothing was loaded. Load an older checkpoint"
                )
            return io.BytesIO(data)

    SafeReader.__name__ = SafeReader.__qualname__ = f"Safe{base.__name__}"
    return SafeReader


@functools.cache
def _reader_class(url: bool) -> type:
    if url:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return _reader_methods(FsspecReader)
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return _reader_methods(FileSystemReader)


def safe_reader(checkpoint_id: str | os.PathLike) -> Any:
    """A DCP storage reader of ``checkpoint_id`` (a local path or an fsspec URL) that runs no code
    the checkpoint holds and checks the recorded checksums."""
    url = "://" in os.fspath(checkpoint_id)
    return _reader_class(url)(os.fspath(checkpoint_id) if url else pathlib.Path(checkpoint_id))
