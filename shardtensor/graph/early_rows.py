"""A checked program's check rows computed by a program of their own, dispatched just before it.

``st.compile`` raises a failed on-device check on the call that ran it (``raise_on_call``), so each
call waits for its check rows — and so for its whole program, while the host could already be
preparing the next call (on a TPU the chip then idles between steps for the host's time per call).
When the checks depend only on cheap work (index bounds of token ids and targets: no products, no
kernels, no loops), their rows are computed by a small program of their own run before the step;
waiting for it waits only for the runs before. The step's own rows are still read
(``checks.watch(..., early=...)``), so nothing is decided on the small program's word alone.
"""

from __future__ import annotations

import logging
import warnings

_LOG = logging.getLogger("shardtensor")
# what would make the rows' program as costly as the step: products, kernels, loops
_HEAVY = (" dot(", " convolution(", " custom-call(", " while(")  # (also inside fused computations)


def rows_program(fn, donated: list, kept: list, scalars: dict):
    """The compiled program computing ``fn``'s check rows (nothing else) from its arguments, or None
    when that is not cheap (module doc) or fails to compile.

    Example::

        rows_fn = rows_program(fn, donated, kept, scalars)
        rows = rows_fn(donated, kept, scalars) if rows_fn is not None else None
    """
    maker = getattr(fn, "rows_only", None)
    if maker is None:  # (an executable from the persistent cache: its trace is made again)
        maker = fn.program.make_executable().rows_only
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            compiled = maker.lower(donated, kept, scalars).compile()
    except Exception as error:  # noqa: BLE001  (an optimisation: the call waits for its own rows)
        _LOG.info("shardtensor: the check rows' own program did not compile (%s); calls wait for their runs", error)
        return None
    text = compiled.as_text() or ""
    if any(token in text for token in _HEAVY):
        return None
    return compiled
