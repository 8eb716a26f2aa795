"""st.generate's device loop (shardtensor/decode_loop.py): greedy decoding whose tokens, stop rule and
checks stay on the device, compared with eager transformers on the CPU.

Also the pieces it is made of: ``checks.deferred`` (checks read a few runs late) and
``tensor.upload.zeros_on_devices`` (buffers made without a program).
"""

from __future__ import annotations

import re
import signal

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import shardtensor as st
from _training_helpers import fresh_executable_cache
from shardtensor import decode_loop
from shardtensor.graph import checks, execute, program
from shardtensor.runtime import x64_scope
from shardtensor.tensor.upload import zeros_on_devices
from test_generation import GREEDY, NEW_TOKENS, VOCAB, _clean, compiles, tiny  # noqa: F401 (_clean: autouse)


def counted(name: str) -> int:
    return st.counter_value(name) or 0


def left_padded_batch(seed: int):
    """Two prompts of 9 and 6 tokens, the second left-padded by its mask."""
    torch.manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


def _llama_on_device(seed: int):
    """The tiny Llama, a left-padded batch and eager transformers' greedy tokens for it; then the
    model on the devices, with no compiled program cached."""
    model = tiny("llama")
    ids, mask = left_padded_batch(seed)
    expected = model.generate(ids, attention_mask=mask, **GREEDY)
    model.to(st.device())
    st.sync()
    fresh_executable_cache()
    return model, ids, mask, expected


def test_greedy_tokens_equal_eager_and_the_host_reads_nothing_per_token():
    """A left-padded batch, no end-of-sequence token: the tokens are eager transformers'; every
    decode step after the first two is a frozen replay; the host reads back only the tokens at the
    end (no logits, no stop flag per token), and a second generation compiles nothing."""
    model, ids, mask, expected = _llama_on_device(0)
    before = compiles()
    torch.testing.assert_close(st.generate(model, ids, attention_mask=mask, **GREEDY), expected, rtol=0, atol=0)
    assert compiles() - before == 2  # the prefill and the decode step

    replays, reads, before = counted("CompileReplay"), counted("TransferFromDevice"), compiles()
    out = st.generate(model, ids, attention_mask=mask, **GREEDY)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert counted("CompileReplay") - replays == NEW_TOKENS - 1  # every decode step replayed frozen
    assert counted("TransferFromDevice") - reads <= 2  # the tokens at the end (transformers' loop: 2 per token)
    assert compiles() == before

    traces, replays = counted("CompileTrace"), counted("CompileReplay")  # the prefill froze on the 2nd call
    torch.testing.assert_close(st.generate(model, ids, attention_mask=mask, **GREEDY), expected, rtol=0, atol=0)
    assert counted("CompileTrace") == traces  # a third generation records no op: prefill and steps replayed
    assert counted("CompileReplay") - replays == NEW_TOKENS


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_end_of_sequence_and_min_new_tokens_as_in_eager(kind):
    """An eos token that one row produces early: that row is padded after it while the other goes
    on, generation stops when both have ended (the steps run past the end are dropped); with
    min_new_tokens the eos is blocked first. New settings compile nothing: they are values."""
    model = tiny(kind)
    ids, mask = left_padded_batch(1)
    plain = model.generate(ids, attention_mask=mask, **GREEDY)
    eos = int(plain[0, 9 + 2])  # the first row's third new token
    cases = [
        dict(GREEDY, eos_token_id=eos),
        dict(GREEDY, eos_token_id=[eos, int(plain[1, 9 + 5])]),
        dict(GREEDY, eos_token_id=eos, min_new_tokens=5),
        dict(GREEDY, eos_token_id=eos, max_new_tokens=NEW_TOKENS - 3),
    ]
    expected = [model.generate(ids, attention_mask=mask, **kwargs) for kwargs in cases]
    assert any(e.shape[1] < 9 + NEW_TOKENS for e in expected)  # some generation stopped early

    model.to(st.device())
    st.sync()
    st.generate(model, ids, attention_mask=mask, **GREEDY)
    before = compiles()
    for kwargs, want in zip(cases, expected):
        torch.testing.assert_close(st.generate(model, ids, attention_mask=mask, **kwargs), want, rtol=0, atol=0)
    assert compiles() == before


def test_what_the_device_loop_does_not_do_runs_transformers_loop():
    """A logits processor of transformers' that the device loop does not run (a repetition
    penalty), or device_loop=False: transformers' own loop, tokens as in eager torch."""
    model = tiny("llama")
    ids, mask = left_padded_batch(2)
    kwargs = dict(GREEDY, repetition_penalty=1.5)
    expected = model.generate(ids, attention_mask=mask, **kwargs)
    plain = model.generate(ids, attention_mask=mask, **GREEDY)
    model.to(st.device())
    st.sync()
    replays = counted("CompileReplay")
    torch.testing.assert_close(st.generate(model, ids, attention_mask=mask, **kwargs), expected, rtol=0, atol=0)
    out = st.generate(model, ids, attention_mask=mask, device_loop=False, **GREEDY)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    assert counted("CompileReplay") == replays  # no decode step of the device loop ran


