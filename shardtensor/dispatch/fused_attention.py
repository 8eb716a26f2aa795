"""The special handler of ``_scaled_dot_product_fused_attention_overrideable`` (the one op
``F.scaled_dot_product_attention`` becomes on shardtensor's device): recorded as its lowering
(``ops/fused_attention.py``), whose results are tensors only, with the schema's two SymInt results
(max_q, max_k: the query and key lengths) filled in here.
"""

from __future__ import annotations

import torch

from shardtensor.dispatch.record import record_and_wrap
from shardtensor.dispatch.table import special

aten = torch.ops.aten


@special(aten._scaled_dot_product_fused_attention_overrideable.default)
def _fused_attention(func, args, kwargs):
    """(out, logsumexp, None, None, max_q, max_k, None, None, None), as the op's schema orders them."""
    results = list(record_and_wrap(func, args, kwargs))
    query, key = args[0], args[1]
    results[4], results[5] = query.shape[-2], key.shape[-2]
    return tuple(results)
