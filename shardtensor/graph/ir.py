"""The graph's IR: a Cell holds one value; pending values are references into a graph of Nodes.

A Cell's value is a concrete ``jax.Array`` (stored padded when its sharding does not divide a
dimension), a ``Pending`` reference to an output of a recorded ``Node``, or ``Failed`` when the graph
that was to compute it failed. Several tensors may share one Cell (views, ``detach()``, ``.data``);
in-place ops replace the Cell's value.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref

from shardtensor.sharding import ShardingSpec


class Node:
    """One recorded op: ``caller(*input_values) -> tuple of outputs``.

    ``key`` identifies the computation structurally (op, static arguments, input signature), so two
    graphs made of equal keys wired the same way compile to the same program.
    """

    __slots__ = ("caller", "key", "inputs", "site", "__weakref__")

    def __init__(self, caller, key, inputs, site=None):
        self.caller = caller
        self.key = key
        self.inputs = inputs  # tuple of Pending | Leaf | ScalarLeaf
        if site is None and _SITE_FINDERS:
            site = _SITE_FINDERS[-1]()
        # (file, line) of the user's code, kept for ops with on-device checks (and every op while
        # ``noting_sites`` is active)
        self.site = site


_SITE_FINDERS: list = []  # while not empty: every new node notes the site the last one returns


@contextlib.contextmanager
def noting_sites(find_site):
    """Every node recorded inside the block (by any thread) notes ``find_site()``, the user's
    (file, line) that made it: ``st.compile``'s debug report names where two traces differ.

    Example::

        with noting_sites(inflight.user_site):
            y = x * 2          # its node's site: this line
    """
    _SITE_FINDERS.append(find_site)
    try:
        yield
    finally:
        _SITE_FINDERS.remove(find_site)


class Pending:
    """Output ``index`` of ``node``, not computed yet."""

    __slots__ = ("node", "index")

    def __init__(self, node: Node, index: int):
        self.node = node
        self.index = index


class Leaf:
    """A concrete array entering a graph; ``shape`` is the logical shape (the array may be padded)."""

    __slots__ = ("array", "shape", "cell_ref")

    def __init__(self, array, shape, cell=None):
        self.array = array
        self.shape = shape
        self.cell_ref = weakref.ref(cell) if cell is not None else None


class ScalarLeaf:
    """A Python number entering a graph as a runtime input (so new values don't recompile)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class Failed:
    """The value of a cell whose graph failed: reading it raises that error again."""  # noqa: D401

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error

    def reraise(self):
        raise self.error  # the same error the failed graph raised


class Cell:
    """Storage of one logical tensor value shared by a base tensor and its views.

    ``sharding`` is the layout the user asked for (a ``ShardingSpec``; None: let XLA choose);
    ``owned`` says the array belongs to this cell alone, so a graph that overwrites the cell may
    donate it.
    """

    __slots__ = (
        "value",
        "shape",
        "dtype",
        "sharding",
        "version",
        "owned",
        "_leaf",
        "serial",
        "layout",
        "root",
        "__weakref__",
    )
    _serials = itertools.count()  # next() is atomic: threads creating cells never share a serial
    _earlier = itertools.count(-1, -1)  # serials below every other, for cells made "before" (mark_earlier)

    def __init__(self, value, shape, dtype, sharding: ShardingSpec | None = None, owned=False):
        self.value = value
        self.shape = tuple(shape)
        self.dtype = dtype  # torch dtype
        self.sharding = sharding
        self.version = 0
        self.owned = owned
        self._leaf: Leaf | None = None
        self.layout = None  # the jax sharding an in-place update must keep (cells without a spec)
        # (strides, storage offset) torch gives the value when it is seen as storage (as_strided,
        # resize_): those of the first tensor made without a view chain; None means contiguous
        self.root: tuple[tuple[int, ...], int] | None = None
        self.serial = next(Cell._serials)  # creation order: compile() tells old cells from new ones

    def mark_earlier(self) -> None:
        """Give this cell a serial below every cell's: a value made for a call as if before it (an
        optimizer's first state, ``optim_prime``), which the call then reads as an old value and the
        programs of it and of later calls list in the same place.

        Example: ``cell.mark_earlier(); cell.serial < Cell.serial_mark()``.
        """
        self.serial = next(Cell._earlier)

    @staticmethod
    def serial_mark() -> int:
        """A serial below that of every cell created from now on (it uses one serial up)."""
        return next(Cell._serials)

    @property
    def mesh(self):
        """The mesh of the user's sharding, or None."""
        return None if self.sharding is None else self.sharding.mesh

    @property
    def spec(self):
        """The partition spec of the user's sharding (a tuple), or None."""
        return None if self.sharding is None else self.sharding.partition_spec

    def is_pending(self) -> bool:
        return isinstance(self.value, Pending)

    def leaf(self) -> Leaf:
        """The Leaf for the current concrete value (cached so a graph dedupes it cheaply)."""
        leaf = self._leaf
        if leaf is None or leaf.array is not self.value:
            leaf = self._leaf = Leaf(self.value, self.shape, self)
        return leaf
