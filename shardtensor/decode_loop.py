"""Greedy decoding that stays on the device: ``st.generate``'s loop when nothing needs the host.

transformers' decoding loop reads every token's logits to the host (``input_ids`` lives there),
chooses the token there and asks the host whether to stop, so each token waits for the previous
one's program and for two transfers: the device idles while the host records and decides. For
greedy search with a static KV cache and only the stock length and end-of-sequence rules, the
choice needs nothing from the host, so this loop keeps it on the device:

- the prefill and the decode step are two ``st.compile``'d functions of the loop's device state
  (last token, position, finished rows, a buffer of all new tokens, the generation's settings). The
  prefill empties the cache and resets the state, then runs the prompt; the step runs the model's
  forward exactly as transformers' loop calls it (``prepare_inputs_for_generation`` with one new
  token). Both choose the token as transformers does (``argmax``, end-of-sequence blocked until
  ``min_new_tokens``, finished rows padded). After their first calls both are replayed frozen: a
  steady generation runs no Python of the model, uploads one small tensor and reads one back;
- the host only calls them, and reads whether every row has finished ``LAG`` steps late (that
  value is long computed by then, so the host does not wait on the chip); the steps run past the
  end are dropped, as transformers' own deferred stop check drops them. The programs' on-device
  checks are read ``LAG`` runs late too (``checks.deferred``), and raise before any token returns.

Anything else (sampling, beams, logits processors or stopping criteria of the caller's, streamers,
``return_dict_in_generate``, other caches) runs transformers' own loop: :func:`decode` is given to
``model.generate`` as ``custom_generate`` and hands those back. The tokens are transformers' (the
same forward inputs, the same choice); tests/test_decode_loop.py compares them with eager torch.

Example::

    out = model.generate(ids, custom_generate=decode_loop.decode, max_new_tokens=20,
                         cache_implementation="static")    # what st.generate does
"""

from __future__ import annotations

import collections
import inspect
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from shardtensor.compiler import compile as st_compile
from shardtensor.graph import checks
from shardtensor.graph.interrupts import deferred_interrupts
from shardtensor.graph.program import mark_scratch
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor.upload import upload_replicated, zeros_on_devices

# Steps the host runs ahead of the stop flag it reads: the flag of step n is read after step n + LAG
# is queued, so the read finds it computed. Finishing early costs up to LAG steps run for nothing.
LAG = 4
# Steps under one SIGINT handler swap (each replay's own block nests in it): a Ctrl-C is delivered
# within this many steps, and the host swaps handlers once per chunk instead of twice a token.
INTERRUPT_CHUNK = 16
# Loops (state buffers and compiled functions) kept per model for its one kept cache: one per set of
# forward inputs (with or without a mask, position ids).
KEPT_LOOPS = 4
# End-of-sequence ids a generation may have on the device loop (more: transformers' loop).
EOS_SLOTS = 8
SETTINGS = 2 + EOS_SLOTS  # pad, eos_blocked, the eos ids


class NotOnDevice(Exception):
    """Raised by :func:`decode` for a generation mode it cannot hand back to transformers itself
    (assisted or Hub-hosted decoding): the caller runs ``model.generate`` without ``custom_generate``."""


@dataclass(frozen=True)
class Plan:
    """What the device loop needs from transformers' prepared processors and criteria."""

    new_tokens: int  # tokens to generate at most (max_length - prompt)
    eos: tuple[int, ...]  # end-of-sequence ids; () when generation never stops early
    pad: int  # what finished rows get
    eos_blocked: int  # the first eos_blocked new tokens may not be an end-of-sequence token