def test_one_cache_is_kept_per_model_and_release_frees_it():
    """Generations of another batch size replace the kept cache (one per model, the old one freed
    first); kept_cache_bytes is its size; release() frees it, and the next generation still works."""
    model = tiny("llama")
    ids, mask = left_padded_batch(5)
    expected = model.generate(ids, attention_mask=mask, **GREEDY)
    model.to(st.device())
    st.generate(model, ids[:1], attention_mask=mask[:1], **GREEDY)
    st.generate(model, ids, attention_mask=mask, **GREEDY)
    (key, cache), length = decode_loop._CACHES[model], 32  # the bucket of 16 + 10 new tokens
    assert key[0] == 2 and cache.layers[0].keys.shape[0] == 2
    assert decode_loop.kept_cache_bytes(model) == st.generation.static_cache_bytes(model, 2, length)
    decode_loop.release(model)
    assert decode_loop.kept_cache_bytes(model) == 0 and model not in decode_loop._LOOPS
    torch.testing.assert_close(st.generate(model, ids, attention_mask=mask, **GREEDY), expected, rtol=0, atol=0)


def test_a_deleted_model_takes_its_loop_and_cache_with_it():
    """The loops and caches are kept per model, weakly: deleting the model frees them."""
    import gc

    model = tiny("llama")
    ids, mask = left_padded_batch(4)
    model.to(st.device())
    st.generate(model, ids, attention_mask=mask, **GREEDY)
    assert model in decode_loop._LOOPS and model in decode_loop._CACHES
    kept = len(decode_loop._LOOPS)
    del model
    gc.collect()
    assert len(decode_loop._LOOPS) == kept - 1


def test_plan_refuses_what_it_cannot_do():
    """plan(): sampling-only settings never reach it (transformers' mode decides); processors it does
    not know, a dynamic cache or extra model inputs give None (transformers' loop)."""
    from transformers.cache_utils import DynamicCache, StaticCache
    from transformers.generation.logits_process import LogitsProcessorList, RepetitionPenaltyLogitsProcessor
    from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList

    model = tiny("llama")
    config = model.generation_config
    config._pad_token_tensor = torch.tensor(0)
    ids = torch.zeros((1, 4), dtype=torch.long)
    name = decode_loop.cache_argument(model)  # ("cache" from transformers 5.24)
    static = StaticCache(config=model.config, max_cache_len=16)
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=10)])
    ok = decode_loop.plan(model, ids, LogitsProcessorList(), criteria, config, {name: static, "use_cache": True})
    assert ok == decode_loop.Plan(new_tokens=6, eos=(), pad=0, eos_blocked=0)
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)])
    assert decode_loop.plan(model, ids, penalty, criteria, config, {name: static}) is None
    assert decode_loop.plan(model, ids, LogitsProcessorList(), criteria, config, {name: DynamicCache()}) is None
    extra = {name: static, "token_type_ids": ids}
    assert decode_loop.plan(model, ids, LogitsProcessorList(), criteria, config, extra) is None
    too_long = StoppingCriteriaList([MaxLengthCriteria(max_length=40)])  # more than the cache holds
    assert decode_loop.plan(model, ids, LogitsProcessorList(), too_long, config, {name: static}) is None


def _top_level_results(hlo: str, shape: str) -> list[str]:
    """The opcodes of the entry computation's instructions whose result has ``shape`` (``f32[2,2,16,16]``)."""
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    ops = re.findall(rf"= {re.escape(shape)}(?:{{[^}}]*}})? ([a-z][a-z0-9\-]*)\(", entry)
    return [op for op in ops if op not in ("parameter", "bitcast", "get-tuple-element")]


@pytest.mark.parametrize("selects", [True, False])
def test_the_decode_step_updates_the_kv_cache_in_place_with_checks_on(monkeypatch, selects):
    """The decode step has checks (its cache write, its embedding lookup), but a failure need not
    restore the loop's cache and state (the next prefill resets them: graph.program.mark_scratch).
    So its compiled program writes each cache buffer once, in place: no copy, select or conditional
    of a cache-sized buffer (a TPU paid a copy of the whole cache and two passes over it per token for
    that restore, by selects or by a conditional: ``selects``). The tokens are eager transformers'."""
    monkeypatch.setattr(program, "rollback_by_selects", lambda mesh: selects)
    model, ids, mask, expected = _llama_on_device(2)
    torch.testing.assert_close(st.generate(model, ids, attention_mask=mask, **GREEDY), expected, rtol=0, atol=0)
    (loop,) = decode_loop._LOOPS[model].values()
    (frozen,) = loop.step._frozen.values()
    prog = frozen.executable.program
    assert prog.checks and prog.check_table  # (the step is checked, as st.compile's default)
    values = [None if kind == "arg" else ref().value if kind == "old" else ref for kind, _, ref in frozen.sources]
    with x64_scope():
        lowered = frozen.executable.lower(*execute._call_arguments(prog, values, frozen.scalars))
        hlo = lowered.compile().as_text()
    buffers = [t for layer in loop.cache.layers for t in (layer.keys, layer.values)]
    shape = "f32[" + ",".join(map(str, buffers[0].shape)) + "]"
    written = _top_level_results(hlo, shape)  # (before: a copy of each buffer, and selects or a conditional)
    assert len(written) == len(buffers) and set(written) <= {"fusion", "dynamic-update-slice"}, written
    assert " conditional(" not in hlo


