"""Facts one lowering leaves about a traced value for a later lowering of the same trace (a program
being built), so that the later one can compute its result from cheaper parts: nll_loss's gradient
has one nonzero per row, whose row sums it knows, so log_softmax's backward does not sum them over
the classes (a pass over the logits' shape, as large as the vocabulary times the tokens).

A fact is kept only for a tracer, while it lives, and only for the trace it belongs to; concrete
arrays (eager mode) never have facts, and every lowering still computes its result without them.

Example::

    remember(grad, "onehot_rows", (row_sums, axis))
    facts = recall(g, "onehot_rows")   # None unless g is that traced ``grad``
"""

from __future__ import annotations

import weakref

# (id(value), kind) -> (weak value, fact)
_FACTS: dict = {}


def remember(value, kind, fact) -> None:
    """Keep ``fact`` about ``value`` (a tracer; anything else is ignored) until the value dies;
    ``kind``: any hashable name of the fact."""
    if getattr(value, "_trace", None) is None:
        return
    key = (id(value), kind)

    def forget(_ref, k=key, facts=_FACTS):
        facts.pop(k, None)

    _FACTS[key] = (weakref.ref(value, forget), fact)


def recall(value, kind):
    """The fact remembered about this very ``value`` under ``kind``, or None."""
    entry = _FACTS.get((id(value), kind))
    if entry is None or entry[0]() is not value:
        return None
    return entry[1]
