"""``SHARDTENSOR_DEBUG=1`` for ``st.compile``: where two consecutive traces of a call differ.

``st.compile`` freezes a function once two consecutive calls record the same program from the same
tensors with the same Python numbers. When they differ, the function keeps running its Python every
call; this module says why, naming the user's line of the first op that differs::

    [shardtensor] st.compile(step): not frozen: this call's trace differs from the previous one at
    train.py:12, op 3 (aten.add.Tensor): input 1 is a tensor made on the host during the call
    (torch.tensor(...) or a CPU tensor moved to the device) and its value changed

A ``TraceSummary`` keeps what the comparison needs (ops, their sites, scalar values, where each input
comes from), never cells or arrays, so remembering the last one per signature costs no device memory.

Example::

    previous = summarize(trace_1)
    first_difference(previous, summarize(trace_2))   # "at train.py:12, op 3 (...): ..."
"""

from __future__ import annotations

import os

from shardtensor.graph.recompile import op_label


class TraceSummary:
    """What of one trace the debug report compares (see ``summarize``)."""

    def __init__(self, fingerprint, steps, sites, scalars, sources, leaf_sigs) -> None:
        self.fingerprint = fingerprint
        self.steps = steps  # the program key's (node key, input codes) per op
        self.sites = sites  # op index -> (file, line) of the user's code that recorded it
        self.scalars = scalars  # the value of each Python-number use, in program order
        self.sources = sources  # per input: (kind, identity) as in the trace's fingerprint
        self.leaf_sigs = leaf_sigs  # per input: (stored shape, dtype, shape, sharding)


def summarize(trace) -> TraceSummary:
    """The summary of a ``frozen_replay.Trace``.

    Example::

        summarize(trace).sites   # {0: ('train.py', 11), 1: ('train.py', 12)}
    """
    ex = trace.execution
    if ex is None:
        return TraceSummary(trace.fingerprint, (), {}, (), (), ())
    key = ex.program.key
    scalars = tuple(ex.scalars[kind][j].item() for kind, j in ex.program.scalar_slots)
    sources = tuple(s[:2] for s in trace.sources)
    return TraceSummary(trace.fingerprint, key[0], dict(ex.sites or {}), scalars, sources, key[2])


def first_difference(old: TraceSummary, new: TraceSummary) -> str:
    """Where ``new`` first differs from ``old``: the user's line and the op, then what differs.

    Example::

        first_difference(a, b)   # "at step.py:7, op 2 (aten.mul.Tensor): Python number 1.0 -> 2.0"
    """
    for k, (a, b) in enumerate(zip(old.steps, new.steps)):
        if a != b:
            was = op_label(a[0])
            what = f"was {was}" if was != op_label(b[0]) else "other arguments or input shapes/layouts"
            return f"{_where(new, k)}: {what}"
    if len(old.steps) != len(new.steps):
        k = min(len(old.steps), len(new.steps))
        if len(new.steps) > k:
            return f"{_where(new, k)}: an op the previous trace did not record"
        return f"{_where(old, k)} (previous trace): this trace did not record it"
    for i, (a, b) in enumerate(zip(old.leaf_sigs, new.leaf_sigs)):
        if a != b:
            return f"{_where(new, _reader(new, 1, i))}: input {i} changed shape, dtype or layout"
    if old.fingerprint[0] != new.fingerprint[0]:
        return "the program keeps or overwrites other values (outputs, donation, on-device checks)"
    for j, (a, b) in enumerate(zip(old.scalars, new.scalars)):
        if a != b:
            return f"{_where(new, _reader(new, 2, j))}: Python number {a!r} -> {b!r}"
    for i, (a, b) in enumerate(zip(old.sources, new.sources)):
        if a != b:
            return f"{_where(new, _reader(new, 1, i))}: input {i} {_source_change(a, b)}"
    if old.fingerprint[3] != new.fingerprint[3]:
        return "it writes other tensors (another argument, or a tensor made before the call)"
    return "it returns another structure or other Python values"


def _source_change(a, b) -> str:
    if a[0] == b[0] == "const":
        if isinstance(b[1], int):  # (an object's identity: too large to compare, or donated)
            return (
                "is a tensor made during the call that is too large to compare by value, or that the "
                "program updates in place: a new input each call (make it once, outside the function)"
            )
        return (
            "is a tensor made on the host during the call (torch.tensor(...) or a CPU tensor moved to "
            "the device) and its value changed"
        )
    names = {"arg": "an argument", "old": "a tensor made before the call", "const": "a tensor made during the call"}
    if a[0] != b[0]:
        return f"was {names[a[0]]}, now {names[b[0]]}"
    return f"is another {names[b[0]][2:]}"


def _reader(summary: TraceSummary, kind: int, index: int) -> int | None:
    """The first op reading input ``index`` (kind 1: a tensor, 2: a Python number)."""
    code = (kind, index)
    for k, (_, codes) in enumerate(summary.steps):
        if code in codes:
            return k
    return None


def _where(summary: TraceSummary, k: int | None) -> str:
    if k is None:
        return "at an output"
    site = summary.sites.get(k)
    place = f"{os.path.basename(site[0])}:{site[1]}" if site is not None else "<line unknown>"
    return f"at {place}, op {k} ({op_label(summary.steps[k][0])})"
