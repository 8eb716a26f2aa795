"""A program key that means the same in every process: the digest under which ``program_store``
keeps a compiled program on disk.

A ``Program``'s key (``program.Program.build``) is a tuple of Python objects: ops, static
arguments, shapes, dtypes, shardings, the mesh. It is compared by equality inside one process; on
disk it needs a canonical text. ``digest(key)`` writes the key as that text, element by element,
for the types a key holds, and hashes it together with everything outside the key that decides
what program the key traces to: the versions of shardtensor (its source files' digest, since a
changed lowering changes the program without changing a version), jax, jaxlib, torch and numpy;
the devices (platform, kind, ids, process count); JAX's configuration; ``XLA_FLAGS`` and every
``SHARDTENSOR_*`` variable. A key holding anything else (a user's function, an op whose lowering
is not shardtensor's own, ``call_jax``'s process-local function handles) has no digest: its
program is compiled as usual and never stored.

Example::

    d = digest(program.key)     # a hex string, or None when the program cannot be stored
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import sys

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardtensor.ops.registry import lookup

FORMAT = 1  # bumped when the encoding or the stored metadata change

# JAX options that only say where and whether to cache, log or dump: a read-only cache sets some of
# them differently from the run that filled it, and none changes a program
_IGNORED_OPTIONS = frozenset(
    {
        "jax_compilation_cache_dir",
        "jax_compilation_cache_max_size",
        "jax_compilation_cache_check_contents",
        "jax_enable_compilation_cache",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
        "jax_raise_persistent_cache_errors",
        "jax_explain_cache_misses",
        "jax_log_compiles",
        "jax_logging_level",
        "jax_debug_log_modules",
        "jax_dump_ir_to",
        "jax_dump_ir_modes",
        "jax_traceback_filtering",
        "jax_cpu_get_global_topology_timeout_minutes",
        "jax_cpu_get_local_topology_timeout_minutes",
        "jax_distributed_debug",
    }
)
_TRUSTED_MODULES = ("builtins", "torch", "numpy", "jax", "jaxlib", "ml_dtypes", "shardtensor")
_PROCESS_LOCAL_OPS = ("shardtensor::call_jax",)  # arguments that are handles into a per-process table


class Unstorable(Exception):
    """A key holds something with no canonical text; the message says what."""


def digest(key) -> str | None:
    """The hex digest of a program key with this process's environment, or None (``why_not``) when
    the key holds something that has no meaning outside this process.

    Example::

        digest(program.key)   # 'a3f0…' (64 hex digits)
    """
    try:
        text = encode(key)
    except Unstorable as e:
        _LAST_REASON[0] = str(e)
        return None
    h = hashlib.sha256()
    h.update(environment().encode())
    h.update(b"\0")
    h.update(text.encode())
    return h.hexdigest()


_LAST_REASON: list = [""]


def why_not() -> str:
    """Why the last key that got no digest got none."""
    return _LAST_REASON[0]


def encode(key) -> str:
    """The canonical text of a key (raises ``Unstorable``).

    Example::

        encode((("add", 1.0), torch.float32)) == "(('add',f:0x1.0000000000000p+0,),torch.float32,)"
    """
    out: list[str] = []
    _encode(key, out.append)
    return "".join(out)


# node keys recur in every program of a process (one per op signature): their text is kept, by
# identity, with the object itself so that its id cannot be reused
_MEMO: dict[int, tuple[object, str]] = {}
_MEMO_LIMIT = 200_000


def _encode(x, put) -> None:
    t = type(x)
    if t is str:
        put(repr(x))
    elif t is int:
        put(str(x))
    elif t is tuple or isinstance(x, tuple):  # (torch.Size, StructuralKey, named tuples: as the tuple they equal)
        memo = _MEMO.get(id(x))
        if memo is not None and memo[0] is x:
            put(memo[1])
            return
        parts: list[str] = ["("]
        for item in x:
            _encode(item, parts.append)
            parts.append(",")
        parts.append(")")
        text = "".join(parts)
        if len(x) > 1 and t is tuple:
            if len(_MEMO) >= _MEMO_LIMIT:
                _MEMO.clear()
            _MEMO[id(x)] = (x, text)
        put(text)
    elif x is None or t is bool:
        put(repr(x))
    elif t is float:
        put("f:" + x.hex())  # exact, and tells -0.0 from 0.0
    elif t is complex:
        put(f"c:{x.real.hex()}:{x.imag.hex()}")
    elif t is bytes:
        put("b:" + x.hex())
    elif t is list:
        put("[")
        for item in x:
            _encode(item, put)
            put(",")
        put("]")
    elif t in (frozenset, set):
        put("{" + ",".join(sorted(encode(i) for i in x)) + "}")
    elif t is dict:
        put("d{" + ",".join(sorted(f"{encode(k)}:{encode(v)}" for k, v in x.items())) + "}")
    else:
        put(_encode_object(x))


def _encode_object(x) -> str:
    if isinstance(x, torch.dtype | torch.device | torch.memory_format | torch.layout):
        return f"torch:{x}"
    if isinstance(x, torch._ops.OpOverload):
        return "op:" + _op_name(x)
    if isinstance(x, torch._ops.OpOverloadPacket):
        return "packet:" + str(x)
    if isinstance(x, np.dtype):
        return f"np:{x.str}:{x.name}"
    if isinstance(x, np.generic):
        return f"npv:{x.dtype.str}:{x.tobytes().hex()}"
    if isinstance(x, type):
        return "type:" + _qualified(x)
    if isinstance(x, NamedSharding):
        return f"ns({_mesh(x.mesh)},{_spec(x.spec)},{x.memory_kind!r})"
    if isinstance(x, Mesh):
        return _mesh(x)
    if isinstance(x, PartitionSpec):
        return _spec(x)
    if isinstance(x, enum.Enum):
        return f"enum:{_qualified(type(x))}.{x.name}"
    if isinstance(x, slice):
        return f"slice({encode((x.start, x.stop, x.step))})"
    if x is Ellipsis:
        return "..."
    raise Unstorable(f"a {type(x).__module__}.{type(x).__qualname__} in the program key")


def _qualified(cls: type) -> str:
    module = getattr(cls, "__module__", "") or ""
    if module.split(".")[0] not in _TRUSTED_MODULES:
        raise Unstorable(f"the type {module}.{cls.__qualname__} in the program key")
    return f"{module}.{cls.__qualname__}"


@functools.lru_cache(maxsize=4096)
def _op_name(op) -> str:
    name = str(op)
    schema_name = op._schema.name
    if schema_name in _PROCESS_LOCAL_OPS:
        raise Unstorable(f"the op {name}, whose arguments name functions of this process")
    lowering = lookup(op)
    if lowering is not None:
        for fn in (lowering.fn, *(f for _, f in lowering.platforms)):
            module = getattr(fn, "__module__", "") or ""
            if not module.startswith("shardtensor."):
                raise Unstorable(f"the op {name}, lowered by {module} (not shardtensor's own lowering)")
    return name


def _mesh(mesh) -> str:
    ids = tuple(int(d.id) for d in mesh.devices.flat)
    return f"mesh({ids},{tuple(mesh.shape.items())},{tuple(str(a) for a in mesh.axis_types)})"


def _spec(spec) -> str:
    parts = encode(tuple(spec))
    extra = [f"{name}={sorted(getattr(spec, name))}" for name in ("unreduced", "reduced") if getattr(spec, name, None)]
    return f"P{parts}{';'.join(extra)}"


# --------------------------------------------------------------------------- the environment


def environment() -> str:
    """Everything outside a program key that decides its program, as text (see the module docstring).

    Example::

        "jax 0.10.2" in environment()
    """
    options = sorted((k, repr(v)) for k, v in jax.config.values.items() if k not in _IGNORED_OPTIONS)
    variables = sorted(
        (k, v) for k, v in os.environ.items() if k.startswith("SHARDTENSOR_") or k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
    )
    return "\n".join(
        [
            f"format {FORMAT}",
            _static_environment(),
            _devices(),
            repr(options),
            repr(variables),
        ]
    )


@functools.lru_cache(maxsize=1)
def _static_environment() -> str:
    import jaxlib

    versions = {
        "python": sys.version,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
    }
    return f"{sorted(versions.items())}\nshardtensor source {_source_digest()}"


def _source_digest() -> str:
    """A digest of shardtensor's own files (the lowerings are the programs' source)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".so", ".cpp")):
                path = os.path.join(directory, name)
                with open(path, "rb") as f:
                    data = f.read()
                h.update(os.path.relpath(path, root).encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def _devices() -> str:
    devices = jax.devices()
    client = devices[0].client
    return repr(
        (
            client.platform,
            client.platform_version,
            jax.process_count(),
            jax.process_index(),
            tuple((d.id, d.platform, d.device_kind, d.process_index) for d in devices),
        )
    )
