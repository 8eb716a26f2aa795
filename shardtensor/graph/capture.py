"""The two entries the features above the engine build on: ``capture`` records what a block of code
does without running it, and ``lower`` turns a set of cells into a program that can be compiled,
inspected or exported without running it.

``st.compile`` captures a call to trace it, ``st.export`` captures one to export it, and
``st.explain`` captures one to show its shardings; none of them touches the engine's private state.
Lowering and compiling have JAX's 64-bit types on (``runtime.with_x64``); the captured block itself
runs with the caller's setting (its ops enter the engine through the dispatch entry).

Example::

    with capture() as seen:
        y = model(x)
    lowered = lower(seen.pending())          # every value the block left pending
    lowered.compile().output_shardings       # what XLA chose, nothing run
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as JaxSpec

from shardtensor.graph.execute import cached_executable
from shardtensor.graph.ir import Cell
from shardtensor.graph.program import Program
from shardtensor.graph.state import STATE, pending_cells
from shardtensor.runtime import with_x64


class Capture:
    """What a ``capture()`` block recorded: which cells it created, which existing ones it wrote."""

    def __init__(self):
        self.first_serial = Cell.serial_mark()  # cells made inside the block have this serial or more
        self._before = {c.serial: c.version for c in pending_cells()}
        self.broken = None  # with tracing=True: why the block cannot be replayed without its Python
        self.uploads: list = []  # with tracing=True: (CPU tensor, Upload, cell) for each upload in the block

    def is_new(self, cell: Cell) -> bool:
        """Whether ``cell`` was created inside the block."""
        return cell.serial >= self.first_serial

    def pending(self) -> list:
        """Every cell whose value the block left pending (new, or updated in place), oldest first."""
        return [c for c in pending_cells() if self._before.get(c.serial) != c.version]

    def updated(self) -> list:
        """The cells that existed before the block and that it updated in place (still pending)."""
        return [c for c in self.pending() if not self.is_new(c)]


@contextlib.contextmanager
def capture(*, tracing: bool = False, guard: str | None = None):
    """Record what the block does, running nothing of it (whatever mode the caller is in).

    ``tracing``: the block is a call of ``st.compile``; ``Capture.broken`` then says why it cannot be
    replayed without running its Python (a value computed inside, a CPU tensor updated ...).
    ``guard``: a message for ``UnexpectedExecutionError`` if anything inside needs a value.

    Example::

        with capture() as seen:
            loss = model(x).sum()
        seen.pending()   # the cells to compute
    """
    seen = Capture()
    previous = (STATE.eager, STATE.tracing, STATE.execution_guard, STATE.trace_broken, STATE.trace_uploads)
    STATE.eager = False
    if tracing:
        STATE.tracing, STATE.trace_broken, STATE.trace_uploads = True, None, []
    if guard is not None:
        STATE.execution_guard = guard
    try:
        yield seen
        if tracing:
            seen.broken = STATE.trace_broken
            seen.uploads = STATE.trace_uploads or []
    finally:
        STATE.eager, STATE.tracing, STATE.execution_guard, STATE.trace_broken, STATE.trace_uploads = previous


@dataclasses.dataclass
class Lowered:
    """The program computing some cells, with its current input values; nothing compiled or run yet.

    ``arrays``: the concrete input arrays in program order; ``scalars``: the Python scalar inputs,
    one vector per kind; ``leaf_cells``: the cell behind each input array (None for constants).
    """

    program: Program
    arrays: list
    scalars: dict
    leaf_cells: list
    _jitted: object = dataclasses.field(default=None, init=False, repr=False)

    @property
    def mesh(self):
        """The jax mesh the program runs on."""
        return self.program.mesh

    def jitted(self):
        """The jitted function: the cached one if this graph was compiled before, else a new one
        outside the cache (a later run of the same graph compiles and counts as usual)."""
        if self._jitted is None:
            self._jitted = cached_executable(self.program.key) or self.program.make_executable()
        return self._jitted

    @with_x64
    def abstract_arguments(self):
        """(donated, kept, scalar vectors) as shapes, dtypes and shardings: what ``jitted`` takes."""
        program = self.jitted().program
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in self.arrays]
        replicated = NamedSharding(program.mesh, JaxSpec())  # scalars travel replicated
        vectors = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for k, v in self.scalars.items()}
        return [avals[i] for i in program.donated], [avals[i] for i in program.kept], vectors

    @with_x64
    def compile(self):
        """The compiled program (``jax.stages.Compiled``): output shardings, HLO text, memory."""
        return self.jitted().lower(*self.abstract_arguments()).compile()


@with_x64
def lower(cells, donate: bool = False, checks: bool | None = None) -> Lowered:
    """The program that computes the pending values of ``cells`` (``donate``: may reuse the buffers
    of the cells it overwrites, as a real run does; ``checks``: with the on-device checks' output,
    by default as a run would have them — its results are then ``(values, check rows)``).

    Example::

        lower([t._cell]).compile().as_text()
    """
    program, arrays, scalars = Program.build(cells, donate, checks)
    leaf_cells, program.leaf_cells = program.leaf_cells, None  # a program must keep no cells alive
    program.moved = []  # (nor the arrays as they were before a copy onto its mesh)
    return Lowered(program, arrays, scalars, leaf_cells)
