"""``clip_grad_norm_`` for sharded gradients, with no host round trip.

``torch.nn.utils.clip_grad_norm_`` works on ShardedTensor gradients as well (its foreach path uses
``_foreach_norm``/``_foreach_mul_``, which have lowerings); this one is the same computation written
with per-tensor ops only, so it does not depend on torch's device grouping or foreach support.
Each gradient's norm is a reduction over its shards that XLA partitions; the total norm and the clip
factor stay on the devices, so in lazy mode the whole step — backward, clipping, optimizer — remains
one program.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so that their joint norm is at most ``max_norm``.

    Same arguments, result and numerics as ``torch.nn.utils.clip_grad_norm_`` (gradients are
    multiplied by ``min(1, max_norm / (total_norm + 1e-6))``); returns the total norm as a tensor on
    the gradients' device. ``foreach`` is accepted for compatibility and ignored.
    ``error_if_nonfinite=True`` must read the norm on the host, which ends the lazy graph there.

    Example::

        loss.backward()
        norm = st.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    with torch.no_grad():  # clipping is not part of the graph autograd differentiates
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                "anyway, set `error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)  # a 0-d factor keeps each gradient's dtype, as in torch
    return total
