"""What an ``st.compile`` trace runs: the code, the globals that code loads, and the C functions it
calls that a replay could not repeat.

``recording()`` installs a profile function in the C++ extension for the duration of a traced call
(``reads_begin`` / ``reads_end``: chained to any profiler already set, which keeps working). For each
piece of Python code run it keeps the code and its globals; ``global_reads`` then says which names
of which namespaces that code loads, including the attributes it reads through modules
(``F.gelu``). Code of shardtensor itself, and library code run under it, is not the user's and is
skipped. A call of a clock or a random source (``time.time``, ``random.random``, ``os.urandom``,
``numpy.random``), output from the user's code (``print``, a file's ``write``) or a generator made
before the call and resumed in it makes the call one a replay could not repeat (``Reads.reason``).

Example::

    with recording() as ran:
        train_step(x, y)
    global_reads(ran.code_globals)   # [(vars(torch.nn.functional), ("gelu", ...)), ...]
"""

from __future__ import annotations

import contextlib
import dis
import functools
import io
import os
import sys
import sysconfig
import threading
import types
from typing import Any

import numpy as np
import torch

from shardtensor.tensor import device as torch_device


def available() -> bool:
    """Whether a trace's reads can be recorded and guarded here (the C++ extension, and CPython's
    dict version tags: 3.11)."""
    ext = torch_device.EXT
    return ext is not None and hasattr(ext, "reads_begin") and ext.dict_version({}) is not None


