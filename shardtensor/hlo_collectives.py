"""The collectives of a compiled program, read from its HLO text: their kinds and the bytes they move.

What "bytes" means: for each collective instruction of the compiled (per-device, SPMD-partitioned)
HLO, the size of its result buffer on one device — e.g. an all-gather's gathered array, an
all-reduce's reduced array, a reduce-scatter's scattered piece — summed over the instructions of
that kind. It is the data each device ends up receiving, not the wire traffic of the algorithm
(a ring all-reduce of B bytes over n devices sends about 2B(n-1)/n per device). Each instruction
counts once, as written in the program: one inside a loop body is not multiplied by the trip count.
(``st.explain`` and a compiled step's ``collectives()`` report these.)

Example::

    collectives_in_hlo(jax.jit(f).lower(x).compile().as_text())["all-reduce"]   # Collective(1, 128)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple

COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_EXTRA_KINDS = ("ragged-all-to-all", "collective-broadcast")


class Collective(NamedTuple):
    """How many instructions of one collective kind a program has, and the bytes they move."""

    count: int  # type: ignore[assignment]  # a field named like tuple.count, on purpose (it is the count)
    bytes: int


@dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of a compiled program: its kind, result type and result bytes."""

    kind: str
    result_type: str
    bytes: int


# `%name = <result type> <kind>[-start|-done](` ; the result type may be a tuple
_INSTRUCTION = re.compile(
    r"=\s*(?P<type>.+?)\s+(?P<kind>"
    + "|".join(sorted(COLLECTIVE_KINDS + _EXTRA_KINDS, key=len, reverse=True))
    + r")(?P<phase>-start|-done)?\("
)
_ARRAY = re.compile(r"\b(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,<=]*)\]")


def _bits(dtype: str) -> int:
    if dtype == "pred":
        return 8  # stored as one byte
    m = re.search(r"\d+", dtype)  # f32 -> 32, bf16 -> 16, f8e4m3fn -> 8, c64 -> 64 (both halves)
    return int(m.group()) if m else 0  # token[] and the like carry no data


def result_bytes(result_type: str) -> int:
    """Bytes of an HLO result type (an array or a tuple of arrays), e.g. ``'f32[8,4]{1,0}'`` -> 128.

    Example::

        result_bytes('(f32[], bf16[2,3]{1,0})')   # 4 + 12
    """
    total = 0
    for m in _ARRAY.finditer(result_type):
        dims = [int(d.removeprefix("<=")) for d in m.group("dims").split(",") if d]
        total += -(-_bits(m.group("dtype")) * math.prod(dims) // 8)
    return total


def collective_ops(hlo_text: str) -> list[CollectiveOp]:
    """Every collective instruction of a compiled HLO module's text (``compiled.as_text()``).

    An asynchronous pair (``all-gather-start`` / ``-done``) counts once, with the ``-done``'s
    result (the ``-start`` returns its operands too).

    Example::

        collective_ops(jax.jit(f).lower(x).compile().as_text())
    """
    ops = []
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.search(line)
        if not m or m.group("phase") == "-start":
            continue
        ops.append(CollectiveOp(m.group("kind"), m.group("type"), result_bytes(m.group("type"))))
    return ops


def collectives_in_hlo(hlo_text: str) -> dict[str, Collective]:
    """kind -> ``Collective(count, bytes)`` for the five kinds (zeros included, extra kinds if present).

    ``bytes`` is the per-device result buffer of each instruction, summed (see the module docstring).

    Example::

        collectives_in_hlo(compiled.as_text())["all-reduce"]   # Collective(count=1, bytes=128)
    """
    counts = {k: [0, 0] for k in COLLECTIVE_KINDS}
    for op in collective_ops(hlo_text):
        c = counts.setdefault(op.kind, [0, 0])
        c[0] += 1
        c[1] += op.bytes
    return {k: Collective(n, b) for k, (n, b) in counts.items()}


def format_bytes(n: int) -> str:
    """``n`` bytes as people read them. Example: ``format_bytes(3 << 20) == '3.00 MiB'``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
