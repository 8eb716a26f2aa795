"""The random-number state: one JAX PRNG key in a Cell that every graph drawing numbers reads and
writes, so each call gives new numbers and a seed reproduces them whatever the mesh or spec.

Example::

    st.manual_seed(0)        # or torch.manual_seed(0)
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as JaxSpec

from shardtensor.graph.execute import run_cells
from shardtensor.graph.ir import Cell
from shardtensor.graph.state import STATE, locked, set_concrete, set_pending
from shardtensor.mesh import default_mesh
from shardtensor.runtime import check_not_forked

_CELL: Cell | None = None
_NUMBERS = itertools.count(1)
_REQUESTED: tuple = (0, None)  # (number, seed) of the latest manual_seed; seed None: torch's initial seed
_APPLIED = [-1]  # the number of the request the key was last built from


def _cell() -> Cell:
    if _REQUESTED[0] != _APPLIED[0]:  # (the only cost on every draw: one comparison)
        check_not_forked("draw random numbers")  # before the lock, which the fork may have left held
        _build_key()
    assert _CELL is not None
    return _CELL


def manual_seed(seed: int) -> None:
    """Reset the key from ``seed``. The key is built when numbers are next drawn, so seeding (also
    through ``torch.manual_seed``) never starts JAX: plain torch code keeps a single-threaded process.

    Example::

        st.manual_seed(1234)
    """
    global _REQUESTED
    _seeded_in_trace()
    _REQUESTED = (next(_NUMBERS), int(seed) % (2**63))  # one assignment: safe without the engine lock


def _seeded_in_trace() -> None:
    """A seed set inside an st.compile trace: each call must start its draws from it again, which a
    replay (reading the key as the last call left it) would not."""
    if STATE.tracing:
        STATE.trace_broken = STATE.trace_broken or "it seeds the random number generator"


@locked
def _build_key() -> None:
    """The key from the latest seed, kept replicated over all devices (a key committed to one device
    would make a later jit over the mesh fail)."""
    global _CELL
    number, seed = _REQUESTED
    if number == _APPLIED[0]:  # another thread built it while this one waited for the lock
        return
    if seed is None:
        seed = torch.initial_seed() % (2**63)
    sharding = NamedSharding(default_mesh().get_jax_mesh(), JaxSpec())
    if _CELL is not None and hasattr(_CELL.value, "sharding"):
        sharding = _CELL.value.sharding  # keep the layout, so compiled programs stay valid
    key = jax.device_put(jax.random.PRNGKey(seed), sharding)
    if _CELL is None:
        _CELL = Cell(key, (2,), None, owned=True)
    else:
        set_concrete(_CELL, key, owned=True)
    _APPLIED[0] = number


def settle() -> None:
    """Apply a seed given since the key was last used (for a compiled replay, which reads the key's
    cell directly); nothing if no number was ever drawn."""
    if _CELL is not None and _REQUESTED[0] != _APPLIED[0]:
        _cell()


def current():
    """The key's value reference for a node that draws random numbers."""
    cell = _cell()
    return cell.value if cell.is_pending() else cell.leaf()


def advance(ref) -> None:
    """The key after a draw."""
    set_pending(_cell(), ref)


def pending_cells() -> list:
    if _CELL is None:  # no number drawn yet: nothing to compute (and no reason to start JAX)
        return []
    cell = _cell()
    return [cell] if cell.is_pending() else []


@locked
def set_state(state: np.ndarray) -> None:
    """Restore a key saved by ``get_state`` (keeping the current layout)."""
    _seeded_in_trace()
    cell = _cell()
    layout = cell.layout if cell.is_pending() else getattr(cell.value, "sharding", None)
    if not isinstance(layout, NamedSharding):
        # A pending key is overwritten unread (the draws that advanced it keep their own input key,
        # so their numbers stay pending and unchanged): no program for it. Computed only when its
        # layout is not known without it.
        run_cells([cell])
        layout = cell.value.sharding
    key = jax.device_put(np.asarray(state, dtype=np.uint32).reshape(2), layout)
    set_concrete(cell, key, owned=True)


@locked
def get_state() -> np.ndarray:
    """The current key as numpy (for checkpoints)."""
    cell = _cell()
    if cell.is_pending():
        run_cells([cell])
    return np.asarray(cell.value)


def saved() -> tuple:
    """The key's cell and the seed requests as they are now, for ``restore`` (``stages`` records a
    step and then takes back what it changed; the cell's value is taken back with the others).

    Example::

        before = saved(); record_something(); restore(before)
    """
    return _CELL, _REQUESTED, _APPLIED[0]


def restore(before: tuple) -> None:
    """Put back what ``saved`` returned: a seed given before is applied at the next draw again."""
    global _CELL, _REQUESTED
    _CELL, _REQUESTED, _APPLIED[0] = before
