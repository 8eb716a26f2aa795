"""Hugging Face ``generate`` on ``st.device()`` keeps its growing token tensors on the host.

transformers' decoding loop appends each new token to ``input_ids`` (and a column to the attention
mask) with ``torch.cat``, where those tensors are. On ``st.device()`` that puts a tensor one column
longer into every step's program, so every token is a new program and a new compilation, even with a
static KV cache whose shapes never change. On the host the bookkeeping costs nothing: the loop reads
each token's logits and its stop condition to the host anyway.

So ``GenerationMixin.generate`` is wrapped: when ``input_ids`` is a ShardedTensor, the token-id tensors
(``input_ids`` and integer or boolean keyword tensors such as ``attention_mask``) are read to the host,
``generate`` runs with them there (the model stays on the device; transformers moves what each step
consumes to it), and the host tensors of the result (``sequences``, ``scores``, ...) come back to
``st.device()``. With ``cache_implementation="static"`` (or a ``StaticCache``) the whole generation is
then two programs, the prefill and the decode step; with the default dynamic cache the cache itself
still grows on the device, one program per token (``st.generate`` buckets it; docs/generation.md).
For an encoder-decoder model the encoder runs on the device first, as ``generate`` would run it.

The tokens are those of the unwrapped ``generate``: the logits are the device's, and the greedy
choice and sampling run in torch on the CPU (sampling draws from torch's CPU generator, as eager
torch on the CPU does). Calls that pass code which may hold device tensors of its own
(``logits_processor``, ``stopping_criteria``, ``prefix_allowed_tokens_fn``, an assistant model,
``custom_generate``, negative prompts, more positional arguments) run ``generate`` unchanged, as do
calls whose ``input_ids`` are not a ShardedTensor.

Example::

    model = LlamaForCausalLM(config).to(st.device())
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(st.device())
    out = model.generate(ids, max_new_tokens=50, cache_implementation="static")  # 2 programs; out on st.device()
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.upload import upload_replicated

GENERATION_MODULE = "transformers.generation.utils"
# arguments that carry the caller's code or tensors: generate runs as it is with any of them given
_CALLER_CODE = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "assistant_model",
    "custom_generate",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
)
# what an encoder-decoder model's encoder is run with here (anything more: generate runs as it is)
_ENCODER_INPUTS = frozenset({"attention_mask"})


def generates_with_host_tokens(generate: Callable[..., Any]) -> Callable[..., Any]:
    """``generate`` that runs with the token ids on the host when they are on ``st.device()``.

    Example::

        from transformers.generation.utils import GenerationMixin
        GenerationMixin.generate = generates_with_host_tokens(GenerationMixin.generate)
    """

    @functools.wraps(generate)
    def generate_with_host_tokens(self: Any, inputs: Any = None, *args: Any, **kwargs: Any) -> Any:
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if args or not isinstance(ids, ShardedTensor) or any(kwargs.get(k) is not None for k in _CALLER_CODE):
            return generate(self, inputs, *args, **kwargs)
        kwargs.pop("input_ids", None)
        encode = getattr(self.config, "is_encoder_decoder", False) and "encoder_outputs" not in kwargs
        if encode and not _encoder_inputs_only(kwargs):
            return generate(self, ids, **kwargs)
        # read the ids first: the encoder, recorded after, then joins the first decoder step's program
        host_ids = ids.cpu()
        host = {k: v.cpu() if _is_token_tensor(v) else v for k, v in kwargs.items()}
        if encode:
            host["encoder_outputs"] = encoder_outputs_on_device(self, host_ids, host.get("attention_mask"))
        return _to_device(generate(self, host_ids, **host))

    generate_with_host_tokens._shardtensor_wrapped = True  # type: ignore[attr-defined]
    return generate_with_host_tokens


def wrap_generation_utils(module: Any) -> None:
    """Wrap ``module.GenerationMixin.generate`` (``transformers.generation.utils``) once.

    Example::

        import transformers.generation.utils
        wrap_generation_utils(transformers.generation.utils)
    """
    mixin = getattr(module, "GenerationMixin", None)
    current = getattr(mixin, "generate", None)
    if current is None or getattr(current, "_shardtensor_wrapped", False):
        return
    mixin.generate = generates_with_host_tokens(current)  # type: ignore[union-attr]


def encoder_outputs_on_device(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> Any:
    """An encoder-decoder model's encoder output for ``input_ids`` (moved to the model's device).

    transformers runs the encoder on the inputs where they are, so a generation whose inputs stay on
    the host runs the encoder here first and passes its output as ``encoder_outputs``.

    Example::

        out = model.generate(ids_on_host, encoder_outputs=encoder_outputs_on_device(model, ids_on_host, None))
    """
    device = next(model.parameters()).device
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    on_device = {k: v.to(device) for k, v in inputs.items() if v is not None}
    with torch.no_grad():
        return model.get_encoder()(**on_device, return_dict=True)


def _encoder_inputs_only(kwargs: dict) -> bool:
    """Nothing but the attention mask would reach the encoder, and no encoder output is asked for."""
    tensors = {k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and not k.startswith("decoder_")}
    wants = any(kwargs.get(k) for k in ("output_attentions", "output_hidden_states"))
    return tensors <= _ENCODER_INPUTS and not wants


def _is_token_tensor(value: Any) -> bool:
    """Token ids, masks and positions: integer or boolean device tensors of at most two dims."""
    return isinstance(value, ShardedTensor) and value.dim() <= 2 and not value.dtype.is_floating_point


def _to_device(value: Any) -> Any:
    """The result with its host tensors (tokens, scores) uploaded to ``st.device()``; the rest as it is."""
    if isinstance(value, torch.Tensor):
        if isinstance(value, ShardedTensor):
            return value
        # uploaded now, replicated on the default mesh (as in eager mode), not recorded as a copy:
        # reading it back needs no program
        return upload_replicated(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_to_device(v) for v in value)
    if isinstance(value, dict):  # transformers' ModelOutput: a dict whose fields are its keys
        for key in list(value.keys()):
            value[key] = _to_device(value[key])
    return value
