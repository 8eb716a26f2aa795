"""Hugging Face ``generate`` in a fixed number of programs: a static KV cache, bucketed prompts.

Greedy or sampled decoding with transformers' default loop on ``st.device()`` compiles a program
for every new token: the loop appends each token to ``input_ids`` (and to the position ids and the
attention mask) with ``torch.cat``, so every step is a new shape. :func:`generate` runs the same
``model.generate`` so that only two programs exist, the prefill and the decode step:

- the KV cache is transformers' ``StaticCache`` (``cache_implementation="static"``), a buffer of
  fixed length written in place at a position held on the device;
- the growing token bookkeeping (``input_ids``, attention mask, position ids, logits processors,
  stopping criteria) stays on the host: transformers moves only the tensors one forward consumes to
  the model's device (``prepare_inputs_for_generation``), so the decode step sees one token per
  sequence and a mask of the cache's length whatever the step;
- the prompt is left-padded (masked, so the tokens are those of the unpadded prompt) to a bucket
  length and the cache to a bucket of prompt + new tokens, so prompts of different lengths within a
  bucket reuse both programs.

Example::

    model = LlamaForCausalLM(config).to(st.device())
    out = st.generate(model, input_ids, max_new_tokens=20)    # 2 compiles, then 0 for the next prompt
"""

from __future__ import annotations

from typing import Any

import jax
import torch

from shardtensor import decode_loop
from shardtensor.graph import memory
from shardtensor.graph.modes import sync
from shardtensor.integrations.generate_on_host import encoder_outputs_on_device

# The smallest prompt bucket: shorter prompts all share one prefill program.
MIN_BUCKET = 16

# generate() arguments counted from the start of the prompt: padding the prompt shifts them, so
# they are turned into counts of new tokens first.
_ABSOLUTE_LENGTHS = {"max_length": "max_new_tokens", "min_length": "min_new_tokens"}


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
    """The bucket a length ``n`` is padded to: the next power of two, at least ``minimum``.

    Powers of two keep the number of programs logarithmic in the longest prompt, and waste at most
    half of a bucket.

    Example::

        bucket_length(5), bucket_length(17), bucket_length(64)   # (16, 32, 64)
    """
    if n < 0:
        raise ValueError(f"bucket_length: a length must be >= 0, got {n}")
    size = max(int(minimum), 1)
    while size < n:
        size *= 2
    return size