def test_a_failed_check_in_the_loop_raises_as_torch_does_and_the_next_generation_works():
    """GPT-2 with 16 positions asked for more tokens than it has positions: eager torch raises
    IndexError from the position embedding; so does st.generate (the check read a few steps late,
    before any token is returned). The next generation within range equals eager torch."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, eos_token_id=None)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(3, VOCAB, (1, 5))
    too_many = dict(GREEDY, max_new_tokens=14)  # positions 5..18
    with pytest.raises(IndexError):
        model.generate(ids, **too_many)
    expected = model.generate(ids, **dict(GREEDY, max_new_tokens=8))
    model.to(st.device())
    st.sync()
    with pytest.raises(IndexError, match="index out of range"):
        st.generate(model, ids, buckets=False, **too_many)
    out = st.generate(model, ids, buckets=False, **dict(GREEDY, max_new_tokens=8))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["raised", "signal"])
def test_an_interrupt_mid_generation_leaves_the_next_one_correct(how):
    """Ctrl-C between two decode steps: KeyboardInterrupt reaches the caller; the next generation
    starts from a clean state (cache and loop buffers reset) and equals eager torch. A SIGINT the OS
    delivers while a step runs arrives at the end of its chunk of steps (one handler swap per chunk),
    never mid-replay."""
    model = tiny("llama")
    ids, mask = left_padded_batch(3)
    greedy = dict(GREEDY, max_new_tokens=decode_loop.INTERRUPT_CHUNK + 4)
    expected = model.generate(ids, attention_mask=mask, **greedy)
    model.to(st.device())
    st.sync()
    st.generate(model, ids, attention_mask=mask, **greedy)
    (loop,) = decode_loop._LOOPS[model].values()
    step, calls = loop.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            if how == "raised":
                raise KeyboardInterrupt
            signal.raise_signal(signal.SIGINT)
        return step()

    loop.step = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            st.generate(model, ids, attention_mask=mask, **greedy)
    finally:
        loop.step = step
    # raised: at once; a signal: after the first chunk's steps (step 0 is the prefill's)
    assert len(calls) == (3 if how == "raised" else decode_loop.INTERRUPT_CHUNK - 1)
    torch.testing.assert_close(st.generate(model, ids, attention_mask=mask, **greedy), expected, rtol=0, atol=0)


def test_checks_deferred_reads_a_failure_late_but_raises_it():
    """Inside checks.deferred(n) a compiled call's failed check stays unread while it is among the
    newest n runs; verify() after the block raises it (torch's IndexError)."""
    x = torch.arange(12.0).reshape(4, 3)
    dx = x.to(st.device())

    @st.compile
    def pick(rows):
        return dx.index_select(0, rows)

    good, bad = torch.tensor([0, 3]).to(st.device()), torch.tensor([0, 9]).to(st.device())
    torch.testing.assert_close(pick(good).cpu(), x[[0, 3]])
    with checks.deferred(5):
        pick(bad)
        pick(good)  # the failure of the call before is not read yet
    with pytest.raises(IndexError, match="out of range"):
        checks.verify()
    with pytest.raises(IndexError):
        pick(bad)  # outside: raised by the call that failed


def test_zeros_on_devices_is_made_without_a_program():
    """zeros_on_devices: a replicated zero buffer made by JAX on the devices, no op recorded and no
    program run; it reads back as zeros and is an input of the programs that use it."""
    st.set_global_mesh(st.Mesh(range(8), (4, 2), ("x", "y")))
    st.sync()
    runs = counted("ExecuteReplicated")
    z = zeros_on_devices((6, 3), torch.float32)
    n = zeros_on_devices((), torch.long)
    assert counted("ExecuteReplicated") == runs
    assert (z.shape, z.dtype, n.dtype) == ((6, 3), torch.float32, torch.long)
    torch.testing.assert_close(z.cpu(), torch.zeros(6, 3))
    z.add_(1)
    n.add_(7)
    torch.testing.assert_close(z.cpu(), torch.ones(6, 3))
    assert int(n) == 7
