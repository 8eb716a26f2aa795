"""Complex-number ops: conjugation, ``complex`` and ``polar``.

torch's ``x.conj()`` of a complex tensor is ``_conj``: a view that only sets a "conjugate bit" and
leaves the memory alone. shardtensor has no conjugate bit: ``_conj`` is a view whose values are the
conjugated ones (what reading the torch view gives), so ``is_conj()`` is False, ``resolve_conj()`` is
a no-op and ``view_as_real`` of it works (torch asks for ``resolve_conj()`` first). A later write into
the base shows through the view. Writing *into* the view must store the conjugate in the base: that
is the view chain's inverse step (``views.py``).

``complex`` and ``polar`` are lowered directly: torch's decompositions build the result by writing
into ``view_as_real`` of an empty complex tensor, which a functional lowering does not need.

Example::

    lookup(aten.polar.default).fn(jnp.array([2.0]), jnp.array([0.5]))   # == torch.polar(...)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from shardtensor.ops._promote import dtype_of, fresh, is_complex, is_float
from shardtensor.ops.registry import register

aten = torch.ops.aten


def _conj_values(x):
    return jnp.conj(x) if is_complex(dtype_of(x)) else fresh(x)


# The view (conjugate bit in torch) and the two materialising forms compute the same values here.
register(aten._conj.default, aten._conj_physical.default, aten._conj_copy.default)(_conj_values)


def _check_real_pair(name, a, b):
    da, db = dtype_of(a), dtype_of(b)
    if da != db:
        raise RuntimeError(f"{name}: expected both inputs to have the same dtype, but got {da} and {db}")
    if not is_float(da) or da not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise RuntimeError(f"{name}: expected float or double inputs, got {da} (shardtensor has no complex32)")
    return np.dtype(np.complex64) if da == np.float32 else np.dtype(np.complex128)


@register(aten.complex.default)
def complex_(real, imag):
    ct = _check_real_pair("complex", real, imag)
    real, imag = jnp.broadcast_arrays(real, imag)
    return lax.complex(real, imag).astype(ct)


@register(aten.polar.default)
def polar(abs, angle):
    ct = _check_real_pair("polar", abs, angle)
    abs, angle = jnp.broadcast_arrays(abs, angle)
    # torch's CPU kernel: complex(abs * cos(angle), abs * sin(angle)), in the input precision
    return lax.complex(abs * jnp.cos(angle), abs * jnp.sin(angle)).astype(ct)
