"""``SHARDTENSOR_DEBUG=1``: why each compilation happened, and a warning when a loop keeps compiling.

Every time a graph misses the executable cache, one line goes to stderr (seen in scripts, in
``pytest -s`` and in Jupyter)::

    [shardtensor] compile #2 at train.py:41 (57 ops, 12 inputs, 9 outputs): input 0 (argument 0
    of train_step; (17, 64) float32, P('data', None)) changed shape (16, 64) -> (17, 64)
    [compared with compile #1 at train.py:41, the cached graph of the same structure nearest to it]

The comparison is with the cached graph of the same structure (the same ops wired the same way)
that differs least: input shapes, dtypes and shardings, Python scalar types, non-tensor arguments,
output layouts, donation, parameter aliasing and the mesh. No such graph: "a new graph".

When one line of user code (the innermost frame outside shardtensor, torch, jax and the standard
library) has caused more than ``RECOMPILE_WARNING_THRESHOLD`` compilations, a
``RecompilationWarning`` names that line once: a loop that compiles on every iteration spends its
time in XLA.

The variable is read on every compilation (``os.environ``), so it can be switched on mid-run.

Always, without the variable: a call site (that line of user code: the ``sync()``, the end of a
``step()``, the ``.item()`` or the call of an ``st.compile``d function) that compiles a graph of the
same structure for the third time or more logs a WARNING under the ``shardtensor`` logger, with
the count and what changed since its previous compile there (PyTorch/XLA users know this as its
recompilations). A stable loop compiles once or twice and says nothing; a cache hit costs nothing.

Example::

    SHARDTENSOR_DEBUG=1 python train.py
    logging.getLogger("shardtensor").setLevel(logging.ERROR)   # silences the recompilation warnings
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import sysconfig
import types
import warnings

import jax
import torch

ENV = "SHARDTENSOR_DEBUG"
RECOMPILE_WARNING_THRESHOLD = 8
RECOMPILES_ALLOWED = 2  # compiles of one graph structure at one call site before each further one is logged
_LOG = logging.getLogger("shardtensor")


class RecompilationWarning(UserWarning):
    """One line of user code keeps compiling new graphs (see ``SHARDTENSOR_DEBUG``)."""


def enabled() -> bool:
    """Whether ``SHARDTENSOR_DEBUG`` asks for compilation reports.

    Example::

        os.environ["SHARDTENSOR_DEBUG"] = "1"; enabled()   # True
    """
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def emit(message: str) -> None:
    """Write one debug line to stderr (looked up now, so pytest's and Jupyter's capture see it).

    Example::

        emit("hello")   # [shardtensor] hello
    """
    print(f"[shardtensor] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- naming inputs

_INPUT_NAMES: dict = {}  # id(cell) -> what the user calls it, while a compiled function is prepared


@contextlib.contextmanager
def naming(argument_cells, function_name: str):
    """While preparing the graph of ``st.compile(fn)``, name the inputs that are arguments of fn (for
    the debug report and the recompilation warning; a few dict operations per trace).

    ``argument_cells``: (argument position, storage cell) pairs.

    Example::

        with naming([(0, x._cell)], "train_step"):
            execution = Execution.prepare(cells)
    """
    names = {id(cell): f"argument {i} of {function_name}" for i, cell in argument_cells}
    _INPUT_NAMES.update(names)
    try:
        yield
    finally:
        for k in names:
            _INPUT_NAMES.pop(k, None)


# --------------------------------------------------------------------------- call sites

_LIBRARY_DIRS = None


def library_dirs() -> tuple:
    """Directories of code that is not the user's (shardtensor, torch, jax, the standard library),
    each ending with a separator, for ``str.startswith``."""
    global _LIBRARY_DIRS
    if _LIBRARY_DIRS is None:
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        dirs = [
            package,
            os.path.dirname(torch.__file__),
            os.path.dirname(jax.__file__),
            sysconfig.get_paths()["stdlib"],
        ]
        _LIBRARY_DIRS = tuple(os.path.join(d, "") for d in dirs)
    return _LIBRARY_DIRS


def call_site():
    """(filename, line, module name) of the innermost frame in user code, or None.

    Example::

        call_site()   # ('train.py', 41, '__main__') when called under train.py's st.sync()
    """
    dirs = library_dirs()
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith("<frozen") and not os.path.abspath(filename).startswith(dirs):
            return filename, frame.f_lineno, frame.f_globals.get("__name__", "")
        frame = frame.f_back
    return None


def _site_text(site) -> str:
    if site is None:
        return "<unknown>"
    return f"{os.path.basename(site[0])}:{site[1]}"


# --------------------------------------------------------------------------- comparing graphs

_HISTORY: dict = {}  # program key -> (compile number, call site text) of the compiles seen in debug mode
_SITE_COUNTS: dict = {}  # call site -> compilations it caused
_WARNED: set = set()
_COMPILES = [0]


def _split(node_key):
    """(label, encoded arguments or None) of a node key: ``(op, template)`` from the dispatcher,
    ``("view" | "scatter", ((op, template), output))`` from views, ``(name, *static)`` otherwise."""
    if not isinstance(node_key, tuple) or not node_key:
        return str(node_key), None
    head = node_key[0]
    if head in ("view", "scatter") and len(node_key) == 2 and isinstance(node_key[1], tuple):
        inner = node_key[1]
        if len(inner) == 2 and isinstance(inner[0], tuple) and len(inner[0]) == 2:
            return f"{head} {inner[0][0]}", inner[0][1]
        return head, inner
    if head == "constraint":  # (annotate.mark_sharding's key: a jax sharding, shown in the user's words)
        return "mark_sharding", node_key[1:]
    if isinstance(head, str):
        return head, node_key[1:]
    return str(head), node_key[1] if len(node_key) == 2 else node_key[1:]


def _op_label(node_key) -> str:
    return _split(node_key)[0]


def op_label(node_key) -> str:
    """The op a node key records, for people.

    Example::

        op_label(program.key[0][0][0])   # 'aten.mul.Tensor'
    """
    return _split(node_key)[0]


def _render(encoded) -> str:
    """One argument as the dispatcher encoded it, for people."""
    if isinstance(encoded, tuple) and encoded:
        tag = encoded[0]
        if tag == "T" and len(encoded) == 5:
            return "tensor"
        if tag == "S" and len(encoded) == 2:
            return "scalar"
        if tag == "C" and len(encoded) == 2:
            return "cpu scalar"
        if tag == "SL" and len(encoded) == 3:
            return f"[{encoded[1]} scalars]"
        if tag == "L" and len(encoded) == 2:
            return "[" + ", ".join(_render(e) for e in encoded[1]) + "]"
        if tag == "X" and len(encoded) in (2, 3):
            return repr(encoded[1])
    return repr(encoded)


def _arguments_text(node_key) -> str:
    _, template = _split(node_key)
    try:
        positional, keywords = template
        parts = [_render(e) for e in positional] + [f"{k}={_render(e)}" for k, e in keywords]
        return _short("(" + ", ".join(parts) + ")")
    except (TypeError, ValueError):
        readable = _readable(_strip_tensors(template))
        if isinstance(readable, tuple):
            return _short("(" + ", ".join(repr(v) for v in readable) + ")")
        return _short(readable)


class _Text(str):
    def __repr__(self) -> str:
        return str(self)


def _readable(value):
    """``value`` with each jax sharding replaced by its spec and mesh, as the user gave them."""
    if isinstance(value, tuple):
        return tuple(_readable(v) for v in value)
    if isinstance(value, jax.sharding.NamedSharding):
        return _Text(_sharding_text(value))
    return value


def _skeleton(key) -> tuple:
    """The ops and their wiring: graphs with equal skeletons differ only in metadata."""
    return tuple((_op_label(node_key), codes) for node_key, codes in key[0])


def _strip_tensors(value):
    """A node key without what is reported elsewhere: the shapes/dtypes/strides of tensor arguments
    (they follow from the inputs) and the types of runtime Python scalars."""
    if isinstance(value, tuple):
        if len(value) == 5 and value[0] == "T":
            return "T"
        if len(value) == 2 and value[0] == "S":
            return "S"
        return tuple(_strip_tensors(v) for v in value)
    return value


def _sharding_text(sharding, with_mesh=True) -> str:
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        return str(sharding)
    text = f"P({', '.join(repr(e) for e in spec)})"
    return f"{text} on mesh {dict(mesh.shape)}" if with_mesh else text


def _short(value, limit=100) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe_input(i, sig, cell) -> str:
    _, dtype, shape, sharding = sig
    name = _INPUT_NAMES.get(id(cell)) if cell is not None else None
    prefix = f"{name}; " if name else ""
    spec = tuple(cell.spec) if cell is not None and cell.spec is not None else None
    layout = f"{spec!r}" if spec is not None else _sharding_text(sharding)
    return f"input {i} ({prefix}{tuple(shape)} {dtype}, {layout})"


def _differences(new, old, leaf_cells) -> list[str]:
    """Human-readable differences between two program keys of the same skeleton."""
    new_parts, new_outs, new_leaves, new_slots, new_donated, new_mesh, new_checks, new_aliasing = new
    old_parts, old_outs, old_leaves, old_slots, old_donated, old_mesh, old_checks, old_aliasing = old
    reasons = []
    if new_aliasing != old_aliasing:
        reasons.append(
            f"parameter aliasing turned {'on' if new_aliasing else 'off'} "
            "(st.set_param_aliasing / XLA_ENABLE_PARAM_ALIASING)"
        )
    if (new_checks is None) != (old_checks is None):
        reasons.append(f"on-device checks turned {'off' if new_checks is None else 'on'} (st.set_checks)")
    elif new_checks != old_checks:
        reasons.append("another set of overwritten tensors is restored if a check fails")
    if new_mesh != old_mesh:
        reasons.append(f"the mesh changed: {dict(old_mesh.shape)} -> {dict(new_mesh.shape)}")
    if len(new_leaves) != len(old_leaves):
        reasons.append(f"the number of inputs changed: {len(old_leaves)} -> {len(new_leaves)}")
    for i, (a, b) in enumerate(zip(new_leaves, old_leaves)):
        if a == b:
            continue
        changes = []
        if tuple(a[2]) != tuple(b[2]):
            changes.append(f"shape {tuple(b[2])} -> {tuple(a[2])}")
        if a[1] != b[1]:
            changes.append(f"dtype {b[1]} -> {a[1]}")
        if a[3] != b[3]:
            same_mesh = getattr(a[3], "mesh", None) == getattr(b[3], "mesh", None)
            changes.append(f"sharding {_sharding_text(b[3], not same_mesh)} -> {_sharding_text(a[3], not same_mesh)}")
        if not changes:
            changes.append(f"stored shape {tuple(b[0])} -> {tuple(a[0])}")
        cell = leaf_cells[i] if i < len(leaf_cells) else None
        reasons.append(f"{_describe_input(i, a, cell)} changed {', '.join(changes)}")
    kinds = {"b": "bool", "i": "int", "f": "float", "c": "complex"}
    for j, (a, b) in enumerate(zip(new_slots, old_slots)):
        if a[0] != b[0]:
            reasons.append(f"Python scalar {j} changed type: {kinds[b[0]]} -> {kinds[a[0]]}")
    if [a[0] for a in new_slots] == [b[0] for b in old_slots] and new_slots != old_slots:
        reasons.append(
            "Python scalars that were equal now differ (equal values share one input; a graph stops "
            "sharing them once they differ, so this happens once)"
        )
    static = []
    for k, ((a, _), (b, _)) in enumerate(zip(new_parts, old_parts)):
        if a != b and _strip_tensors(a) != _strip_tensors(b):
            static.append(f"op {k} ({_op_label(a)}) arguments {_arguments_text(b)} -> {_arguments_text(a)}")
    if static:
        more = f" (and {len(static) - 3} more ops)" if len(static) > 3 else ""
        reasons.append("; ".join(static[:3]) + more)
    if len(new_outs) != len(old_outs):
        reasons.append(
            f"the number of outputs changed: {len(old_outs)} -> {len(new_outs)} "
            "(a different set of pending tensors is alive at this sync)"
        )
    else:
        for j, (a, b) in enumerate(zip(new_outs, old_outs)):
            if a == b:
                continue
            if a[0] != b[0]:
                reasons.append(f"output {j} is another value of the graph")
            if a[2] != b[2]:
                reasons.append(f"output {j} layout {_sharding_text(b[2])} -> {_sharding_text(a[2])}")
            if a[1] != b[1]:
                reasons.append(f"output {j} padding {b[1]} -> {a[1]}")
    if new_donated != old_donated:
        gone = sorted(set(old_donated) - set(new_donated))
        added = sorted(set(new_donated) - set(old_donated))
        text = []
        if added:
            text.append(f"input(s) {added} now donated")
        if gone:
            text.append(
                f"input(s) {gone} no longer donated (another tensor still uses the buffer, "
                "or the update changes its layout)"
            )
        reasons.append("donation changed: " + "; ".join(text))
    if not reasons:
        # only tensor metadata inside node keys differs (e.g. strides of a view)
        changed = [k for k, ((a, _), (b, _)) in enumerate(zip(new_parts, old_parts)) if a != b]
        reasons.append(f"the tensor arguments of op(s) {changed[:5]} changed (shape, dtype or strides)")
    return reasons


def _nearest(key, executables):
    """The cached key of the same skeleton with the fewest differences, or None."""
    skeleton, best, best_score = None, None, None
    n_ops = len(key[0])
    for other in executables:
        if len(other[0]) != n_ops:
            continue
        if skeleton is None:
            skeleton = _skeleton(key)
        if _skeleton(other) != skeleton:
            continue
        # every changed input attribute counts, so a graph with one change beats one with three
        score = (
            sum((a[2] != b[2]) + (a[1] != b[1]) + (a[3] != b[3]) for a, b in zip(key[2], other[2]))
            + (key[1] != other[1])
            + (key[3] != other[3])
            + (key[4] != other[4])
            + (key[5] != other[5])
            + (key[6] != other[6])
            + (key[7] != other[7])
            + sum(a[0] != b[0] for a, b in zip(key[0], other[0]))
        )
        if best_score is None or score <= best_score:  # ties: the most recent
            best, best_score = other, score
    return best


def explain(program, leaf_cells, executables) -> str:
    """Report why ``program`` is being compiled (called on an executable-cache miss in debug mode).

    Returns the line it wrote (tests read it). Example::

        explain(program, leaf_cells, execute._EXECUTABLES)
    """
    key = program.key
    _COMPILES[0] += 1
    number = _COMPILES[0]
    site = call_site()
    where = _site_text(site)
    shape = f"{len(key[0])} ops, {len(key[2])} inputs, {len(key[1])} outputs"
    nearest = _nearest(key, executables)
    before = _SITE_COUNTS.get(site[:2], 0) if site is not None else 0
    if nearest is None:
        why = "a new graph (no cached graph has the same ops)"
        if before:
            why = why[:-1] + f"; this line compiled {before} other graph(s) before)"
    else:
        reasons = _differences(key, nearest, leaf_cells)
        seen = _HISTORY.get(nearest)
        other = f"compile #{seen[0]} at {seen[1]}" if seen else "a graph compiled earlier"
        why = "; ".join(reasons) + f" [compared with {other}, the cached graph of the same structure nearest to it]"
    if len(_HISTORY) > 100_000:  # debug runs of huge sweeps: forget the oldest half
        for old in list(_HISTORY)[:50_000]:
            del _HISTORY[old]
    _HISTORY[key] = (number, where)
    line = f"compile #{number} at {where} ({shape}): {why}"
    emit(line)
    if site is not None:
        count = _SITE_COUNTS[site[:2]] = before + 1
        if count > RECOMPILE_WARNING_THRESHOLD and site[:2] not in _WARNED:
            _WARNED.add(site[:2])
            warnings.warn_explicit(
                f"shardtensor: this line has compiled {count} different graphs; a loop that compiles "
                f"every iteration spends its time in XLA. Last reason: {why}. Keep input shapes, "
                "dtypes, shardings and Python scalar types fixed from one iteration to the next "
                "(pad the last batch, or drop it).",
                RecompilationWarning,
                site[0],
                site[1],
                module=site[2],
            )
    return line


# --------------------------------------------------------------------------- recompilation log

_BY_SITE: dict = {}  # (file, line, skeleton hash) -> [compiles, the key compiled last]
_BY_SITE_LIMIT = 20_000  # distinct (line, structure) pairs remembered (a huge sweep forgets the oldest half)


def _generation_hint(site) -> str:
    """Hugging Face's decoding loop grows its tensors every token: name the way out."""
    if site is None or not str(site[2]).startswith("transformers.generation"):
        return ""
    return (
        " In Hugging Face generate, every new token is a new shape: st.generate(model, input_ids, ...) "
        "runs it as two programs (docs/generation.md)."
    )


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def note_compile(program, leaf_cells) -> str | None:
    """Count a compile (an executable-cache miss) against its call site and graph structure; from the
    third of one structure at one site on, log a WARNING with what changed since the previous one.

    Returns the message logged, or None. Example::

        note_compile(program, leaf_cells)   # on each cache miss, before compiling
    """
    key = program.key
    site = call_site()
    entry_key = (*(site[:2] if site is not None else (None, None)), hash(_skeleton(key)))
    entry = _BY_SITE.get(entry_key)
    if entry is None:
        if len(_BY_SITE) >= _BY_SITE_LIMIT:
            for old in list(_BY_SITE)[: _BY_SITE_LIMIT // 2]:
                del _BY_SITE[old]
        entry = _BY_SITE[entry_key] = [0, None]
    entry[0] += 1
    previous, entry[1] = entry[1], key
    if entry[0] <= RECOMPILES_ALLOWED or not _LOG.isEnabledFor(logging.WARNING):
        return None
    if key == previous:
        why = "the same graph again, evicted from the executable cache meanwhile (st.set_executable_cache_size)"
    else:
        why = "; ".join(_differences(key, previous, leaf_cells))
    message = (
        f"{_site_text(site)} compiled a graph of the same structure for the {_ordinal(entry[0])} time "
        f"({len(key[0])} ops): {why} [since its previous compile there]. Each compile spends time in "
        "XLA: keep input shapes, dtypes, shardings and Python scalar types fixed from one call to the "
        f"next (pad the last batch, or drop it).{_generation_hint(site)}"
    )
    _LOG.warning("%s", message)
    return message