def generate(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    buckets: bool = True,
    compile_decode: bool = False,
    device_loop: bool = True,
    **kwargs: Any,
) -> Any:
    """``model.generate(input_ids, **kwargs)`` with a static KV cache, compiled as two programs.

    ``model`` is a Hugging Face decoder-only model on ``st.device()`` (sharded or not);
    ``input_ids`` may be on the host or on ``st.device()``, and the result (the prompt and the new
    tokens, as ``model.generate`` returns them) comes back on the same device. Every other keyword
    goes to ``model.generate`` (``max_new_tokens``, ``do_sample``, ``eos_token_id``,
    ``logits_processor``, ...). With ``buckets=True`` (the default) the prompt is left-padded to
    :func:`bucket_length` of its length (padding masked out, so the tokens equal those of the
    unpadded prompt) and the cache to the bucket of prompt + ``max_new_tokens``: prompts within a
    bucket compile nothing new. ``buckets=False`` keeps the prompt as it is (one prefill program per
    prompt length; use it for a model whose forward takes no ``attention_mask`` or
    ``position_ids``).

    ``cache_implementation="dynamic"`` replaces the fixed-size cache by :func:`growing_cache`, which
    starts at the prompt's bucket and doubles when full: two programs per size it reaches (the step
    that grows it and the steady one), for when ``max_new_tokens`` is large and most generations
    stop early (on EOS), or memory for the longest one is not to be reserved up front.

    ``compile_decode=True`` runs the decode step through ``torch.compile(backend="shardtensor")``
    (transformers' ``compile_config``, static cache only): the step is captured on its first call and
    replayed frozen after, without recording its ops again each token (the lowest host time per
    token). It costs Dynamo's tracing on the first call and one more small program, run every token:
    the upload of the step's inputs (in lazy mode it is part of the step's program).

    ``device_loop=True`` (the default) keeps greedy search with the static cache on the device
    (:mod:`shardtensor.decode_loop`): the decode step is replayed frozen and chooses each token
    itself, and the host reads only, a few steps late, whether every sequence has ended, so the
    chip never waits for it. Sampling, beams, the caller's logits processors or stopping criteria,
    streamers and ``return_dict_in_generate`` run transformers' loop, which reads each token's
    logits to the host; ``device_loop=False`` runs that loop always.

    Example::

        out = st.generate(model, tokenizer("Hello", return_tensors="pt").input_ids, max_new_tokens=20)
        tokenizer.decode(out[0])
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(
            "st.generate: input_ids must be a 2-D tensor of token ids (batch, sequence); "
            f"got {type(input_ids).__name__}{tuple(getattr(input_ids, 'shape', ()))}"
        )
    if "cache" in kwargs or "past_key_values" in kwargs:
        raise ValueError(
            "st.generate makes its own cache (see cache_implementation); call model.generate directly to "
            "pass a cache, with input_ids on the host (a StaticCache keeps the decode step one program too)"
        )
    implementation = kwargs.pop("cache_implementation", "static")
    if implementation not in ("static", "dynamic"):
        raise ValueError(
            f"st.generate runs cache_implementation='static' (the default) or 'dynamic' (a cache growing by "
            f"buckets), not {implementation!r}: call model.generate directly for other caches (each new "
            "token is then a new program)"
        )
    # pending work of the caller's (the model's upload) runs first, on its own: a generation refused for
    # memory then fails only its own tensors, never the weights
    sync()
    device = input_ids.device
    ids = input_ids.cpu()
    mask = attention_mask.cpu() if attention_mask is not None else None
    prompt = ids.shape[1]
    config = model.generation_config
    for absolute, relative in _ABSOLUTE_LENGTHS.items():
        if absolute in kwargs and relative not in kwargs:
            kwargs[relative] = max(int(kwargs.pop(absolute)) - prompt, 0)
    new_tokens = kwargs.get("max_new_tokens")
    if new_tokens is None:
        if config.max_new_tokens is not None:
            new_tokens = config.max_new_tokens
        elif config.max_length is not None:
            new_tokens = max(config.max_length - prompt, 0)
        else:
            new_tokens = 20  # transformers' default when nothing is set: 20 new tokens
        kwargs["max_new_tokens"] = new_tokens
    pad = 0
    if buckets:
        pad = bucket_length(prompt) - prompt
        if mask is None:
            mask = torch.ones_like(ids)
        filler = _pad_token(model, kwargs)
        ids = torch.cat([ids.new_full((ids.shape[0], pad), filler), ids], dim=1)
        mask = torch.cat([mask.new_zeros((mask.shape[0], pad)), mask], dim=1)
    if implementation == "static":
        if buckets:
            kwargs.setdefault("max_cache_len", bucket_length(ids.shape[1] + int(new_tokens)))
        kwargs["cache_implementation"] = "static"
    elif model.config.is_encoder_decoder:
        raise ValueError(
            "st.generate: cache_implementation='dynamic' (a growing cache) is for decoder-only models; "
            "use the default, 'static', for an encoder-decoder model"
        )
    else:
        kwargs[decode_loop.cache_argument(model)] = growing_cache(model.config, ids.shape[1])
    if compile_decode:
        if implementation != "static":
            raise ValueError("st.generate: compile_decode=True needs the static cache (cache_implementation='static')")
        kwargs.setdefault("compile_config", _decode_compile_config())
    if mask is not None:
        kwargs["attention_mask"] = mask
    if model.config.is_encoder_decoder and "encoder_outputs" not in kwargs:
        # transformers runs the encoder on the inputs as they are (it moves only the decoder's per-step
        # inputs to the model's device): run it here, on the device, once
        kwargs["encoder_outputs"] = encoder_outputs_on_device(model, ids, mask)
    if implementation == "static":
        _check_static_cache_fits(model, ids.shape[0], int(new_tokens), ids.shape[1], kwargs)
    # transformers sizes every later static cache to at least this call's (``_previous_max_cache_length``):
    # a call that fails (a cache too big) must not leave its size behind for the next ones
    previous = model.__dict__.get("_previous_max_cache_length", _UNSET)
    if (
        device_loop
        and implementation == "static"
        and not compile_decode
        and not model.config.is_encoder_decoder
        and not _HOST_LOOP_ARGUMENTS & set(kwargs)
    ):
        kwargs["custom_generate"] = decode_loop.decode
    try:
        try:
            out = model.generate(ids, **kwargs)
        except decode_loop.NotOnDevice:  # a mode transformers runs its own way (assisted, from the Hub)
            kwargs.pop("custom_generate")
            out = model.generate(ids, **kwargs)
    except BaseException:
        if previous is _UNSET:
            model.__dict__.pop("_previous_max_cache_length", None)
        else:
            model._previous_max_cache_length = previous
        raise
    if model.config.is_encoder_decoder:
        pad = 0  # the result is the decoder's tokens only: no prompt, no padding in it
    if isinstance(out, torch.Tensor):
        return out[:, pad:].to(device)
    out.sequences = out.sequences[:, pad:].to(device)  # return_dict_in_generate: scores etc. as they are
    return out


_UNSET = object()
# generate() arguments that need transformers' own loop (or are the caller's own loop)
_HOST_LOOP_ARGUMENTS = frozenset({"custom_generate", "streamer", "synced_gpus", "assistant_model", "tokenizer"})


def static_cache_bytes(model: Any, batch: int, max_cache_len: int) -> int:
    """Bytes of the keys and values of a static KV cache of ``max_cache_len`` positions for ``batch``
    sequences of ``model`` (its decoder's self-attention; sliding-window layers hold their window).

    Example::

        static_cache_bytes(model, 1, 4096)   # 2 * layers * kv_heads * 4096 * head_dim * 4 for float32
    """
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    positions = sum(
        min(window, max_cache_len) if window and kind == "sliding_attention" else max_cache_len for kind in layer_types
    )
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return 2 * batch * kv_heads * head_dim * positions * itemsize


def _check_static_cache_fits(model: Any, batch: int, new_tokens: int, prompt: int, kwargs: dict) -> None:
    """Refuse, before anything is allocated, a static cache larger than the memory of every device
    together (it could not fit however it is sharded)."""
    config = model.generation_config
    length = max(
        int(kwargs.get("max_cache_len") or 0),
        prompt + new_tokens,
        int(getattr(config, "max_cache_len", None) or 0),
        int(getattr(model, "_previous_max_cache_length", -1)),  # transformers never shrinks it
    )
    beams = int(kwargs.get("num_beams", config.num_beams) or 1)
    copies = max(beams, int(kwargs.get("num_return_sequences", config.num_return_sequences) or 1))
    needed = static_cache_bytes(model, batch * copies, length)
    free, where = memory.available_in_all(jax.local_devices())
    free += decode_loop.kept_cache_bytes(model)  # reused, or freed before a new cache is made
    if needed > free:
        raise memory.OutOfDeviceMemoryError(
            f"st.generate: max_new_tokens={new_tokens} needs a static KV cache of {length} positions for "
            f"{batch * copies} sequence(s): {memory.format_size(needed)}, more than {memory.format_size(free)} "
            f"({where}). Nothing was allocated. Ask for fewer new tokens (or a smaller batch), or use "
            "cache_implementation='dynamic', which grows the cache only as far as generation goes."
        )


def _decode_compile_config() -> Any:
    """transformers' CompileConfig for torch.compile with shardtensor's backend, on any device."""
    from transformers import CompileConfig

    options: dict[str, Any] = {"backend": "shardtensor", "mode": None, "fullgraph": True}  # no inductor mode
    config = CompileConfig(**options)
    # transformers compiles only on the devices it lists (cuda, xpu, neuron, tpu) unless told so
    setattr(config, "_compile_all_devices", True)  # noqa: B010 (typed None in transformers)
    return config


def _pad_token(model: Any, kwargs: dict) -> int:
    """A token id to fill the (masked) left padding with: the pad token, else eos, else 0."""
    for name in ("pad_token_id", "eos_token_id"):
        value = kwargs.get(name, getattr(model.generation_config, name, None))
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, torch.Tensor):
            value = int(value.flatten()[0])
        if value is not None and 0 <= int(value) < model.config.get_text_config().vocab_size:
            return int(value)
    return 0


_GROWING_LAYER = None  # the layer class, made on first use (transformers is imported only then)


def growing_cache(config: Any, initial: int) -> Any:
    """A transformers ``Cache`` that starts with room for ``initial`` positions and doubles when full.

    Each layer is a ``StaticLayer`` (fixed-size buffers written in place, a mask as long as the
    buffer) that grows to the next :func:`bucket_length` when a forward would overflow it: the
    number of programs is logarithmic in the sequence length, and a short generation attends over
    a short buffer. Unwritten positions are zeros, masked out like the static cache's. What
    ``st.generate(..., cache_implementation="dynamic")`` uses; pass it to ``model.generate`` as
    ``cache=`` (with ``input_ids`` on the host).

    Example::

        out = model.generate(ids, cache=st.generation.growing_cache(model.config, 16), max_new_tokens=100)
    """
    from transformers.cache_utils import Cache, get_layer_types_and_kwargs

    text_config = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    others = sorted(set(layer_types) - {"full_attention"})
    if others:
        raise ValueError(
            f"growing_cache: only full-attention layers can grow by buckets; this model also has {others}. "
            "Use cache_implementation='static' (a fixed-size cache)."
        )
    layer_class = _growing_layer_class()
    return Cache(layers=[layer_class(max_cache_len=bucket_length(initial)) for _ in layer_types])


def _growing_layer_class():
    global _GROWING_LAYER
    if _GROWING_LAYER is not None:
        return _GROWING_LAYER
    from transformers.cache_utils import StaticLayer

    class GrowingLayer(StaticLayer):
        """A StaticLayer whose buffers double (zero-padded) before a forward that would overflow them."""

        def __init__(self, max_cache_len: int, **kwargs):
            super().__init__(max_cache_len=max_cache_len, **kwargs)
            self.length = 0  # positions written, on the host: growing needs no read from the device

        def _reserve(self, needed: int) -> None:
            if needed <= self.max_cache_len:
                return
            size = bucket_length(needed, self.max_cache_len)
            if self.is_initialized and self.keys is not None and self.values is not None:
                self.keys = _pad_positions(self.keys, size)
                self.values = _pad_positions(self.values, size)
            self.max_cache_len = size

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            # the mask is made before the layers run: grow now, so it covers the buffer update writes
            self._reserve(self.length + query_length)
            return super().get_mask_sizes(query_length)

        def update(self, key_states, value_states, *args, **kwargs):
            self._reserve(self.length + key_states.shape[-2])
            self.length += key_states.shape[-2]
            return super().update(key_states, value_states, *args, **kwargs)

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)
            self.length -= abs(tokens_to_remove)

        def reset(self) -> None:
            super().reset()
            self.length = 0

    _GROWING_LAYER = GrowingLayer
    return GrowingLayer


def _pad_positions(buffer: torch.Tensor, size: int) -> torch.Tensor:
    """``buffer`` (batch, heads, positions, head_dim) with zeros appended up to ``size`` positions."""
    extra = buffer.new_zeros((*buffer.shape[:2], size - buffer.shape[2], *buffer.shape[3:]))
    return torch.cat([buffer, extra], dim=2)