def decode(
    model: Any,
    input_ids: torch.Tensor,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: Any,
    synced_gpus: bool = False,
    streamer: Any = None,
    **model_kwargs: Any,
) -> Any:
    """transformers' decoding method (``custom_generate``) that keeps greedy search on the device.

    Greedy search that :func:`plan` accepts runs :func:`greedy_on_device`; every other case runs
    the method transformers would have run for the generation mode, with the same arguments.

    Example::

        out = model.generate(ids, custom_generate=decode, max_new_tokens=8, cache_implementation="static")
    """
    from transformers.generation.utils import GENERATION_MODES_MAPPING, GenerationMode

    mode = generation_config.get_generation_mode()
    if mode == GenerationMode.GREEDY_SEARCH and not synced_gpus and streamer is None:
        found = plan(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)
        if found is not None:
            return greedy_on_device(model, input_ids, found, generation_config, model_kwargs)
    method_name = GENERATION_MODES_MAPPING.get(mode, "")
    method = getattr(type(model), method_name, None) if "/" not in method_name else None
    if method is None:
        raise NotOnDevice(f"{mode} decoding")
    accepted = inspect.signature(method).parameters
    extra = {k: v for k, v in (("synced_gpus", synced_gpus), ("streamer", streamer)) if k in accepted}
    return method(
        model,
        input_ids,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        generation_config=generation_config,
        **extra,
        **model_kwargs,
    )


# model inputs the device loop passes through to the forward as transformers' loop does
_FORWARD_KWARGS = frozenset(
    {"cache", "past_key_values", "attention_mask", "position_ids", "use_cache", "logits_to_keep"}
)


def plan(
    model: Any,
    input_ids: torch.Tensor,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: Any,
    model_kwargs: dict,
) -> Plan | None:
    """The device loop's settings, or None when this generation needs transformers' host loop.

    Accepted: a decoder-only model, token ids on the host, a static cache of full-attention layers,
    no outputs besides the tokens, the stock max-length and end-of-sequence stopping rules, and only
    the minimum-length processors (they block end-of-sequence for the first tokens).

    Example::

        plan(model, ids, processors, criteria, config, model_kwargs)   # Plan(new_tokens=20, eos=(2,), ...)
    """
    from transformers.cache_utils import StaticCache, StaticLayer
    from transformers.generation.logits_process import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    cache = model_kwargs.get(cache_argument(model))
    if (
        model.config.is_encoder_decoder
        or isinstance(input_ids, ShardedTensor)
        or generation_config.return_dict_in_generate
        or not model_kwargs.get("use_cache", True)
        or set(model_kwargs) - _FORWARD_KWARGS
        or not isinstance(cache, StaticCache)
        or any(type(layer) is not StaticLayer for layer in cache.layers)
    ):
        return None
    prompt = input_ids.shape[1]
    max_length, eos = None, None
    for criterion in stopping_criteria:
        if type(criterion) is MaxLengthCriteria:
            max_length = criterion.max_length
        elif type(criterion) is EosTokenCriteria:
            eos = tuple(int(i) for i in criterion.eos_token_id.flatten().tolist())
        else:
            return None
    blocked = 0
    for processor in logits_processor:
        if type(processor) is MinNewTokensLengthLogitsProcessor:
            first = processor.min_new_tokens + processor.prompt_length_to_skip - prompt
        elif type(processor) is MinLengthLogitsProcessor:
            first = processor.min_length - prompt
        else:
            return None
        if eos is None or set(int(i) for i in processor.eos_token_id.flatten().tolist()) != set(eos):
            return None  # blocks tokens that are not the ones stopping generation: transformers' loop
        blocked = max(blocked, first)
    pad = generation_config._pad_token_tensor
    length = _cache_length(cache)
    if max_length is None or not prompt < max_length <= length + 1:
        return None
    if eos and (pad is None or len(eos) > EOS_SLOTS):
        return None
    return Plan(new_tokens=max_length - prompt, eos=eos or (), pad=int(pad) if eos else 0, eos_blocked=max(blocked, 0))


