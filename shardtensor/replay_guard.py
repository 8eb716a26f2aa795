"""What a frozen ``st.compile`` replay takes for granted about the Python world, and a cheap check
that it still holds.

A frozen replay runs the captured program instead of the function's Python. That is exact only
while the Python, run again, would record the same program from the same values: while everything
it could read is as it was. ``Snapshot`` walks the Python objects reachable from the function
itself (its closure cells and defaults), its object arguments, the optimizers and parameters the
trace touched (``touched``) and the globals its code loaded (``trace_reads``): module and object
attributes, dict, list and set contents, class attributes, closure cells, function defaults,
tensors' ``requires_grad``, hooks and ``.grad`` (and a CPU tensor's version and storage), small
numpy arrays. What it reaches stands for what the Python could have read. A library's own modules
and objects are not looked into (what the code reads of a module, it reads by name).

A call freezes when the state it reached on entry and on exit is the same (``Snapshot.same_as``:
it read that state and left it as it found it, so, run again from it, it does the same), and a
replay runs while ``Guard.holds`` (``replay_check``): every part unchanged, checked by the C++ extension
(``replay_state.h``) by CPython's version tags (dicts, an object's ``__dict__``, classes), items
(lists, sets), contents (closure cells), identity and flags (tensors), by name (globals). torch's
global state (grad mode, autocast, the default dtype, deterministic algorithms, the matmul
precision: ``GlobalStateGuard``), the mode stacks and SDPA's backend switches are compared too.
What no Python object holds (another process, a file) a guard cannot see; a step that reads it
should not be compiled. Without the extension nothing freezes: each call runs its Python.

Example::

    with recording() as ran:
        train_step(x, y)
    roots = Roots(train_step, (), global_reads(ran.code_globals))
    guard = Snapshot(roots).guard([x, y])
    ...
    guard.holds([x, y])      # False after a module attribute, a global, a hook ... changed
"""

from __future__ import annotations

import collections.abc
import contextlib
import enum
import functools
import sys
import threading
import types
import weakref
from collections.abc import Sequence

import numpy as np
import torch
import torch.optim.optimizer as torch_optimizer

from shardtensor.ops import jax_call
from shardtensor.replay_check import Guard, Kind, _ext, _global_state
from shardtensor.trace_reads import LIBRARY, USER, available, file_kind, library_namespace, library_object

_ATOMS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(Ellipsis),
    type(NotImplemented),
    range,
    slice,
    types.CodeType,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    types.BuiltinFunctionType,  # (a bound C method's object is walked: see _walk)
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
    types.GenericAlias,
    enum.Enum,
)
_BYTES_COMPARED = 1 << 16  # numpy arrays and byte buffers up to this size are compared by value
_MAX_ENTRIES = 200_000  # a guard larger than this would cost more to check than running the Python
_OUR_TENSOR_FIELDS = ("_vcache", "_sig")  # derived caches shardtensor keeps on a tensor


def _atom_key(v):
    """How a plain value compares (1, 1.0 and True apart; -0.0 apart from 0.0)."""
    if type(v) is float:
        return (float, v.hex())
    return (type(v), v)


def _is_atom(v) -> bool:
    return isinstance(v, _ATOMS) or (type(v) is tuple and all(isinstance(x, _ATOMS) for x in v))


class Roots:
    """Where a walk starts: the function, its object arguments, the objects the trace touched
    (held weakly), and the globals its code read (dict, names)."""

    def __init__(self, fn, objects: Sequence, global_reads_: Sequence):
        self.fn = fn
        self._objects = [_ref(o) for o in objects]
        self.globals = list(global_reads_)

    def objects(self) -> list:
        return [o for o in (r() for r in self._objects) if o is not None]

    def covers(self, other: Roots) -> bool:
        """Whether every root of ``other`` is one of these (the state ``other`` reaches is part of
        what these reach), libraries' globals apart: a library's code run now and then (a
        finalizer, a lazy import) reads names another call did not, and its globals change only
        when the user monkeypatches it (the guard compares all of them from the call on)."""
        if other.fn is not self.fn:
            return False
        mine = {id(o) for o in self.objects()}
        if not all(id(o) in mine for o in other.objects()):
            return False
        names = {id(g): set(n) for g, n in self.globals}
        return all(library_namespace(g) or (id(g) in names and names[id(g)].issuperset(n)) for g, n in other.globals)


