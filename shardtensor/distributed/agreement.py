"""Collectives whose arguments differ across the processes are refused before they are recorded:
shardtensor's own (``st.all_reduce``...) and torch.distributed's on device tensors (``dist.all_reduce``,
the functional collectives; dispatch/collectives.py calls the check installed here).

Each process compiles its own copy of a step's program; a collective whose shapes or dtypes differ
between processes makes programs that do not match, and gloo ends process 0 with ``SIGABRT``
(``gloo::EnforceNotMet``). So before the first use of a signature (the collective, its reduce op and
groups, each tensor's shape and dtype), every process sends it to the others through the job's
coordination service (``st.rendezvous``, bytes only) and compares: if any differs, every process
raises ``ValueError`` naming what each one passed. A signature that all processes agreed on is
remembered, so a training loop pays the exchange once.

Example::

    check_same_everywhere("all_reduce", [grad], "sum", [])   # no-op in a single process
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardtensor import runtime as rt
from shardtensor.dispatch.collectives import set_agreement_check
from shardtensor.distributed.host_collectives import rendezvous

_AGREED: set[tuple] = set()  # signatures every process of the job passed alike


def check_same_everywhere(what: str, tensors: Sequence[torch.Tensor], *arguments: Any) -> None:
    """Raise ``ValueError`` in every process if the shapes, dtypes or ``arguments`` of the collective
    ``what`` are not the same in every process of the job (checked once per signature).

    Example::

        check_same_everywhere("all_gather", [x], 0, [])
    """
    if rt.process_count() == 1:
        return
    text = f"{what}(" + ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)
    text += "".join(f", {a!r}" for a in arguments) + ")"
    key = (rt.process_count(), text)
    if key in _AGREED:
        return
    said = [b.decode() for b in rendezvous(f"shardtensor.{what}.signature", text.encode())]
    if any(s != text for s in said):
        each = "; ".join(f"process {p}: {s}" for p, s in enumerate(said))
        name = what if "." in what else f"st.{what}"  # torch.distributed's ("dist.all_reduce") or ours
        raise ValueError(
            f"{name}: the processes passed different tensors ({each}); every process must pass tensors "
            "of the same shapes and dtypes (and the same other arguments) to a collective. Nothing was run."
        )
    _AGREED.add(key)


# torch.distributed's collectives on device tensors (dispatch/c10d_ops.py, functional_collectives.py)
set_agreement_check(check_same_everywhere)
