"""A traced ``st.compile`` call (``Trace``) and its frozen replay (``Frozen``).

``compiler.CompiledFunction`` traces a call in lazy mode and builds a ``Trace`` of it: which tensors
the program read (arguments, tensors from before the call, values made during it, CPU tensors and
learning rates uploaded anew by each replay) and where each output goes. A trace freezes into a
``Frozen``, which later calls run without their Python: it feeds the current values in, runs the
executable and stores the results back, as long as the guarded Python state and the inputs'
geometry are what the trace saw (else ``STALE``: the caller traces again).

Example::

    frozen = trace.freeze(guard, "train_step")
    result = frozen.replay(flat_args, "train_step")     # STALE: run the function instead
"""

from __future__ import annotations

import operator
import weakref
from array import array
from typing import Any

import torch
from torch.utils import _pytree as pytree

from shardtensor import metrics as counters
from shardtensor.graph import checks, early_rows, execute, inflight, memory, mesh_moves, rng
from shardtensor.graph.aliasing import param_aliasing_enabled
from shardtensor.graph.interrupts import deferred_interrupts
from shardtensor.graph.ir import Cell, Failed
from shardtensor.graph.program import to_mesh
from shardtensor.graph.state import STATE, locked, others_pending, set_failed
from shardtensor.ops.checks import checks_enabled
from shardtensor.replay_check import Guard, picker
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor import device as torch_device
from shardtensor.tensor.geometry import contiguous_strides

STALE = object()  # what a replay returns when the call must run its Python instead
NATIVE_PASSES = True  # the C++ gather and store passes, when the extension has them (tests turn them off)


class Trace:
    """What one traced call read, wrote and returned, and whether that can be replayed."""

    def __init__(self, execution, flat_args, out, first_serial, broken, hosts=None):
        """``hosts``: id of a cell a replay uploads anew -> (what from: a CPU tensor argument's
        position, or an optimizer's ``LiveValue``; how: ``Upload``)."""
        self.execution, self.broken = execution, broken
        hosts = hosts or {}
        arg_cells = {id(x._cell): i for i, x in enumerate(flat_args) if isinstance(x, ShardedTensor)}
        if any(isinstance(x, ShardedTensor) and x._chain for x in flat_args):
            self.broken = self.broken or "an argument is a view"
        self.out_flat, self.out_spec = pytree.tree_flatten(out)
        returned = {}
        for i, x in enumerate(self.out_flat):
            if isinstance(x, torch.Tensor):
                if not isinstance(x, ShardedTensor) or x._chain:
                    self.broken = self.broken or "it returns a CPU tensor or a view"
                elif x.requires_grad:
                    self.broken = self.broken or "it returns a tensor that requires grad"
                else:
                    returned[id(x._cell)] = i
        program = execution.program if execution else None
        sources, targets = [], []
        self._made: set = set()  # ids of the cells the program computes that the call made
        if program is not None:
            donated = set(program.donated)
            for leaf_i, cell in enumerate(execution.leaf_cells):
                array = execution.arrays[leaf_i]
                if cell is not None and id(cell) in hosts:  # (uploaded anew by each replay)
                    sources.append(("host", *hosts[id(cell)], array.sharding))
                    continue
                sources.append(_source(cell, array, arg_cells, first_serial, leaf_i in donated))
            if any(s[0] == "const" and s[1] for s in sources):
                self.broken = self.broken or (
                    "a value it makes on the host (a CPU tensor moved to the device) is updated in place by "
                    "the program: a replay could not feed it again (pass it as an argument)"
                )
            new_count = 0
            for cell in execution.cells:
                if id(cell) in arg_cells:
                    targets.append(("arg", arg_cells[id(cell)]))
                elif id(cell) in returned:
                    targets.append(("ret", returned[id(cell)]))
                elif cell.serial < first_serial:
                    targets.append(("old", id(cell)))
                else:
                    targets.append(("new", new_count))
                    self._made.add(id(cell))
                    new_count += 1
        for x in self.out_flat:
            if (
                isinstance(x, ShardedTensor)
                and id(x._cell) in returned
                and not (execution and any(c is x._cell for c in execution.cells))
            ):
                self.broken = self.broken or "it returns a tensor it did not compute"
        self.sources, self.targets = sources, targets

    def freeze(self, guard, name="compiled"):
        return Frozen(self, guard, name)

    def made_cells(self) -> frozenset:
        """The ids of the cells made in the call whose values the program computes (not returned):
        a gradient made anew, say, which a replay computes into the same cell."""
        return frozenset(self._made)


