"""shardtensor's own persistent program cache: a warm start runs no tracing, lowering or XLA.

With ``st.initialize_cache(path)`` each program compiled for a graph is also kept under
``path/shardtensor-programs/``, named by ``program_key.digest`` of its key. A later process that
builds a graph of the same key loads the executable from there (JAX's executable deserialization)
and calls it at once: the jaxpr trace, the StableHLO lowering and JAX's own cache lookup (which
must lower first to compute its key) are all skipped. Turn it off with
``SHARDTENSOR_PROGRAM_CACHE=0`` (JAX's cache alone then serves the compilations).

One entry is one file: a magic line, the length of a JSON header, the header, the serialized
executable and a SHA-256 of header and executable. The header holds what calling the executable
needs (input and output shapes, dtypes and shardings, the inputs XLA kept, the devices) and what
tracing the program would have told the graph layer (the outputs that forward an input, the
on-device checks). Nothing is unpickled: a file written by someone else is parsed as JSON and its
executable is loaded by XLA. (An executable is machine code: the cache directory must be as trusted
as JAX's own cache.) An entry that cannot be read back (truncated, corrupted, of another version)
is reported once, removed, and the program compiled again; entries are written to a temporary file
and renamed into place, so concurrent writers never leave a partial one.

Counters: ``PersistentProgramHit`` (also counted as ``PersistentCacheHit``), ``PersistentProgramMiss``,
``PersistentProgramStored``, ``PersistentProgramUnusable`` (an entry refused) and
``PersistentProgramSkipped`` (a program whose key has no meaning in another process: compiled and
kept in memory only).
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import os
import struct
import tempfile
import threading
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shardtensor import metrics as counters
from shardtensor.graph import memory, program_key
from shardtensor.ops.checks import Check
from shardtensor.runtime.compilation_cache import compiling_afresh, program_cache

MAGIC = b"SHARDTENSOR-PROGRAM\n"
SUFFIX = ".program"
_LENGTH = struct.Struct("<Q")
_SHA = 32


class _Refused(Exception):
    """This program (or entry) cannot go through the store; the message says why."""


class StoredExecutable:
    """A program's executable loaded from the store: called like the jitted replay it replaces.

    Example::

        outs = fn(donated, kept, vectors)   # as the jitted function would be called
    """

    __slots__ = ("_compiled", "program", "memory", "early_rows")  # (early_rows: graph.early_rows's)

    def __init__(self, compiled, program, analysis):
        self._compiled, self.program, self.memory = compiled, program, analysis

    def __call__(self, *args):
        return self._compiled(*args)

    def lower(self, *args):
        """Lower the program again (nothing was traced when it was loaded): ``jax.jit``'s ``lower``."""
        return self.program.make_executable().lower(*args)


