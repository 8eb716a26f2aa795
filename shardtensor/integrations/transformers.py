"""Hugging Face transformers builds its attention masks for a ShardedTensor as it does under a tracer.

transformers' mask helpers (``transformers.masking_utils``) read tensor values to pick a cheaper
but equivalent mask: ``padding_mask.all()`` to drop an all-ones padding mask (and let SDPA use
``is_causal`` or no mask at all), ``q_offset == 0`` for a static cache's prefill, a packed-sequence
test on ``position_ids``, ``torch.all(attention_mask == 1)`` for recurrent layers. Each read is a
host sync on ``st.device()``: a lazy training step runs as two or more programs, and
``st.compile`` never freezes a step whose Python branches on a value. transformers skips these
reads whenever ``is_tracing(tensor)`` is true (Dynamo, torch.jit, FX, FakeTensor, torchax under
``jax.jit``) and builds the general mask instead, from the same values.

This module makes that ``is_tracing``, as seen by ``masking_utils`` only, also answer True for a
ShardedTensor (in every mode, so the mask a model builds never depends on the mode or the data).
Why it is sound, read by read (transformers 5.24): each skipped read only chooses between two
masks that select the same keys — no mask versus an all-True one, SDPA's ``is_causal`` versus the
materialised causal mask, the plain causal mask versus the packed-sequence one with a single
sequence per row — and none of them guards an error. Values are unchanged: ``tests/test_hf_programs.py``
compares losses with eager torch, which takes the shortcuts. Reads elsewhere in transformers are
left as they are, such as the warning ``warn_if_padding_and_no_attention_mask`` (``modeling_utils``)
gives when ``input_ids`` contain the pad token and no ``attention_mask`` is passed.

For tensors that are not ShardedTensors the answer is transformers' own, so importing shardtensor
changes nothing for other code. The helper is wrapped when ``transformers.masking_utils`` is
imported (at once if it already is). ``install`` also wraps ``generate`` (``generate_on_host``).

Example::

    import shardtensor as st
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM(config).to(st.device())
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss   # no host read on the way
    loss.backward(); opt.step(); st.step()                              # one program per step
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

from shardtensor.integrations import generate_on_host
from shardtensor.tensor import ShardedTensor

MASKING_MODULE = "transformers.masking_utils"


def treats_sharded_tensors_as_traced(is_tracing: Callable[..., bool]) -> Callable[..., bool]:
    """``is_tracing`` answering True also for a ShardedTensor (transformers' answer for any other).

    Example::

        from transformers.utils.import_utils import is_tracing
        check = treats_sharded_tensors_as_traced(is_tracing)
        check(torch.ones(2).to(st.device())), check(torch.ones(2))   # (True, False)
    """

    @functools.wraps(is_tracing)
    def is_tracing_or_sharded(tensor: Any = None) -> bool:
        # (transformers' own test first: under Dynamo it is true and the isinstance is never traced)
        return is_tracing(tensor) or isinstance(tensor, ShardedTensor)

    is_tracing_or_sharded._shardtensor_wrapped = True  # type: ignore[attr-defined]
    return is_tracing_or_sharded


def wrap_masking_utils(module: Any) -> None:
    """Wrap ``module.is_tracing`` (``transformers.masking_utils``) once; a version without it is left alone.

    Example::

        import transformers.masking_utils
        wrap_masking_utils(transformers.masking_utils)
    """
    current = getattr(module, "is_tracing", None)
    if current is None or getattr(current, "_shardtensor_wrapped", False):
        return
    module.is_tracing = treats_sharded_tensors_as_traced(current)


class _WrapWhenLoaded(importlib.abc.MetaPathFinder):
    """Calls ``wrap(module)`` right after the module ``name`` is imported (one shot)."""

    def __init__(self, name: str, wrap: Callable[[Any], None]):
        self.name, self.wrap = name, wrap

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; find the real spec without us
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run_module, wrap = spec.loader.exec_module, self.wrap

            def exec_module(module):
                run_module(module)
                wrap(module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this one loader's
        return spec


def wrap_when_loaded(name: str, wrap: Callable[[Any], None]) -> None:
    """``wrap(module)`` now if ``name`` is imported, else right after it is (once either way).

    Example::

        wrap_when_loaded("transformers.masking_utils", wrap_masking_utils)
    """
    module = sys.modules.get(name)
    if module is not None:
        wrap(module)
    elif not any(isinstance(f, _WrapWhenLoaded) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _WrapWhenLoaded(name, wrap))


def install() -> None:
    """Wrap transformers' mask helpers and ``generate`` now if they are imported, else when they are.

    Example::

        install()   # (done by ``import shardtensor``; calling it again does nothing)
    """
    wrap_when_loaded(MASKING_MODULE, wrap_masking_utils)
    wrap_when_loaded(generate_on_host.GENERATION_MODULE, generate_on_host.wrap_generation_utils)
