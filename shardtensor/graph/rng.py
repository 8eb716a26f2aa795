"""The random-number state: one JAX PRNG key in a Cell that every graph drawing numbers reads and
writes, so each call gives new numbers and a seed reproduces them whatever the mesh or spec.

Example::

    st.manual_seed(0)        # or torch.manual_seed(0)
"""
from __future__ import annotations

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as JaxSpec

from shardtensor.graph.execute import run_cells
from shardtensor.graph.ir import Cell
from shardtensor.graph.state import locked, set_concrete, set_pending
from shardtensor.mesh import default_mesh

_CELL: Cell | None = None


def _cell() -> Cell:
    global _CELL
    if _CELL is None:
        manual_seed(torch.initial_seed())
        assert _CELL is not None
    return _CELL


@locked
def manual_seed(seed: int) -> None:
    """Reset the key from ``seed``; kept replicated over all devices (a key committed to one device
    would make a later jit over the mesh fail).

    Example::

        st.manual_seed(1234)
    """
    global _CELL
    sharding = NamedSharding(default_mesh().get_jax_mesh(), JaxSpec())
    if _CELL is not None and hasattr(_CELL.value, "sharding"):
        sharding = _CELL.value.sharding  # keep the layout, so compiled programs stay valid
    key = jax.device_put(jax.random.PRNGKey(int(seed) % (2**63)), sharding)
    if _CELL is None:
        _CELL = Cell(key, (2,), None, owned=True)
    else:
        set_concrete(_CELL, key, owned=True)


def current():
    """The key's value reference for a node that draws random numbers."""
    cell = _cell()
    return cell.value if cell.is_pending() else cell.leaf()


def advance(ref) -> None:
    """The key after a draw."""
    set_pending(_cell(), ref)


def pending_cells() -> list:
    cell = _cell()
    return [cell] if cell.is_pending() else []


@locked
def set_state(state: np.ndarray) -> None:
    """Restore a key saved by ``get_state`` (keeping the current layout)."""
    cell = _cell()
    if cell.is_pending():
        run_cells([cell])
    key = jax.device_put(np.asarray(state, dtype=np.uint32).reshape(2), cell.value.sharding)
    set_concrete(cell, key, owned=True)


@locked
def get_state() -> np.ndarray:
    """The current key as numpy (for checkpoints)."""
    cell = _cell()
    if cell.is_pending():
        run_cells([cell])
    return np.asarray(cell.value)