class Entry:
    """The store's place for one program (``entry_for``): ``load`` it, or ``save`` it once compiled."""

    def __init__(self, directory: str, readonly: bool, digest: str, program):
        self.directory, self.readonly, self.digest, self.program = directory, readonly, digest, program
        self.path = os.path.join(directory, digest + SUFFIX)

    def load(self, call_arguments) -> StoredExecutable | None:
        """The stored executable, ready to call with ``call_arguments`` (donated, kept, vectors);
        None when there is no usable entry."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            counters.increment("PersistentProgramMiss")
            return None
        except OSError as e:
            self._refuse(e)
            return None
        try:
            header, executable = _parse(data, self.digest)
            loaded = _rebuild(header, executable, self.program, call_arguments)
        except Exception as e:  # noqa: BLE001 — a bad entry of any kind is a miss, said once
            self._refuse(e)
            return None
        counters.increment("PersistentProgramHit")
        counters.increment("PersistentCacheHit")  # (a program served from the persistent cache)
        return loaded

    @contextlib.contextmanager
    def compiling(self):
        """Around the program's compilation: XLA compiles it here (JAX's cache is not read, see
        ``compiling_afresh``), and ``save`` stores it only if it saw that compilation happen."""
        if self.readonly:
            yield
            return
        before = (_SEEN.compiled, _SEEN.loaded)
        with compiling_afresh():
            yield
        self._fresh = _SEEN.compiled > before[0] and _SEEN.loaded == before[1]

    _fresh = False

    def save(self, compiled) -> None:
        """Write the compiled program (``jax.stages.Compiled`` of the program's replay) to the store."""
        if self.readonly:
            return
        if not self._fresh:  # (not compiled here, e.g. a copy JAX kept in memory: it may not serialize whole)
            counters.increment("PersistentProgramSkipped")
            return
        try:
            header, executable = _describe(compiled, self.program)
        except Exception as e:  # noqa: BLE001 — _Refused, or JAX's internals not as expected: not stored
            counters.increment("PersistentProgramSkipped")
            program_key._LAST_REASON[0] = f"{type(e).__name__}: {e}"
            return
        header["digest"] = self.digest
        body = json.dumps(header, sort_keys=True).encode()
        payload = MAGIC + _LENGTH.pack(len(body)) + body + executable
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=self.directory, prefix=".writing-", suffix=SUFFIX)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(payload + hashlib.sha256(payload).digest())
                os.chmod(temporary, 0o644)
                os.replace(temporary, self.path)  # atomic: readers see the old entry or the new one
            except BaseException:
                os.unlink(temporary)
                raise
        except OSError as e:
            warnings.warn(
                f"shardtensor could not write the program cache entry {self.path} ({type(e).__name__}: {e}); "
                "the program stays compiled in this process only.",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        counters.increment("PersistentProgramStored")

    def _refuse(self, error) -> None:
        counters.increment("PersistentProgramUnusable")
        removed = False
        if not self.readonly:
            try:
                os.remove(self.path)
                removed = True
            except OSError:
                pass
        warnings.warn(
            f"The shardtensor program cache entry {self.path} cannot be loaded ({type(error).__name__}: {error}); "
            "the program is compiled again" + (" and the entry replaced." if removed else "."),
            RuntimeWarning,
            stacklevel=3,
        )


def entry_for(program) -> Entry | None:
    """The store's entry for ``program``, or None when the store is off (no ``initialize_cache``,
    ``SHARDTENSOR_PROGRAM_CACHE=0``) or the program's key has no meaning in another process.

    Example::

        entry = entry_for(program)
        fn = entry.load(arguments) if entry else None
    """
    where = program_cache()
    if where is None or jax.process_count() > 1:  # (a job of several processes: JAX's cache alone)
        return None
    try:
        digest = program_key.digest(program.key)
    except Exception as e:  # noqa: BLE001 — the cache must never fail a program: compiled as usual
        program_key._LAST_REASON[0] = f"{type(e).__name__}: {e}"
        digest = None
    if digest is None:
        counters.increment("PersistentProgramSkipped")
        return None
    return Entry(where[0], where[1], digest, program)


class _Compilations(threading.local):
    """This thread's XLA compilations and JAX persistent-cache loads, from JAX's monitoring events."""

    compiled = 0
    loaded = 0


_SEEN = _Compilations()


def _on_event(event: str, **_: str | int) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _SEEN.loaded += 1


def _on_duration(event: str, duration_secs: float, **_: str | int) -> None:
    if event == "/jax/core/compile/backend_compile_duration":  # (a compilation, or a JAX cache load)
        _SEEN.compiled += 1


jax.monitoring.register_event_listener(_on_event)
jax.monitoring.register_event_duration_secs_listener(_on_duration)


# --------------------------------------------------------------------------- the file


def _parse(data: bytes, digest: str):
    """(header, executable bytes) of an entry, after checking its framing and checksum."""
    if not data.startswith(MAGIC):
        raise ValueError("not a shardtensor program entry")
    if len(data) < len(MAGIC) + _LENGTH.size + _SHA:
        raise ValueError("truncated")
    body, checksum = data[:-_SHA], data[-_SHA:]
    if hashlib.sha256(body).digest() != checksum:
        raise ValueError("the checksum does not match: truncated or corrupted")
    (length,) = _LENGTH.unpack_from(body, len(MAGIC))
    start = len(MAGIC) + _LENGTH.size
    if start + length > len(body):
        raise ValueError("truncated header")
    header = json.loads(body[start : start + length].decode())
    if not isinstance(header, dict) or header.get("digest") != digest:
        raise ValueError("the entry belongs to another program")
    if header.get("versions") != _versions():
        raise ValueError(f"written by other versions ({header.get('versions')}), not {_versions()}")
    executable = body[start + length :]
    if len(executable) != header.get("executable_bytes"):
        raise ValueError("the executable's size does not match its header")
    return header, executable


def _versions() -> dict:
    import jaxlib
    import torch

    return {
        "format": program_key.FORMAT,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "torch": torch.__version__,
        "shardtensor": program_key._source_digest()[:16],
    }


# --------------------------------------------------------------------------- describing a compiled program


def _describe(compiled, program):
    """(JSON header, executable bytes) of a compiled replay; ``_Refused`` when it cannot be stored
    faithfully (every part of the header is read back here and compared with the original)."""
    from jax._src.interpreters import pxla

    executable = getattr(compiled, "_executable", None)
    unloaded = getattr(executable, "_unloaded_executable", None)
    if not isinstance(unloaded, pxla.UnloadedMeshExecutable):
        raise _Refused("not a mesh executable")
    if (
        unloaded.unordered_effects
        or unloaded.ordered_effects
        or unloaded.host_callbacks
        or unloaded.keepalive
        or unloaded.mut is not None
        or compiled._params.const_args
    ):
        raise _Refused("the program has effects, host callbacks or constants")
    mesh = program.mesh
    in_avals, out_avals = list(unloaded.input_avals), list(unloaded.output_avals)
    header: dict[str, Any] = {
        "versions": _versions(),
        "name": str(unloaded.name),
        "devices": [int(d.id) for d in unloaded.device_list],
        "committed": bool(unloaded.committed),
        "kept": sorted(int(i) for i in unloaded.kept_var_idx),
        "in": [_aval_json(a, mesh) for a in in_avals],
        "in_shardings": [_sharding_json(s, mesh) for s in unloaded.input_shardings],
        "out": [_aval_json(a, mesh) for a in out_avals],
        "out_shardings": [_sharding_json(s, mesh) for s in unloaded.output_shardings],
        "args": [[_aval_json(info._aval, mesh), bool(info.donated)] for info in jax.tree.leaves(compiled.args_info)],
        "rows": _rows_kind(compiled.out_tree, len(program.outputs), program.checks),
        "forwarded": sorted(program.forwarded),
        "forwarded_leaves": sorted(program.forwarded_leaves),
        "tainted": sorted(program.tainted),
        "restored": sorted(program.restored),
        "checks": [_check_json(c) for c in program.check_table],
    }
    # everything is read back as a load would, and must equal what JAX built
    if [_aval(a, mesh) for a in header["in"]] != in_avals or [_aval(a, mesh) for a in header["out"]] != out_avals:
        raise _Refused("an input or output type does not survive the round trip")
    if [_sharding(s, mesh) for s in header["in_shardings"]] != list(unloaded.input_shardings) or [
        _sharding(s, mesh) for s in header["out_shardings"]
    ] != list(unloaded.output_shardings):
        raise _Refused("a sharding does not survive the round trip")
    layouts = pxla._get_layouts_from_executable(
        unloaded.xla_executable, [None] * len(in_avals), [None] * len(out_avals), 0, in_avals, out_avals
    )
    if list(layouts[0]) != list(unloaded.xla_in_layouts) or list(layouts[1]) != list(unloaded.xla_out_layouts):
        raise _Refused("the program has non-default layouts")
    if any(layout is not None for layout in unloaded.dispatch_in_layouts):
        raise _Refused("the program has non-default input layouts")
    data = unloaded.xla_executable.client.serialize_executable(unloaded.xla_executable)
    header["executable_bytes"] = len(data)
    return header, bytes(data)


def _rows_kind(out_tree, n_outputs: int, checks: bool) -> str:
    """How the results are nested: "plain" (a list), "rows" ((list, check rows)), "none" ((list, None))."""
    for kind in ("plain", "rows", "none"):
        if _out_tree(kind, n_outputs) == out_tree:
            return kind
    raise _Refused(f"unexpected results structure {out_tree}")


def _out_tree(kind: str, n_outputs: int):
    results = [0] * n_outputs
    example = results if kind == "plain" else (results, 0 if kind == "rows" else None)
    return jax.tree.structure(example)


def _aval_json(aval, mesh) -> list:
    """[shape, dtype, weak type, spec over the program's abstract mesh (None: no mesh), memory space]."""
    from jax._src import core

    if type(aval) is not core.ShapedArray or not aval.manual_axis_type.empty:
        raise _Refused(f"an array type {aval!r}")
    abstract = aval.sharding.mesh
    if abstract.empty:
        where = None
    elif abstract == mesh.abstract_mesh:
        where = _spec_json(aval.sharding.spec)
    else:
        raise _Refused(f"an array type on another mesh: {aval!r}")
    return [list(aval.shape), np.dtype(aval.dtype).name, bool(aval.weak_type), where, aval.memory_space.name]


def _aval(item, mesh):
    from jax._src import core

    shape, dtype, weak, where, space = item
    sharding = None if where is None else NamedSharding(mesh.abstract_mesh, _spec(where))
    return core.ShapedArray(
        tuple(int(n) for n in shape),
        jax.numpy.dtype(str(dtype)),
        weak_type=bool(weak),
        sharding=sharding,
        memory_space=core.MemorySpace[str(space)],
    )


def _spec_json(spec) -> list:
    entries: list = []
    for entry in spec:
        if entry is None or isinstance(entry, str):
            entries.append(entry)
        elif isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
            entries.append(list(entry))
        else:
            raise _Refused(f"a partition spec entry {entry!r}")
    extra = {name: sorted(getattr(spec, name, ())) for name in ("unreduced", "reduced")}
    return [entries, extra]


def _spec(item) -> PartitionSpec:
    entries, extra = item
    spec = tuple(tuple(e) if isinstance(e, list) else e for e in entries)
    kwargs = {name: frozenset(axes) for name, axes in extra.items() if axes}
    return PartitionSpec(*spec, **kwargs)


def _sharding_json(sharding, mesh) -> list:
    if type(sharding) is not NamedSharding or sharding.mesh != mesh:
        raise _Refused(f"a sharding that is not over the program's mesh: {sharding}")
    return [_spec_json(sharding.spec), sharding.memory_kind]


def _sharding(item, mesh) -> NamedSharding:
    spec, memory_kind = item
    return NamedSharding(mesh, _spec(spec), memory_kind=memory_kind)


def _check_json(check) -> list:
    error, name = check.error, getattr(check.error, "__name__", "")
    if getattr(builtins, name, None) is not error:
        raise _Refused(f"an on-device check raising {error!r}, not a builtin exception")
    return [check.step, name, check.message]


def _check(item, n_steps: int) -> Check:
    step, name, message = item
    error = getattr(builtins, str(name), None)  # (never anything but a builtin exception class)
    if not (isinstance(error, type) and issubclass(error, BaseException)):
        raise ValueError(f"an on-device check raising {name!r}")
    return Check(_indices([step], n_steps).pop(), error, str(message))


def _indices(items, bound: int) -> set[int]:
    """Positions read from a header: integers in ``range(bound)``, else the entry is refused."""
    if not all(type(i) is int and 0 <= i < bound for i in items):
        raise ValueError(f"positions {items!r} outside the program's {bound}")
    return set(items)


# --------------------------------------------------------------------------- loading


def _rebuild(header, data: bytes, program, call_arguments) -> StoredExecutable:
    """The executable of an entry as a ``jax.stages.Compiled``, checked against this call's
    arguments, with the program's traced facts restored."""
    from jax._src import core, stages
    from jax._src.interpreters import pxla
    from jax._src.lib import xla_client as xc

    mesh = program.mesh
    # what tracing would have told the graph layer: read in full before anything is changed
    n_outputs = len(program.outputs)
    forwarded = _indices(header["forwarded"], n_outputs)
    forwarded_leaves = _indices(header["forwarded_leaves"], len(program.leaf_shapes))
    tainted = frozenset(_indices(header["tainted"], n_outputs))
    restored = frozenset(_indices(header["restored"], n_outputs))
    check_table = [_check(c, len(program.steps)) for c in header["checks"]]
    flat, in_tree = jax.tree.flatten((tuple(call_arguments), {}))
    if len(flat) != len(header["args"]):
        raise ValueError(f"the program takes {len(header['args'])} arrays, this call passes {len(flat)}")
    avals = [core.shaped_abstractify(a) for a in flat]
    for aval, (stored, _) in zip(avals, header["args"]):
        if _aval(stored, mesh) != aval:
            raise ValueError(f"an input of type {aval} where the program takes {stored}")
    kept = sorted(int(i) for i in header["kept"])
    if [avals[i] for i in kept] != [_aval(a, mesh) for a in header["in"]]:
        raise ValueError("the inputs XLA kept do not match the program's inputs")
    if len(header["out"]) != len(program.outputs) + (1 if header["rows"] == "rows" else 0):
        raise ValueError("the number of results does not match the program")
    by_id = {d.id: d for d in jax.devices()}
    devices = xc.DeviceList(tuple(by_id[i] for i in header["devices"]))
    backend = devices[0].client
    xla_executable = backend.deserialize_executable(data, executable_devices=devices)
    in_avals = [_aval(a, mesh) for a in header["in"]]
    out_avals = [_aval(a, mesh) for a in header["out"]]
    in_shardings = [_sharding(s, mesh) for s in header["in_shardings"]]
    out_shardings = [_sharding(s, mesh) for s in header["out_shardings"]]
    in_layouts, out_layouts = pxla._get_layouts_from_executable(
        xla_executable, [None] * len(in_avals), [None] * len(out_avals), 0, in_avals, out_avals
    )
    unloaded = pxla.UnloadedMeshExecutable(
        xla_executable=xla_executable,
        device_list=devices,
        backend=backend,
        input_avals=in_avals,
        input_shardings=in_shardings,
        output_avals=out_avals,
        output_shardings=out_shardings,
        committed=bool(header["committed"]),
        name=str(header["name"]),
        unordered_effects=[],
        ordered_effects=[],
        keepalive=[],
        host_callbacks=[],
        kept_var_idx=set(kept),
        mut=None,
        xla_in_layouts=in_layouts,
        dispatch_in_layouts=pxla.get_dispatch_layouts(in_layouts, in_shardings, in_avals),
        xla_out_layouts=out_layouts,
        all_args_info=None,
        pgle_profiler=None,
    )
    args_info = jax.tree_util.tree_unflatten(
        in_tree, [stages.ArgInfo(aval, bool(donated)) for aval, (_, donated) in zip(avals, header["args"])]
    )
    compiled = stages.Compiled(
        unloaded.load(), [], args_info, _out_tree(header["rows"], len(program.outputs)), no_kwargs=False
    )
    analysis = memory.analyse(compiled, mesh)
    program.forwarded.update(forwarded)
    program.forwarded_leaves.update(forwarded_leaves)
    program.tainted, program.restored, program.check_table = tainted, restored, check_table
    return StoredExecutable(compiled, program, analysis)