def _source(cell, array, arg_cells, first_serial, donated):
    """Where input ``array`` comes from: ("arg", position, None), ("old", id, weak cell), or
    ("const", donated, array) for a value made during the call from what the guard watches
    (``torch.tensor(data, device=...)``): the Python, run again from the same state, would make it
    again, so a replay feeds it as it is (unless the program gives its buffer up: ``donated``)."""
    if cell is not None and id(cell) in arg_cells:
        return ("arg", arg_cells[id(cell)], None)
    if cell is not None and cell.serial < first_serial:
        return ("old", id(cell), weakref.ref(cell))
    return ("const", donated, array)


class Frozen:
    """A replayable trace: where each input comes from and where each output goes.

    What a replay does per call is prepared here once: the positions of the arguments it reads, in
    the program's order, and what it last checked. A replay reads each input's array and compares
    it, by identity, with the array that input held when last checked (or that the last replay
    wrote into it: a decode step's KV cache); only an array that differs is checked in full (its
    cell computed, its shape, dtype and layout the program's).
    """

    def __init__(self, trace: Trace, guard: Guard, name: str = "compiled"):
        self.guard = guard  # the Python state the replay assumes (replay_guard)
        ex = trace.execution
        self.executable = ex.executable if ex else None
        self.scalars = ex.scalars if ex else {}
        self.sources = trace.sources
        self.out_flat, self.out_spec = trace.out_flat, trace.out_spec
        # (kind, index, weak reference to the cell of an "old" or "new" target, None for the others)
        self.targets: list[tuple[str, int, Any]] = []
        for target, cell in zip(trace.targets, ex.cells if ex else ()):
            kind = target[0]
            self.targets.append((kind, target[1], None if kind in ("arg", "ret") else weakref.ref(cell)))
        self.leaf_sigs = ex.program.key[2] if ex else ()
        self.sites = ex.sites if ex else None  # the traced call's user lines of checked ops
        self.donated = set(ex.program.donated) if ex else set()
        # (target, source) positions of the cells it overwrites (their values before a replay are kept)
        leaf_of = {id(c): i for i, c in enumerate(ex.leaf_cells) if c is not None} if ex else {}
        self.overwrites = [(j, leaf_of[id(c)]) for j, c in enumerate(ex.cells if ex else ()) if id(c) in leaf_of]
        self.what = f"compiled function {name} ({len(ex.program.steps)} ops)" if ex else name
        self._prepare()

    def _prepare(self) -> None:
        """The per-call plumbing, in "read order": the arguments' cells, then the other old cells,
        then the constants (``_order`` maps it to the program's input order)."""
        sources = self.sources
        args = [i for i, s in enumerate(sources) if s[0] == "arg"]
        olds = [i for i, s in enumerate(sources) if s[0] == "old"]
        consts = [i for i, s in enumerate(sources) if s[0] not in ("arg", "old")]
        order = args + olds + consts  # read position -> source position
        self._read_sources = order
        self._pick_args = picker([sources[i][1] for i in args])
        self._old_refs = [sources[i][2] for i in olds]
        self._consts = [sources[i][2] if sources[i][0] == "const" else None for i in consts]
        # CPU tensor arguments moved to the devices inside: (position among the constants, the
        # argument's position, how it was uploaded); each replay uploads the argument again
        self._hosts = [(k, *sources[i][1:]) for k, i in enumerate(consts) if sources[i][0] == "host"]
        self._cells_read = len(args) + len(olds)
        # the same, for the C++ pass (``replay_gather``): argument positions, old cells, constants
        self._gather_plan = (tuple(sources[i][1] for i in args), tuple(self._old_refs), tuple(self._consts))
        read_of = {i: r for r, i in enumerate(order)}
        program = self.executable.program if self.executable is not None else None
        self._donated_reads = picker([read_of[i] for i in sorted(self.donated)])
        self._donated_read_at = tuple(read_of[i] for i in sorted(self.donated))
        # the program's donated and kept inputs, picked from the read order
        donated, kept = (program.donated, program.kept) if program is not None else ((), ())
        self._call_order = (picker([read_of[i] for i in donated]), picker([read_of[i] for i in kept]))
        # (the same positions packed for ``replay_gather``, which then picks the two lists itself)
        self._call_packed = tuple(array("q", [read_of[i] for i in part]).tobytes() for part in (donated, kept))
        # per cell read: a weak reference to the array that passed every check as it was (jax arrays
        # are immutable: the same one passes again); a constant always passes
        self._passed: list = [_NOTHING] * self._cells_read
        self._written = [(j, read_of[i]) for j, i in self.overwrites]
        self._written_fit: list | None = None  # the (target, read position) whose output passes as that input
        self._scalar_arrays: dict | None = None  # the scalar vectors on the devices, made by the first replay
        spec = self.out_spec  # a tuple or list of tensors (a Dynamo graph's) is built without pytree
        self._plain_out = spec.type in (tuple, list) and all(c.is_leaf() for c in spec.children())
        # how a replay stores each output (``_store``): per target, whether its cell owns the array
        # afterwards (an input passed through is shared) and whether its value before is kept (an
        # overwritten input: given back if the run fails); the returned tensors' templates
        forwarded = program.forwarded if program is not None else set()
        kept_before = {j for j, _ in self.overwrites}
        self._stores: list[tuple[str, int, Any, Any, bool, bool]] = []
        self._returns: list[tuple[int, Any]] = []  # (position in the results, its template), in target order
        for j, (kind, ident, ref) in enumerate(self.targets):
            made: Any = None
            if kind == "ret":
                old = self.out_flat[ident]
                shape = tuple(old.shape)
                made = (shape, old.dtype, old._cell, ("T", shape, old.dtype, contiguous_strides(shape), 0))
                self._returns.append((ident, made))
            self._stores.append((kind, ident, ref, made, j not in forwarded, j in kept_before))
        # the same for the C++ pass (``replay_store``): (0 argument / 1 returned / 2 weak reference,
        # position, reference, owned, keep), and after the first replay the read position whose
        # ``passed`` entry its output becomes (-1: none; ``_find_written_fit``)
        codes = {"arg": 0, "ret": 1}
        self._store_plan: tuple[tuple, ...] = tuple((codes.get(k, 2), i, r, o, b) for k, i, r, _, o, b in self._stores)
        self._computed = picker([j for j in range(len(self.targets)) if j not in forwarded])
        # the C++ passes when the extension has them (else the Python below, which does the same)
        self._native = torch_device.EXT if NATIVE_PASSES and hasattr(torch_device.EXT, "replay_store") else None

    def stale_reason(self) -> str:
        """Why the last replay could not run (for SHARDTENSOR_DEBUG)."""
        return getattr(self, "_stale", None) or f"what it read of the Python state changed: {self.guard.failing()}"

    @locked
    def replay(self, flat, name, tensors=None, own_checks=False):
        """Run the frozen program on the current values (``STALE``: the call must run ``fn``);
        ``tensors``: the sharded tensors among ``flat`` when the caller knows them; ``own_checks``:
        the caller raises this run's failed checks before it returns (its rows may then come from a
        program of their own run first, ``graph.early_rows``, so that waiting for them does not wait
        for this run)."""
        if tensors is None:
            tensors = [x for x in flat if isinstance(x, ShardedTensor)]
        if not self.guard.holds(tensors):
            return STALE  # the Python would now do something else: run it
        if self.executable is None:
            return pytree.tree_unflatten(list(self.out_flat), self.out_spec)
        program = self.executable.program
        if program.checks != checks_enabled():  # st.set_checks changed: trace again
            return STALE
        if program.aliasing != param_aliasing_enabled():  # st.set_param_aliasing changed
            return STALE
        rng.settle()  # a seed given since the last draw: the key's cell is read below
        passed = self._passed
        native = self._native
        if self._hosts:  # (the arguments' current values, uploaded as the trace uploaded them)
            self._refresh_uploads(flat)
        if native is not None:
            if type(flat) is not list:
                flat = list(flat)
            gathered = native.replay_gather(flat, *self._gather_plan, passed, self._donated_read_at, *self._call_packed)
            if gathered is None:  # (a closed-over cell died)
                return STALE
            cells, values, unchanged, owned, donated, kept = gathered
        else:
            cells, values = self._gather(flat)
            if cells is None:
                return STALE
            unchanged, owned = all(map(operator.is_, values, map(operator.call, passed))), None
            donated = kept = None
        if not unchanged:
            if not self._check(cells, values, program):
                return STALE
            owned = donated = kept = None  # (a check may have moved a value: ownership is read again)
        if owned is None:
            owned = all(map(_OWNED, self._donated_reads(cells)))
        if not owned:
            return STALE  # a donated input's buffer is shared with another tensor now
        if self.donated and others_pending():
            return STALE  # another thread's pending graph may read a buffer the program donates
        # A failed check of an earlier run, or a failed earlier run, raises before this one runs.
        # Only now: reading the checks waits for those runs, and the host work above then overlaps
        # the devices' (if it raises, nothing above has changed a value)
        checks.verify(wait_late=False)  # (a run's own rows, when its early ones passed: once ready)
        inflight.settle()  # (at most max_in_flight() runs stay queued)
        counters.increment("CompileReplay")
        memory.check(getattr(self.executable, "memory", None), self.what)
        scalars = self._scalar_arrays
        if scalars is None:
            scalars = self._scalar_arrays = execute.device_scalars(program, self.scalars)
        if donated is None or kept is None:  # (the C++ pass picks them when it read the values as they are)
            donated_at, kept_at = self._call_order
            # (lists, as the program was lowered with: a tuple would be another signature for jit)
            donated, kept = list(donated_at(values)), list(kept_at(values))
        # (its rows' own program runs first: the program donates what it reads)
        early = early_rows.dispatch(self.executable, donated, kept, scalars) if own_checks else None
        with deferred_interrupts():  # from donating the inputs to storing every output
            try:
                outs = execute.call_prepared(self.executable, donated, kept, scalars)
            except Exception as error:
                out_cells, _ = self._targets(flat)
                _consumed_by_failed_call(out_cells, self._before(out_cells), self.what, error)
                raise
            # (the cells it writes, made or read while the program runs: they still hold their values)
            results = self._store(flat, outs, program, early)
        fitting = self._written_fit
        if fitting is None or native is None:  # (with the C++ pass, the store sets them after the first)
            if fitting is None:
                fitting = self._find_written_fit(outs, program)
            for j, r in fitting:  # what it wrote into its inputs passes as those inputs next time
                passed[r] = weakref.ref(outs[j])
        return self._result(results)

    def _refresh_uploads(self, flat) -> None:
        for k, source, how, sharding in self._hosts:
            # (an argument by its position, or an optimizer's live hyperparameter: optim_steps.LiveValue),
            # placed as the traced call's input was (on the program's mesh)
            self._consts[k] = how.array(flat[source], sharding) if type(source) is int else source.array(how, sharding)
        self._gather_plan = (*self._gather_plan[:2], tuple(self._consts))

    def _find_written_fit(self, outs, program) -> list:
        """The (target, read position) pairs whose output passes as that input (the program's outputs
        have fixed layouts: found once); the C++ store's plan then takes their read positions."""
        fitting = self._written_fit = [
            (j, r) for j, r in self._written if self._fits(outs[j], self._read_sources[r], program)
        ]
        read_at = dict(fitting)
        self._store_plan = tuple((*t, read_at.get(j, -1)) for j, t in enumerate(self._store_plan))
        return fitting

    def _result(self, results):
        """The call's result, from its flat ``results``."""
        if self._plain_out:
            return self.out_spec.type(results)
        return pytree.tree_unflatten(results, self.out_spec)

    def _gather(self, flat) -> tuple[list | None, list]:
        """(the cells read, their values then the constants), or (None, []) if a closed-over cell
        died: ``replay_gather``'s pass in Python."""
        cells = list(map(_CELL, self._pick_args(flat)))
        if self._old_refs:  # (the closed-over tensors' cells: a model's parameters, a cache)
            olds = list(map(operator.call, self._old_refs))
            if None in olds:  # (cells compare by identity)
                return None, []
            cells += olds
        values = list(map(_VALUE, cells))
        values += self._consts
        return cells, values

    def _store(self, flat, outs, program, early=None) -> list:
        """Give each output to its cell, as ``assign_outputs`` does (the run noted in flight with
        what it overwrites, its check rows kept to read, ``early``: its rows from their own program),
        in one pass; returns the call's results (new tensors for the new values it returns)."""
        if self._native is not None:
            results = list(self.out_flat)
            made = []
            for ident, template in self._returns:
                results[ident], cell = _new_result(template)
                made.append(cell)
            cells, refs, befores, owned = self._native.replay_store(self._store_plan, flat, outs, made, self._passed)
        else:
            cells, refs, befores, owned, results = self._give(flat, outs)
        entries = inflight.Entries(refs, outs, befores, owned)
        if STATE.pending:  # (values of this thread recorded since the call began: none are these cells)
            for cell in cells:
                if cell is not None:
                    STATE.pending.pop(weakref.ref(cell), None)
        rows = getattr(outs, "check_rows", None)
        # the run's outputs, check rows last: ``outs`` itself, no copy of a list as long as the
        # targets (the entries' columns and the results read only its first len(targets))
        outputs = outs if isinstance(outs, list) else list(outs)
        if rows is not None:
            outputs.append(rows)
            # (``inflight.settle`` probes the first computed result not donated since: the check
            # rows, never donated, are that one whenever there are rows)
            computed = [rows]
        else:
            computed = list(self._computed(outs))
        waits = not program.aliasing and entries.keeps()
        run = inflight.note(self.what, entries, outputs, computed, waits)
        STATE.epoch += 1
        if rows is not None:
            checks.watch(program, rows, self.sites, cells, outs, early, refs, run)
        return results

    def _give(self, flat, outs) -> tuple[list, list, list, list, list]:
        """(cells, refs, befores, owned, results): ``replay_store``'s pass in Python."""
        results = list(self.out_flat)
        cells: list = []
        refs: list = []
        befores: list = []
        owned_before: list = []
        for (kind, ident, ref, made, owned, keep), out in zip(self._stores, outs):
            if kind == "arg":
                cell = flat[ident]._cell
                ref = weakref.ref(cell)
            elif kind == "ret":
                results[ident], cell = _new_result(made)
                ref = weakref.ref(cell)
            else:  # (a closed-over cell: its weak reference is kept)
                cell = ref()
                if cell is None:
                    for column in (cells, refs, befores, owned_before):
                        column.append(None)
                    continue
            cells.append(cell)
            refs.append(ref)
            befores.append(cell.value if keep else None)
            owned_before.append(cell.owned)
            cell.value = out
            cell._leaf = None
            cell.owned = owned
            cell.version += 1
        return cells, refs, befores, owned_before, results

    def _targets(self, flat) -> tuple[list, list]:
        """(the cell each output goes to, the call's results: new tensors for the new values it returns)."""
        out_cells, results = [], list(self.out_flat)
        for kind, ident, ref in self.targets:
            if kind == "arg":
                cell = flat[ident]._cell
            elif kind == "ret":
                old = self.out_flat[ident]
                cell = Cell(None, old.shape, old.dtype, old._cell.sharding)
                results[ident] = ShardedTensor(cell)
            else:
                cell = ref()
            out_cells.append(cell)
        return out_cells, results

    def _before(self, out_cells) -> dict:
        """id(cell) -> the value each cell the program overwrites holds before it stores its outputs."""
        return {id(out_cells[j]): out_cells[j].value for j, _ in self._written if out_cells[j] is not None}

    def _check(self, cells, values, program) -> bool:
        """Check in full the inputs whose array changed since they last passed (``values`` takes
        the copy of one moved onto the program's mesh); False if the replay cannot run."""
        passed = self._passed
        newly = []
        for r in range(self._cells_read):
            value = values[r]
            if passed[r]() is value:
                continue
            cell = cells[r]
            i = self._read_sources[r]
            if cell.is_pending() or isinstance(value, Failed) or (i in self.donated and not cell.owned):
                return False  # (a failed value raises when the Python reads it)
            on_mesh = to_mesh(value, program.mesh)
            if on_mesh is not value:  # copied onto the program's mesh: keep it there if we can
                mesh_moves.keep_moved(cell, value, on_mesh, program.mesh)
            if not self._fits(on_mesh, i, program):
                # the same layout under another name (jax compiles one program per name) is renamed;
                # a donated input is not (its buffers would be consumed under two names)
                if i in self.donated or (on_mesh.shape, on_mesh.dtype) != self.leaf_sigs[i][:2]:
                    return False
                on_mesh = mesh_moves.renamed(cell, on_mesh, self.leaf_sigs[i][3])
                if on_mesh is None:
                    return False
            if cell.value is on_mesh:
                newly.append((r, on_mesh))
            values[r] = on_mesh
        for r, value in newly:
            passed[r] = weakref.ref(value)
        return True

    def _fits(self, array, source: int, program) -> bool:
        """Whether ``array`` has the shape, dtype and layout the program takes at input ``source``."""
        sig = self.leaf_sigs[source]
        return (array.shape, array.dtype) == sig[:2] and array.sharding == sig[3]


def _new_result(template) -> tuple[ShardedTensor, Cell]:
    """A new tensor (and its cell) for a value the replay returns: ``template`` is (shape, dtype, the
    traced result's cell, whose sharding it takes now, its template entry)."""
    cell = Cell(None, template[0], template[1], template[2].sharding)
    return ShardedTensor._result(cell, template[3]), cell


def _nothing():
    return None


_NOTHING = _nothing  # what no input has passed yet (never an array)
_CELL = operator.attrgetter("_cell")
_VALUE = operator.attrgetter("value")
_OWNED = operator.attrgetter("owned")


def _consumed_by_failed_call(cells, before, what, error) -> None:
    """A replay's call failed at once: cells whose donated buffer it took raise ``ConsumedInputError``
    (the others still hold their values from before it)."""
    for cell in cells:
        old = before.get(id(cell)) if cell is not None else None
        if old is not None and old.is_deleted():
            set_failed(cell, Failed(inflight.consumed_error(what, cell, error)))
