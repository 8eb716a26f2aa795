"""A checked program's check rows computed by a program of their own, dispatched just before it.

Reading a run's check rows waits for the run. ``st.compile`` raises a failed on-device check on the
call that ran it (``raise_on_call``), so each call waited for its whole program, and a lazy step read
the previous run's rows before calling its own program: either way the devices' queue drained and
the chip idled for the host's time between steps. When the checks depend only on cheap work (index
bounds of token ids and targets: no products, no kernels, no loops), a repeated program's rows are
computed by a small program of their own run just before it; waiting for those waits only for the
runs before. The program's own rows are still read (``checks.watch(..., early=...)``: once ready, or
at the next read or sync), so nothing is decided on the small program's word alone.

On by default off a CPU (there the devices are the host's own cores: nothing to overlap);
``SHARDTENSOR_EARLY_ROWS=0`` (or ``1``) in the environment turns it off (or on), and ``ENABLED``
overrides both (tests).
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any

from shardtensor import runtime
from shardtensor.graph import checks

ENABLED: bool | None = None  # None: off a CPU only
_LOG = logging.getLogger("shardtensor")
# what would make the rows' program as costly as the step: products, loops (also inside fused
# computations) and custom calls but the compiler's own cheap ones (a TPU's XLA writes a concatenation
# of rows as a "ConcatBitcast" call, marks checked gathers with "AssumeGatherIndicesInBound" and
# splits and joins the 32-bit halves of 64-bit integers with "X64..." calls; a Pallas kernel is a
# "tpu_custom_call")
_HEAVY = (" dot(", " convolution(", " while(")
_CHEAP_CALLS = frozenset(
    {"ConcatBitcast", "AssumeGatherIndicesInBound", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}
)
_CHEAP_PREFIXES = ("X64",)  # X64SplitLow, X64SplitHigh, X64Combine
_CALL_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_SEEN, _NONE = object(), object()  # an executable's first call; no cheap rows program


def used(fn) -> bool | None:
    """Whether ``fn``'s calls run its check rows' own program: None while undecided (its first call).

    Example::

        used(frozen.executable)   # True: the calls wait for the rows' program only
    """
    rows_fn = getattr(fn, "early_rows", None)
    return None if rows_fn in (None, _SEEN) else rows_fn is not _NONE


def enabled() -> bool:
    """Whether checked programs that repeat get their rows' own program (module doc).

    Example::

        early_rows.enabled()   # False on a CPU, unless SHARDTENSOR_EARLY_ROWS=1
    """
    if ENABLED is not None:
        return ENABLED
    return _FROM_ENV()


def _on(text: str | None) -> bool:
    setting = (text or "").strip().lower()
    return setting not in ("0", "false", "no", "off") if setting else runtime.platform() != "cpu"


# (asked before every checked run: parsed again only when the variable changed; the platform is fixed)
_FROM_ENV = runtime.environ_setting(_on, "SHARDTENSOR_EARLY_ROWS")


def dispatch(fn, donated: list, kept: list, scalars: dict):
    """Run ``fn``'s check rows' own program on these arguments (before ``fn`` itself, which may donate
    them) and return its rows, their copy to the host started; or None: off (``enabled``), ``fn``
    has no checks, its first call, its rows are not cheap (module doc), or the caller's thread reads
    its checks late anyway (``checks.deferred``). The rows program is built at ``fn``'s second call
    (a program that repeats) and kept on ``fn``.

    Example::

        early = dispatch(fn, donated, kept, scalars)
        outs = fn(donated, kept, scalars)
        checks.watch(fn.program, outs[1], sites, cells, outs[0], early)
    """
    if not (fn.program.checks and enabled()) or checks.deferring():
        return None
    rows_fn: Any = getattr(fn, "early_rows", None)
    if rows_fn is None:
        fn.early_rows = _SEEN
        return None
    if rows_fn is _SEEN:
        rows_fn = fn.early_rows = rows_program(fn, donated, kept, scalars) or _NONE
    if rows_fn is _NONE:
        return None
    rows = rows_fn(donated, kept, scalars)
    # read soon: queued after the small program (on every platform, so that a CPU's tests run the chip's path)
    rows.copy_to_host_async()
    return rows


def rows_program(fn, donated: list, kept: list, scalars: dict):
    """The compiled program computing ``fn``'s check rows (nothing else) from its arguments, or None
    when that is not cheap (module doc) or fails to compile.

    Example::

        rows = rows_program(fn, donated, kept, scalars)(donated, kept, scalars)
    """
    maker = getattr(fn, "rows_only", None)
    if maker is None:  # (an executable from the persistent cache: its trace is made again)
        maker = fn.program.make_executable().rows_only
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            compiled = maker.lower(donated, kept, scalars).compile()
    except Exception as error:  # noqa: BLE001  (an optimisation: the calls wait for their own rows)
        _LOG.info("the check rows' own program did not compile (%s); calls wait for their runs", error)
        return None
    if compiled.out_tree.num_leaves == 0:  # checks on, but none of the program's ops checks anything
        return None
    reason = heavy(compiled.as_text() or "")
    if reason:
        _LOG.info("the check rows' own program would run %s: calls wait for their runs", reason)
        return None
    return compiled


def heavy(hlo_text: str) -> str:
    """What in an optimized HLO program does work like a step's (products, loops, kernels: module
    doc), or "" when nothing does.

    Example::

        heavy(jax.jit(f).lower(x).compile().as_text())   # e.g. 'dot(', '' for compares and sums
    """
    for token in _HEAVY:
        if token in hlo_text:
            return token.strip()
    calls = [t for t in _CALL_TARGET.findall(hlo_text) if t not in _CHEAP_CALLS and not t.startswith(_CHEAP_PREFIXES)]
    return f"custom call {calls[0]!r}" if calls else ""