class _Loop:
    """The device state of greedy decoding for one cache and batch, and its two compiled functions.

    ``prefill`` empties the cache, resets the state and runs the prompt; ``step`` decodes one token.
    Both read and write these same tensors, so they are kept per model and reused by later
    generations: after the first two generations the prefill is replayed frozen as well, and a
    generation records no op at all. The buffers are made on the devices outside any program (the
    first generation's programs are the later ones'); the generation's settings (eos ids, pad,
    min_new_tokens) come in as values, so changing them compiles nothing.
    """

    def __init__(self, model: Any, cache: Any, cache_name: str, batch: int, masked: bool, positioned: bool):
        # (weakly: the loop is kept in a weak dict keyed by the model, which it must not keep alive)
        self._model, self.cache, self.cache_name = weakref.ref(model), cache, cache_name
        self.length = _cache_length(cache)
        self.mask = zeros_on_devices((batch, self.length), torch.long) if masked else None
        self.position = zeros_on_devices((batch, 1), torch.long) if positioned else None
        self.token = zeros_on_devices((batch, 1), torch.long)
        self.unfinished = zeros_on_devices((batch,), torch.long)
        self.count = zeros_on_devices((), torch.long)
        self.tokens = zeros_on_devices((batch, self.length), torch.long)  # (room for any max_new_tokens)
        self.eos = zeros_on_devices((EOS_SLOTS,), torch.long)
        self.pad = zeros_on_devices((), torch.long)
        self.blocked = zeros_on_devices((), torch.long)
        for buffer in (self.mask, self.position, self.token, self.unfinished, self.count, self.tokens):
            if buffer is not None:  # (the prefill resets them: a failed step need not keep them)
                mark_scratch(buffer._cell)
        self.prefill = st_compile(self._prefill, name="st.generate prefill")
        self.step = st_compile(self._step, name="st.generate decode step")
        self.forward_extra: dict = {}

    @property
    def model(self) -> Any:
        return self._model()

    def _prefill(self, packed: torch.Tensor) -> torch.Tensor:
        """Start a generation from ``packed`` (one upload, :func:`_packed`): the prompt's ids and
        transformers' ``attention_mask`` and ``position_ids`` for it (zeros where it passes none),
        then (pad, eos_blocked, eos ids padded with -1); returns whether every row has finished
        after the first token."""
        prompt = (packed.shape[1] - SETTINGS) // 3
        ids = packed[:, :prompt]
        mask = packed[:, prompt : 2 * prompt] if self.mask is not None else None
        positions = packed[:, 2 * prompt : 3 * prompt] if self.position is not None else None
        settings = packed[0, 3 * prompt :]
        for layer in self.cache.layers:  # empty (a new generation must not see an old one's keys)
            layer.keys.zero_()
            layer.values.zero_()
            layer.cumulative_length.zero_()
        self.pad.copy_(settings[0])
        self.blocked.copy_(settings[1])
        self.eos.copy_(settings[2:])
        self.unfinished.fill_(1)
        self.count.zero_()
        if self.mask is not None and mask is not None:  # (the loop is made per presence of each)
            # the mask of the whole cache: the prompt's padding, then every later position visible
            # (the causal rule hides the ones not written yet), so that it never changes while decoding
            rest = self.length - mask.shape[1]
            self.mask.copy_(torch.cat([mask, mask.new_ones((mask.shape[0], rest))], 1).long())
        if self.position is not None and positions is not None:
            self.position.copy_(positions[:, -1:] + 1)  # the first new token's
        inputs = self.model.prepare_inputs_for_generation(
            ids,
            is_first_iteration=True,
            attention_mask=mask,
            **{self.cache_name: self.cache},
            **({"position_ids": positions} if positions is not None else {}),
            use_cache=True,
            **self.forward_extra,
        )
        outputs = self.model(**inputs, return_dict=True)
        return self.choose(outputs.logits[:, -1])

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token from ``logits`` (batch, vocab) as transformers' greedy loop chooses it,
        written into the state; returns whether every row has finished (a 0-d device tensor)."""
        logits = logits.float()
        vocab = torch.arange(logits.shape[-1], device=logits.device)
        blocked = torch.isin(vocab, self.eos) & (self.count < self.blocked)
        logits = torch.where(blocked, -math.inf, logits)
        token = logits.argmax(-1)
        token = token * self.unfinished + self.pad * (1 - self.unfinished)
        self.unfinished.copy_(self.unfinished & ~torch.isin(token, self.eos))
        self.tokens.index_copy_(1, self.count.view(1), token.view(-1, 1))
        self.token.copy_(token.view(-1, 1))
        self.count.add_(1)
        return self.unfinished.max() == 0

    def _step(self) -> torch.Tensor:
        inputs = self.model.prepare_inputs_for_generation(
            self.token,
            next_sequence_length=1,
            **{self.cache_name: self.cache},
            attention_mask=self.mask,
            **({"position_ids": self.position} if self.position is not None else {}),
            use_cache=True,
            **self.forward_extra,
        )
        outputs = self.model(**inputs, return_dict=True)
        done = self.choose(outputs.logits[:, -1])
        if self.position is not None:
            self.position.add_(1)
        return done


# model -> {shape key: _Loop}; weak, so a deleted model takes its loops (and their buffers) with it
_LOOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (shape key, its one cache)


def greedy_on_device(
    model: Any, input_ids: torch.Tensor, plan: Plan, generation_config: Any, model_kwargs: dict
) -> Any:
    """Greedy search as transformers' ``_sample`` runs it, with the loop on the device (module doc).

    Returns ``input_ids`` (on the host) followed by the new tokens, as ``model.generate`` does.

    Example::

        greedy_on_device(model, ids, plan(...), generation_config, model_kwargs)
    """
    name = cache_argument(model)
    model_kwargs[name] = _reused_cache(model, model_kwargs[name], input_ids.shape[0])
    loop = _loop_for(model, input_ids.shape[0], model_kwargs)
    flags: collections.deque = collections.deque()
    done = loop.prefill(upload_replicated(_packed(input_ids, model_kwargs, plan)))
    produced = plan.new_tokens
    with checks.deferred(LAG):  # the steps' checks are read LAG steps late, when long computed
        for start in range(0, plan.new_tokens, INTERRUPT_CHUNK):
            with deferred_interrupts():
                finished = _steps(loop, plan, done, flags, start, min(start + INTERRUPT_CHUNK, plan.new_tokens))
            if finished is not None:
                produced = finished + 1
                break
    checks.verify()
    if produced == plan.new_tokens and (finished := _first_finished(flags, keep=0)) is not None:
        produced = finished + 1
    new = loop.tokens.cpu()[:, :produced]
    return torch.cat([input_ids, new.to(input_ids.dtype)], dim=1)


def _steps(loop: _Loop, plan: Plan, done: Any, flags: collections.deque, start: int, stop: int) -> int | None:
    """Steps ``start`` to ``stop`` of the loop (step 0 is the prefill's token, ``done`` its flag);
    returns the first step at which every row had ended, read ``LAG`` steps late, or None."""
    for index in range(start, stop):
        if index:
            done = loop.step()
        if not plan.eos or index < plan.eos_blocked:
            continue  # (no row can have ended: nothing to read)
        flags.append((index, done))
        if len(flags) > LAG and (finished := _first_finished(flags, keep=LAG)) is not None:
            return finished
    return None


def _reused_cache(model: Any, fresh: Any, batch: int) -> Any:
    """The model's static cache of ``fresh``'s size from an earlier generation, else ``fresh`` with
    its buffers made now (the loop's prefill empties it), kept instead of the one before.

    transformers makes a new cache for every ``generate``, its buffers made by the prefill; the
    frozen prefill and decode step read and write the cache's own tensors, so one cache serves
    every generation of a shape. Its buffers are made outside any program, so the prefill program
    is the same from the first call on.
    """
    shape = model._get_static_cache_init_shape()
    if shape is None or not all(isinstance(n, int) for n in shape):
        return fresh  # (a model whose layers differ in shape: transformers' lazily made cache)
    heads, head_dim = shape
    key = (batch, model.dtype, tuple((type(layer), layer.max_cache_len) for layer in fresh.layers))
    kept = _CACHES.get(model)
    if kept is not None and kept[0] == key:
        return kept[1]
    release(model)  # one cache per model: the old one's memory goes before the new one is made
    device = next(model.parameters()).device
    fresh.early_initialization(batch, heads, head_dim, model.dtype, device)  # sizes, flags; buffers below
    for layer in fresh.layers:
        layer.keys = zeros_on_devices(layer.keys.shape, layer.keys.dtype)
        layer.values = zeros_on_devices(layer.values.shape, layer.values.dtype)
        layer.cumulative_length = zeros_on_devices((), layer.cumulative_length.dtype)
        for buffer in (layer.keys, layer.values, layer.cumulative_length):
            # a failed check need not restore it (the next prefill empties it), which would cost a
            # copy of the cache and two passes over it every decode step (graph.program.mark_scratch)
            mark_scratch(buffer._cell)
    _CACHES[model] = (key, fresh)
    return fresh


def release(model: Any) -> None:
    """Free the KV cache and decode-loop buffers ``st.generate`` keeps for ``model``.

    They are kept so that the next generation of the same shape reuses them (and its frozen
    programs); they go with the model, or when a generation of another shape needs a new cache.
    Call this to give their device memory back earlier (before training the model, say).

    Example::

        out = st.generate(model, ids, max_new_tokens=100)
        st.decode_loop.release(model)   # the cache's memory is free again
    """
    _CACHES.pop(model, None)
    _LOOPS.pop(model, None)


def kept_cache_bytes(model: Any) -> int:
    """Bytes of the KV cache kept for ``model`` (0 if none): memory a new generation can reuse.

    Example::

        kept_cache_bytes(model)   # 2 * layers * batch * kv_heads * positions * head_dim * itemsize
    """
    kept = _CACHES.get(model)
    if kept is None:
        return 0
    return sum(t.numel() * t.element_size() for layer in kept[1].layers for t in (layer.keys, layer.values))


def _first_finished(flags: collections.deque, keep: int) -> int | None:
    """Pop the stop flags older than the last ``keep``; the index of the first one that is set."""
    while len(flags) > keep:
        index, flag = flags.popleft()
        if bool(flag):
            return index
    return None


def _loop_for(model: Any, batch: int, model_kwargs: dict) -> _Loop:
    """The model's loop for this cache and batch (made on first use)."""
    cache = model_kwargs[cache_argument(model)]
    masked, positioned = model_kwargs.get("attention_mask") is not None, model_kwargs.get("position_ids") is not None
    extra = {k: v for k, v in model_kwargs.items() if k == "logits_to_keep"}
    key = (batch, id(cache), masked, positioned, tuple(extra.items()))
    loops = _LOOPS.setdefault(model, {})
    loop = loops.get(key)
    if loop is None or loop.cache is not cache:
        loop = _Loop(model, cache, cache_argument(model), batch, masked, positioned)
        loop.forward_extra = extra
        while len(loops) >= KEPT_LOOPS:  # the oldest goes: its buffers would only hold memory
            loops.pop(next(iter(loops)))
        loops[key] = loop
    return loop


def _packed(input_ids: torch.Tensor, model_kwargs: dict, plan: Plan) -> torch.Tensor:
    """The prefill's inputs in one host tensor (one upload): ids, mask, positions (zeros where
    transformers passes none), then the settings, repeated on every row."""
    zeros = torch.zeros_like(input_ids)
    mask, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
    settings = torch.tensor([plan.pad, plan.eos_blocked, *plan.eos] + [-1] * (EOS_SLOTS - len(plan.eos)))
    parts = [input_ids, zeros if mask is None else mask, zeros if positions is None else positions]
    return torch.cat([p.long() for p in parts] + [settings.expand(input_ids.shape[0], -1)], dim=1)


def cache_argument(model: Any) -> str:
    """transformers' name for the cache among ``generate``'s and the forward's inputs: ``cache`` from
    5.24, ``past_key_values`` before.

    Example::

        model.generate(ids, **{cache_argument(model): my_cache})
    """
    parameters = inspect.signature(model.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _cache_length(cache: Any) -> int:
    """The positions a static cache holds (its layers all hold as many: full attention only)."""
    return int(cache.layers[0].max_cache_len)