# --- whose code it is
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARY_ROOTS = tuple(
    {os.path.dirname(os.path.abspath(str(m.__file__))) + os.sep for m in (torch, np)}
    | {os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")}
)
USER, INTERNAL, LIBRARY = 0, 1, 2
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR


@functools.cache
def file_kind(filename: str) -> int:
    """``INTERNAL`` (shardtensor's, and jax's: its engine), ``LIBRARY`` (torch's, numpy's, the
    standard library's) or ``USER`` (everything else: the user's code, transformers' models)."""
    if filename.startswith(_PACKAGE):
        return INTERNAL
    if "/site-packages/jax/" in filename or "/site-packages/jaxlib/" in filename:
        # (jax runs as shardtensor's engine, and its garbage-collector callback at any moment: what
        # it reads is not the step's)
        return INTERNAL
    if filename.startswith("<frozen") or filename.startswith(_LIBRARY_ROOTS):
        return LIBRARY
    return USER


def library_object(o) -> bool:
    """Whether module, class or function ``o`` comes from a library (or is built in)."""
    if isinstance(o, types.ModuleType):
        filename = getattr(o, "__file__", None)
        if o.__name__ == "__main__":
            return False
        return filename is None or file_kind(os.path.abspath(filename)) != USER
    name = getattr(o, "__module__", None) or ""
    if name == "__main__":  # (a script's or a notebook's: the user's, with a __file__ or none)
        return False
    module = sys.modules.get(name)
    if module is None:
        return False
    filename = getattr(module, "__file__", None)
    return filename is None or file_kind(os.path.abspath(filename)) != USER  # (built in: a library's)


def library_namespace(globs: dict) -> bool:
    """Whether ``globs`` is the namespace of a library's module (torch's, the standard library's)."""
    name = globs.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    return module is not None and vars(module) is globs and library_object(module)


def _classify_code(code: types.CodeType) -> int:
    """reads_begin's classify: whose code it is (low 4 bits), and for a generator's code the offset
    of its first RESUME + 1 above them (a resume elsewhere continues a generator already started)."""
    kind = file_kind(code.co_filename)
    if kind != INTERNAL and code.co_flags & _GENERATOR_FLAGS:
        start = next((i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), None)
        if start is not None:
            return kind | ((start + 1) << 4)
    return kind


# --- what a replay could not repeat
_NONDETERMINISTIC_MODULES = ("time", "random", "_random", "numpy.random", "secrets", "uuid")
_IO_METHODS = ("write", "writelines", "read", "readline", "readlines", "flush")


def _classify_c(func, by_user: bool = True) -> str | None:
    """reads_begin's classify_c: why a replay could not repeat a call of the C function ``func``,
    or None. A clock or a random source (a new result each call), whoever calls it; input or output
    only from the user's own code (a library reading its own files, or logging, is not what the
    step computes)."""
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", "?")
    if owner is not None and not isinstance(owner, types.ModuleType):
        module = type(owner).__module__ or ""
        if module in ("_io", "io") or isinstance(owner, io.IOBase):
            if by_user and name in _IO_METHODS:
                return f"it does input or output ({type(owner).__name__}.{name}): a replay would not"
            return None
        name = f"{type(owner).__name__}.{name}"
    else:
        module = owner.__name__ if isinstance(owner, types.ModuleType) else getattr(func, "__module__", None) or ""
    if module.startswith(_NONDETERMINISTIC_MODULES):
        return f"it calls {module}.{name}, whose result a replay would not compute again"
    if module in ("posix", "nt", "os") and name in ("urandom", "getrandom", "times"):
        return f"it calls os.{name}, whose result a replay would not compute again"
    if by_user and module == "builtins" and name in ("print", "input", "breakpoint"):
        return f"it calls {name}(), which a replay would not"
    return None


class Reads:
    """What a traced call ran: ``code_globals`` (each piece of code and its globals) and ``reason``
    (why a replay could not repeat it, or None)."""

    def __init__(self):
        self.code_globals: list = []
        self.reason: str | None = None


_RECORDING = threading.local()  # .owner: the Reads being recorded on this thread


@contextlib.contextmanager
def recording():
    """Record what the block runs on this thread (``Reads``); without the extension, or inside
    another recording, ``reason`` says why it could not.

    Example::

        with recording() as ran:
            step(x)
        ran.reason     # None, or why a replay could not repeat it
    """
    reads = Reads()
    if not available() or getattr(_RECORDING, "owner", None) is not None:
        reads.reason = (
            "shardtensor's C++ extension is not built here (frozen replays need it)"
            if not available()
            else "a compiled function was traced inside another's trace"
        )
        yield reads
        return
    ext: Any = torch_device.EXT
    _RECORDING.owner = reads
    ext.reads_begin(reads, _classify_code, _classify_c)
    try:
        yield reads
    finally:
        _RECORDING.owner = None
        code_globals, reason, resumed = ext.reads_end()
        reads.code_globals = code_globals
        if reason is not None:
            reads.reason = reason
        elif resumed is not None:
            reads.reason = (
                f"it resumes a generator made before the call ({resumed.co_name} in "
                f"{os.path.basename(resumed.co_filename)}): a replay would not advance it"
            )


# --- the globals it read
_UNSET = object()


@functools.lru_cache(maxsize=4096)
def _global_loads(code: types.CodeType) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """The names ``code`` loads as globals (LOAD_GLOBAL, LOAD_NAME), and the attribute chains it
    reads from them (``F.gelu``, ``torch.nn.functional.gelu``: LOAD_ATTR / LOAD_METHOD after it)."""
    names: set = set()
    chains: set = set()
    chain: list = []
    for i in dis.get_instructions(code):
        if i.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            if len(chain) > 1:
                chains.add(tuple(chain))
            chain = [i.argval] if isinstance(i.argval, str) else []
            names.update(chain)
        elif i.opname in ("LOAD_ATTR", "LOAD_METHOD") and chain:
            chain.append(i.argval)
        elif i.opname not in ("PRECALL", "CACHE", "EXTENDED_ARG"):
            if len(chain) > 1:
                chains.add(tuple(chain))
            chain = []
    if len(chain) > 1:
        chains.add(tuple(chain))
    return tuple(sorted(names)), tuple(sorted(chains))


def global_reads(code_globals) -> list[tuple[dict, tuple[str, ...]]]:
    """(namespace, the names read from it) for the code a trace ran, one entry per namespace: each
    code's globals, and the namespaces of the modules it reads attributes of through them
    (``F.gelu``: the name ``gelu`` of ``torch.nn.functional``).

    Example: ``global_reads(ran.code_globals)``
    """
    by_dict: dict[int, tuple[dict, set]] = {}
    for code, globs in code_globals:
        names, chains = _global_loads(code)
        if names:
            by_dict.setdefault(id(globs), (globs, set()))[1].update(names)
        for first, *attrs in chains:
            value = globs.get(first, _UNSET)
            for attr in attrs:
                if not isinstance(value, types.ModuleType):
                    break
                namespace = vars(value)
                by_dict.setdefault(id(namespace), (namespace, set()))[1].add(attr)
                value = namespace.get(attr, _UNSET)
    found = [(globs, tuple(sorted(names))) for globs, names in by_dict.values()]
    # (in an order of their own, not the order the code ran in: a walk from the same reads reaches
    # the same objects in the same order)
    found.sort(key=lambda item: (str(item[0].get("__name__")), item[1]))
    return found