def _ref(obj):
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class Snapshot:
    """The state reachable from ``roots``, now: comparison keys (``same_as``) and, for a guard, the
    C++ check's plan. ``live``: (id of a dict, key) pairs whose float values a replay reads anew (an
    optimizer's learning rate: ``optim_steps.LiveValue``), which the guard lets change. ``produced``:
    ids of the cells the traced program made; a parameter whose
    ``.grad`` holds one (its gradient made anew by this call) has that gradient left out of the
    comparison (a replay writes the new gradient into the one it finds, ``Guard``). ``reason``: why
    this state cannot be guarded, or None."""

    def __init__(
        self, roots: Roots, args: Sequence = (), produced: frozenset = frozenset(), live: frozenset = frozenset()
    ):
        self.roots = roots
        self.reason: str | None = None
        self.keys: list = []
        self._entries: list = []
        self._objects: list = []  # everything walked, held until the guard is made
        self._seen: set = set()
        self._parent: dict = {}  # id -> the object it was reached from (None: a root)
        self._labels: dict = {}  # id of a root -> its name
        self._key_objects: list = []  # the object each key is about
        self._entry_owner: list = []  # the object whose visit made each entry
        self._current = None
        self._produced = produced
        self._live = live  # (id of a dict, key): a value a replay reads anew (optim_steps.LiveValue)
        self.produced_grads: list = []  # (parameter, its gradient) made by the program
        if not available():
            self.reason = "shardtensor's C++ extension is not built (frozen replays need it)"
            return
        self._walk(roots.fn, getattr(roots.fn, "__qualname__", "the function"))
        for i, obj in enumerate(args):
            if not isinstance(obj, torch.Tensor):
                self._walk(obj, f"<argument {i}>")
        for obj in roots.objects():
            self._walk(obj, f"<{type(obj).__name__} the call used>")
        for globs, names in roots.globals:
            self._globals(globs, names)
        self.keys.append(("state", _global_state()))

    def same_as(self, before: Snapshot | None) -> bool:
        """Whether ``before`` (taken on entry) reached the same objects in the same state: the call
        left what it read as it found it. A gradient the program made anew counts as the same as
        the tensor that held its place before (a replay writes into that one)."""
        if before is None or self.reason is not None or before.reason is not None:
            return False
        if len(self.keys) != len(before.keys):
            return False
        return all(map(_same_key, self.keys, before.keys))

    def difference(self, before: Snapshot | None) -> str:
        """What differs from ``before`` (for SHARDTENSOR_DEBUG's messages)."""
        if before is None:
            return "no state from before the call to compare with"
        if self.reason or before.reason:
            return self.reason or before.reason or ""
        for i, (now, then) in enumerate(zip(self.keys, before.keys)):
            if not _same_key(now, then):
                where = self._path(self._key_objects[i]) if i < len(self._key_objects) else "torch's global state"
                return f"{where}: {_describe(now)} (was {_describe(then)})"
        return f"it reached {len(self.keys)} objects, {len(before.keys)} before"

    # --- walking
    def _walk(self, obj, label: str = "", library: bool = False) -> None:
        """Visit ``obj`` and what it holds. ``library``: a library's global (what torch's own code
        reads: its global hook dicts, ``sys.modules``): its containers are compared, and what they
        hold only where it is the user's (a hook function, an object of the user's class), not a
        library's own objects (a module's table, ``linecache``'s lines)."""
        if label and not _is_atom(obj):
            self._labels.setdefault(id(obj), label)
        stack = [(obj, None, library)]
        while stack:
            if self.reason is not None:
                return
            o, parent, shallow = stack.pop()
            if _is_atom(o) or id(o) in self._seen:
                continue
            if _opaque(o, shallow):
                self._seen.add(id(o))
                self.keys.append(("?", id(o)))
                self._key_objects.append(o)
                self._objects.append(o)
                continue
            self._seen.add(id(o))
            self._objects.append(o)
            self._parent[id(o)] = parent
            if len(self._entries) > _MAX_ENTRIES:
                self.reason = f"it can reach more than {_MAX_ENTRIES} Python objects (guarding them would cost more)"
                return
            first = len(self.keys)
            self._current = o
            children = self._visit(o)
            self._key_objects += [o] * (len(self.keys) - first)
            if children:
                inner = shallow and isinstance(o, _CONTAINERS)
                stack.extend((c, o, inner) for c in reversed(children))

    def _path(self, o) -> str:
        """Where ``o`` was found, as a Python expression (for the debug messages)."""
        parts = []
        for _ in range(40):
            parent = self._parent.get(id(o))
            if parent is None:
                parts.append(self._labels.get(id(o), f"<{type(o).__name__}>"))
                break
            parts.append(_label(parent, o))
            o = parent
        return "".join(reversed(parts))

    def _entry(self, kind: Kind, obj, *fields) -> None:
        self._entries.append((int(kind), id(obj), *fields))
        self._entry_owner.append(self._current)

    def _visit(self, o) -> list:  # noqa: C901  (one case per kind of object)
        """Add ``o``'s entry and key; its children to walk."""
        ext = _ext()
        t = type(o)
        if isinstance(o, dict):
            extra = self._object(o) if t is not dict and hasattr(o, "__dict__") and vars(o) else []
            live = tuple(k for k in o if (id(o), k) in self._live)
            if live:  # (a float a replay reads anew: the rest of the dict as it is)
                others = tuple(k for k in o if k not in live)
                addresses = b"".join(id(o[k]).to_bytes(8, sys.byteorder) for k in others)
                self._entry(Kind.LIVE_DICT, o, ext.dict_version(o), live, others, addresses)
                self._hold([o[k] for k in others])
            else:
                self._entry(Kind.DICT, o, ext.dict_version(o))
            self.keys.append(("d", id(o), tuple((_key_of(k), _key_of(v)) for k, v in o.items())))
            return [*extra, *(k for k in o if not _is_atom(k)), *o.values()]
        if isinstance(o, list):
            self._entry(Kind.LIST, o, b"".join(id(x).to_bytes(8, sys.byteorder) for x in o))
            self.keys.append(("l", id(o), tuple(map(_key_of, o))))
            self._hold(o)
            return list(o)
        if t is tuple or t is frozenset or (isinstance(o, tuple) and not hasattr(o, "__dict__")):
            self.keys.append(("tu", id(o), tuple(map(_key_of, o))))
            return list(o)
        if isinstance(o, set):
            self._entry(Kind.SET, o, tuple(o))
            self.keys.append(("s", id(o), frozenset(map(_key_of, o))))
            return list(o)
        if isinstance(o, torch.Tensor):
            return self._tensor(o)
        if isinstance(o, types.ModuleType):
            return self._module(o)
        if isinstance(o, type):
            return self._class(o)
        if t is types.FunctionType:
            return self._function(o)
        if t is types.MethodType:
            return [o.__self__, o.__func__]
        if t is types.BuiltinMethodType and o.__self__ is not None and not isinstance(o.__self__, types.ModuleType):
            return [o.__self__]
        if t is functools.partial:
            return [o.func, o.args, o.keywords]
        if t in (staticmethod, classmethod):
            return [o.__func__]
        if t is property:
            return [o.fget, o.fset, o.fdel]
        if t is weakref.ReferenceType:
            target = o()
            self.keys.append(("w", id(o), id(target)))
            return [] if target is None else [target]
        if isinstance(o, collections.abc.Iterator) and not hasattr(o, "__dict__"):
            self.reason = f"it can reach an iterator ({t.__name__}): a replay would not advance it"
            return []
        if isinstance(o, np.ndarray) or t in (bytearray, memoryview) or t.__name__ == "array":
            return self._buffer(o)
        if hasattr(o, "__dict__") or hasattr(t, "__slots__"):
            return self._object(o)
        self.keys.append(("?", id(o), t))  # an opaque object (a lock, a C extension's): by identity
        return []

    def _object(self, o) -> list:
        """An object's class, ``__dict__`` and slots."""
        ext = _ext()
        t = type(o)
        children: list = [t]
        d = vars(o) if hasattr(o, "__dict__") else None
        if d is not None and type(d) is not dict:  # (a __dict__ of another kind: a typing alias's)
            self.keys.append(("?", id(o), t))
            return []
        if d is not None:
            self._entry(Kind.OBJECT, o, id(t), id(d), ext.dict_version(d))
            self.keys.append(("o", id(o), id(t), tuple((k, _key_of(v)) for k, v in d.items())))
            children += d.values()
        else:
            self._entry(Kind.OBJECT, o, id(t), 0, 0)
            self.keys.append(("o", id(o), id(t)))
        slots = [s for c in t.__mro__ for s in getattr(c, "__slots__", ()) if s not in ("__dict__", "__weakref__")]
        if slots:
            values = tuple(getattr(o, s, _UNSET) for s in slots)
            self.keys.append(("slots", id(o), tuple(map(_key_of, values))))
            if not library_object(t):
                self.reason = self.reason or (
                    f"it can reach an object with __slots__ ({t.__qualname__}), which a guard cannot watch"
                )
        return children

    def _class(self, c: type) -> list:
        version = _ext().type_version(c)
        self._entry(Kind.TYPE, c, version)
        self.keys.append(("c", id(c), version))
        if version == 0:
            self.reason = self.reason or f"its class {c.__qualname__} cannot be watched for changes"
        if library_object(c):
            return []
        return [v for k, v in vars(c).items() if k not in ("__dict__", "__weakref__", "__doc__")]

    def _module(self, m: types.ModuleType) -> list:
        """A library's module: what the code reads of it is guarded by name (``global_reads``), the
        rest is not watched (its own bookkeeping, such as ``warnings``' filter counter, changes
        while a step runs). A module of the user's: all of it."""
        if library_object(m):
            self.keys.append(("m", id(m)))
            return []
        d = vars(m)
        self._entry(Kind.DICT, d, _ext().dict_version(d))
        self.keys.append(("m", id(m), tuple((k, _key_of(v)) for k, v in d.items())))
        return [v for k, v in d.items() if not k.startswith("__")]

    def _function(self, f) -> list:
        code, defaults, kwdefaults, fdict = f.__code__, f.__defaults__, f.__kwdefaults__, f.__dict__  # (made if none)
        self._entry(Kind.FUNCTION, f, id(code), _id0(defaults), _id0(kwdefaults), _id0(fdict))
        self._objects += [code, defaults]  # (compared by address: kept so that it stays theirs)
        self.keys.append(("F", id(f), id(code), _id0(defaults), _id0(kwdefaults)))
        if file_kind(code.co_filename) == LIBRARY:
            return [defaults, kwdefaults]
        children: list = [defaults, kwdefaults, fdict]
        for cell in f.__closure__ or ():
            try:
                content = cell.cell_contents
            except ValueError:  # (empty: not yet assigned)
                content = None
                empty = True
            else:
                empty = False
            self._entry(Kind.CELL, cell, 0 if empty else id(content))
            self.keys.append(("cell", id(cell), None if empty else _key_of(content)))
            self._objects.append(cell)
            if not empty:
                children.append(content)
                self._hold([content])
        return children

    def _tensor(self, t: torch.Tensor) -> list:
        with torch._C.DisableTorchFunctionSubclass():
            grad = t.grad if t.grad_fn is None else None  # (a non-leaf's .grad warns: torch reads None)
            requires_grad = t.requires_grad
            hooks = (tuple(t._backward_hooks or ()), tuple(getattr(t, "_post_accumulate_grad_hooks", None) or ()))
            d = vars(t) if hasattr(t, "__dict__") else {}
            cell = d.get("_cell")
            own = tuple((k, _key_of(v)) for k, v in d.items() if k not in _OUR_TENSOR_FIELDS)
            cpu = () if t.device.type != "cpu" else (t._version, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
            produced = grad is not None and id(getattr(grad, "_cell", None)) in self._produced
            if produced:
                self.produced_grads.append((t, grad))
                grad_key: tuple = ("produced",)
            elif grad is None:
                grad_key = ("none",)
            else:
                gd = vars(grad) if hasattr(grad, "__dict__") else {}
                own_grad = tuple((k, _key_of(v)) for k, v in gd.items() if k not in _OUR_TENSOR_FIELDS)
                grad_key = ("tensor", id(grad), own_grad)
        self._tensor_entry(t)
        self.keys.append(("t", id(t), requires_grad, hooks, grad_key, own, cpu, id(cell)))
        if cell is not None:
            self._objects.append(cell)  # (compared by identity: kept so its address stays its own)
        if grad is not None and not produced:
            # its state (its storage cell) is checked, not walked: a gradient the program makes
            # anew on each call is a new object, which the keys leave out (``same_as``)
            self._tensor_entry(grad)
            self._objects.append(grad)
        return [v for k, v in d.items() if k not in _OUR_TENSOR_FIELDS and k != "_cell"]

    def _hold(self, items) -> None:
        """Keep the plain values among ``items`` alive with the guard: an entry compares them by
        address, and a freed number's address can be another's."""
        self._objects += [x for x in items if _is_atom(x) and x is not None and type(x) is not bool]

    def _tensor_entry(self, t) -> None:
        ext = _ext()
        if ext.tensor_fast(t):
            self._entry(Kind.FAST_TENSOR, t)
        else:
            self._entry(Kind.TENSOR, t, ext.tensor_state(t))

    def _buffer(self, o) -> list:
        data = o.tobytes() if isinstance(o, np.ndarray) else bytes(o)
        if len(data) > _BYTES_COMPARED:
            self.reason = (
                f"it can reach a {type(o).__name__} of {len(data)} bytes (compared on every call it would cost more)"
            )
            return []
        if isinstance(o, np.ndarray) and not o.flags.c_contiguous:
            self.reason = "it can reach a numpy array that is not contiguous"
            return []
        self._entry(Kind.BYTES, o, data)
        self.keys.append(("b", id(o), data, getattr(o, "shape", None), str(getattr(o, "dtype", ""))))
        return [o.base] if isinstance(o, np.ndarray) and o.base is not None else []

    def _globals(self, globs: dict, names: tuple) -> None:
        builtins = globs.get("__builtins__")
        builtins = vars(builtins) if isinstance(builtins, types.ModuleType) else builtins
        values = []
        absent = []
        for name in names:
            if name in globs:
                values.append(globs[name])
            else:
                values.append(None)
                absent.append(name)
        expected = b"".join((id(v) if n in globs else 0).to_bytes(8, sys.byteorder) for n, v in zip(names, values))
        self._entry(Kind.GLOBALS, globs, _ext().dict_version(globs), names, expected)
        self.keys.append(("g", id(globs), tuple((n, _key_of(v) if n in globs else ()) for n, v in zip(names, values))))
        self._objects.append(globs)
        self._hold(values)
        module = globs.get("__name__", "?") if isinstance(globs.get("__name__"), str) else "?"
        self._entry_owner[-1] = f"the globals {', '.join(names[:6])}{' ...' if len(names) > 6 else ''} of {module}"
        library = library_namespace(globs)
        for v, n in zip(values, names):
            if n in globs:
                self._walk(v, f"{module}.{n}", library)
        if absent and isinstance(builtins, dict):
            found = [b for b in absent if b in builtins]
            if found:
                self._globals(builtins, tuple(found))

    # --- the guard
    def guard(self, args: Sequence | None, grads_made: Sequence = (), debug: bool = False) -> Guard:
        """The check that this state still holds (``args``: the call's tensor arguments, whose
        requires_grad, hooks and gradients are checked at their positions; None: the caller checks
        them itself, as Dynamo's guards do). ``grads_made``: the (parameter, gradient) pairs whose
        gradient a replay overwrites in place: it does so only while nothing else holds that
        gradient or its storage. ``debug``: it can say which part failed (``failing``)."""
        return Guard(self, args, grads_made, debug)


_UNSET = object()
_KINDS = {
    "d": "a dict",
    "l": "a list",
    "tu": "a tuple",
    "s": "a set",
    "t": "a tensor",
    "m": "a module",
    "c": "a class",
    "F": "a function",
    "cell": "a closure cell",
    "g": "the globals",
    "o": "an object",
    "b": "a buffer",
    "w": "a weak reference",
    "slots": "an object's slots",
    "state": "torch's global state",
}


_CONTAINERS = (dict, list, tuple, set, frozenset)


def _opaque(o, library: bool) -> bool:
    """Whether ``o`` is compared by identity only, not looked into: shardtensor's own objects (a
    compiled function, a mesh: their state is the engine's), a function given to ``call_jax`` (its
    program is keyed by the function, as ``jax.jit``'s; its host callbacks run in every replay), a
    library's modules, and, under a library's global, a library's own objects (not containers, the
    user's functions or objects)."""
    if isinstance(o, (torch.Tensor, type)) or _is_atom(o):
        return False
    if isinstance(o, types.ModuleType):
        return library or library_object(o)
    module = getattr(type(o), "__module__", "") or ""
    if module == "shardtensor" or module.startswith("shardtensor."):
        return True
    if jax_call.is_registered_function(o):  # call_jax's contract is jax.jit's: a function is its program
        return True
    if not library or isinstance(o, _CONTAINERS):
        return False
    if isinstance(o, types.FunctionType):
        return file_kind(o.__code__.co_filename) != USER
    return library_object(type(o))


def _label(parent, child) -> str:
    """How ``child`` is reached from ``parent`` (``.name``, ``[key]``, ``<closure>``)."""
    items = vars(parent).items() if hasattr(parent, "__dict__") and type(vars(parent)) is dict else ()
    for k, v in items:
        if v is child:
            return f".{k}"
    if isinstance(parent, dict):
        for k, v in parent.items():
            if v is child:
                return f"[{k!r}]"
    if isinstance(parent, (list, tuple)):
        for i, v in enumerate(parent):
            if v is child:
                return f"[{i}]"
    if isinstance(parent, types.FunctionType):
        for name, cell in zip(parent.__code__.co_freevars, parent.__closure__ or ()):
            if cell.cell_contents is child:
                return f"<closure {name}>"
        return "<default argument>"
    return f"<{type(child).__name__}>"


def _same_key(now, then) -> bool:
    """Whether two keys say the same state; a gradient the program made anew stands for any tensor
    that held its place before (``Snapshot.same_as``)."""
    if now == then:
        return True
    return (
        now[0] == "t" == then[0]
        and now[4] == ("produced",)
        and then[4][0] in ("tensor", "produced")
        and now[:4] == then[:4]
        and now[5:] == then[5:]
    )


def _describe(key) -> str:
    text = repr(key[2:] if len(key) > 2 else key[1:])
    return f"{_KINDS.get(key[0], key[0])}: {text[:300]}"


def _id0(x) -> int:
    return 0 if x is None else id(x)


def _key_of(v):
    return _atom_key(v) if isinstance(v, _ATOMS) and not isinstance(v, enum.Enum) else ("id", id(v))


# ------------------------------------------------------------------------------------------------
# The optimizers and parameters a trace touched (extra roots)
# ------------------------------------------------------------------------------------------------
class Touched:
    """The optimizers a trace stepped and the parameters its ops read."""

    def __init__(self):
        self.optimizers: dict = {}
        self.tensors: dict = {}

    def note_tensor(self, t) -> None:
        """An op read ``t``: remember it if it is a parameter."""
        if id(t) not in self.tensors and isinstance(t, torch.nn.Parameter):
            self.tensors[id(t)] = t

    def objects(self) -> list:
        return [*self.optimizers.values(), *self.tensors.values()]


_WATCHING = threading.local()  # .seen: the Touched of the trace running on this thread, or None
_OPTIMIZER_HOOK: list = []


def _optimizer_stepped(optimizer, args, kwargs):
    seen = getattr(_WATCHING, "seen", None)
    if seen is not None:
        seen.optimizers.setdefault(id(optimizer), optimizer)


@contextlib.contextmanager
def touched():
    """Note the optimizers stepped by this thread inside the block (a global optimizer pre-hook,
    installed once: ``step()`` has no fast path, and removing it could change the dict another
    thread's ``step()`` is iterating)."""
    seen = Touched()
    if not _OPTIMIZER_HOOK:
        handle = torch_optimizer.register_optimizer_step_pre_hook(_optimizer_stepped)
        _OPTIMIZER_HOOK.append(handle)
    outer, _WATCHING.seen = getattr(_WATCHING, "seen", None), seen
    try:
        yield seen
    finally:
        _WATCHING.seen = outer
