"""The precision of float32 products: torch's ``set_float32_matmul_precision``, as XLA's ``Precision``.

torch's setting is read once per recorded product (``recorded()``, by the dispatcher, only for ops
registered with ``products=True``) and becomes part of the op's template, so a change takes effect for
the next program and is part of the executable cache key. While such an op's lowering runs,
``precision()`` gives the matching XLA precision for its dots and convolutions:

=========== ===================== ===============================================================
torch       XLA                   on a TPU
=========== ===================== ===============================================================
'highest'   ``Precision.HIGHEST`` float32 products emulated exactly (6 bf16 passes); torch's default
'high'      ``Precision.HIGH``    bf16x3: three bf16 passes, about float32's accuracy for most data
'medium'    ``Precision.DEFAULT`` one bf16 pass (JAX's and PyTorch/XLA's default on a TPU)
=========== ===================== ===============================================================

On a CPU XLA computes float32 products in float32 whatever the precision; bf16/f16 products are
unaffected everywhere (they accumulate in float32 as before).

Example::

    torch.set_float32_matmul_precision("medium")
    y = x @ w            # recorded with Precision.DEFAULT: one bf16 pass on a TPU
"""

from __future__ import annotations

import contextlib
import threading

import jax
import torch
from jax import lax

# torch's names -> XLA's precision
_XLA = {"highest": lax.Precision.HIGHEST, "high": lax.Precision.HIGH, "medium": lax.Precision.DEFAULT}
# PyTorch/XLA's names (torch_xla.backends.set_mat_mul_precision) -> torch's
_FROM_XLA_NAME = {"highest": "highest", "high": "high", "default": "medium"}

_JAX_NAMES = {lax.Precision.HIGHEST: "highest", lax.Precision.HIGH: "high", lax.Precision.DEFAULT: "default"}
_LOWERING = threading.local()  # .precision: the XLA precision of the product lowering running now


def recorded() -> str:
    """torch's current float32 matmul precision ('highest', 'high' or 'medium'), read when a product
    is recorded (the one place shardtensor reads the setting).

    Example: ``recorded() == torch.get_float32_matmul_precision()``.
    """
    return torch.get_float32_matmul_precision()


def precision() -> lax.Precision:
    """The XLA precision for the dots and convolutions of the product lowering running now:
    torch's setting when the op was recorded (``Precision.HIGHEST`` outside a recorded op).

    Example::

        jnp.matmul(a, b, precision=precision())
    """
    return getattr(_LOWERING, "precision", lax.Precision.HIGHEST)


def as_jax_default():
    """``jax.default_matmul_precision`` at the precision of the product lowering running now: for
    library functions (``jax.nn``) whose products take JAX's default precision.

    Example::

        with as_jax_default():
            jax.nn.dot_product_attention(q, k, v)    # its float32 products at torch's setting
    """
    return jax.default_matmul_precision(_JAX_NAMES[precision()])


@contextlib.contextmanager
def lowering_at(name: str):
    """Run a product lowering at torch's precision ``name`` (what ``precision()`` gives inside).

    Example::

        with lowering_at("medium"):
            lookup(aten.mm.default).fn(a, b)    # a dot at Precision.DEFAULT
    """
    previous = getattr(_LOWERING, "precision", None)
    _LOWERING.precision = _XLA[name]
    try:
        yield
    finally:
        if previous is None:
            del _LOWERING.precision
        else:
            _LOWERING.precision = previous


def set_mat_mul_precision(precision: str) -> None:
    """PyTorch/XLA's name for float32 product precision: 'highest', 'high' or 'default' (one bf16
    pass). It sets torch's ``torch.set_float32_matmul_precision`` ('highest', 'high', 'medium'), which
    shardtensor follows for every float32 product it records from then on.

    Example::

        st.set_mat_mul_precision("default")    # TPU speed for a float32 model
    """
    if precision not in _FROM_XLA_NAME:
        raise ValueError(
            f"set_mat_mul_precision: precision must be 'highest', 'high' or 'default', got {precision!r} "
            "(torch.set_float32_matmul_precision takes 'highest', 'high' or 'medium')."
        )
    torch.set_float32_matmul_precision(_FROM_XLA_NAME[precision])


def get_mat_mul_precision() -> str:
    """The float32 product precision in PyTorch/XLA's names: 'highest', 'high' or 'default'.

    Example: ``st.get_mat_mul_precision() == "highest"`` (torch's default).
    """
    name = torch.get_float32_matmul_precision()
    return "default" if name == "medium" else name
