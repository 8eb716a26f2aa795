"""Issue 16 §1 / issue 18: Hugging Face generation on shardtensor in a fixed number of programs.

``st.generate`` (docs/generation.md) runs ``model.generate`` with transformers' static KV cache, the
token bookkeeping on the host and the prompt left-padded to a bucket: the prefill and the decode step
are the only programs, whatever the number of new tokens, and a second prompt of another length in
the same bucket compiles nothing. Greedy tokens are compared with the same model's ``generate`` in
eager torch on CPU: the token ids must be equal (a wrong logit would almost surely change an argmax
within 10 tokens of a random model). Models are tiny random-init GPT-2, Llama and T5 configs (no
download); also: the weights sharded tensor-parallel, the growing cache, the frozen decode step.
"""

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

import shardtensor as st
from _training_helpers import fresh_executable_cache, reset_state

NEW_TOKENS = 10
VOCAB = 128


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    previous = st.get_global_mesh()
    yield
    st.set_global_mesh(previous)
    reset_state()


def tiny(kind: str):
    """A random-init 2-layer causal LM: 'gpt2' or 'llama' (grouped-query attention)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=1, eos_token_id=None
        )
        return GPT2LMHeadModel(config).eval()
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def compiles() -> int:
    return st.counter_value("UncachedCompile") or 0


GREEDY = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_static_cache_generate_compiles_prefill_and_decode_once(kind):
    model = tiny(kind)
    torch.manual_seed(1)
    first, second = torch.randint(3, VOCAB, (1, 7)), torch.randint(3, VOCAB, (1, 12))
    expected = [model.generate(first, **GREEDY), model.generate(second, **GREEDY)]

    model.to(st.device())
    st.sync()  # the parameters' upload is not part of generation
    fresh_executable_cache()
    before = compiles()
    out = st.generate(model, first, **GREEDY)
    assert out.device == first.device  # the result comes back where the prompt was
    torch.testing.assert_close(out, expected[0], rtol=0, atol=0)
    assert compiles() - before == 2  # the prefill and the decode step, for all 10 tokens

    before = compiles()
    torch.testing.assert_close(st.generate(model, second, **GREEDY), expected[1], rtol=0, atol=0)
    assert compiles() == before  # 12 tokens pad to the same bucket (16) as 7: both programs reused

    # an EOS token (here: the third new token) stops generation as on CPU, in the same programs
    eos = int(expected[1][0, 14])
    stop = 12 + next(i for i in range(NEW_TOKENS) if int(expected[1][0, 12 + i]) == eos) + 1
    out = st.generate(model, second, **dict(GREEDY, eos_token_id=eos))
    torch.testing.assert_close(out, expected[1][:, :stop], rtol=0, atol=0)
    assert compiles() == before


def test_compiled_decode_step_is_replayed_frozen():
    """compile_decode=True: transformers torch.compiles the decode step with shardtensor's backend; it
    is captured once and replayed frozen for every later token (CompileReplay), tokens unchanged."""
    model = tiny("gpt2")
    torch.manual_seed(5)
    ids = torch.randint(3, VOCAB, (1, 7))
    expected = model.generate(ids, **GREEDY)
    model.to(st.device())
    st.sync()
    try:
        replays = st.counter_value("CompileReplay") or 0
        out = st.generate(model, ids, compile_decode=True, **GREEDY)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        assert (st.counter_value("CompileReplay") or 0) - replays >= NEW_TOKENS - 3  # all but the first steps
    finally:
        torch._dynamo.reset()  # the compiled call is the model's; Dynamo's caches are process-wide


def test_growing_cache_compiles_per_bucket():
    """cache_implementation="dynamic": the cache starts at the prompt's bucket (16) and doubles when
    full; 10 tokens after a 7-token prompt are the prefill, the step that grows it to 32 and the
    steady step at 32. The next prompt (12 tokens) reuses them; tokens as in eager torch."""
    model = tiny("gpt2")
    torch.manual_seed(4)
    first, second = torch.randint(3, VOCAB, (1, 7)), torch.randint(3, VOCAB, (1, 12))
    expected = [model.generate(first, **GREEDY), model.generate(second, **GREEDY)]

    model.to(st.device())
    st.sync()
    fresh_executable_cache()
    before = compiles()
    out = st.generate(model, first, cache_implementation="dynamic", **GREEDY)
    torch.testing.assert_close(out, expected[0], rtol=0, atol=0)
    assert compiles() - before == 3
    before = compiles()
    out = st.generate(model, second, cache_implementation="dynamic", **GREEDY)
    torch.testing.assert_close(out, expected[1], rtol=0, atol=0)
    assert compiles() == before


def test_prompt_on_device_and_batched_left_padding():
    """input_ids on st.device() come back there; a batch left-padded by the user (attention_mask)
    keeps its own padding and gets the bucket's on top, tokens as on CPU."""
    model = tiny("llama")
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, 6))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # the second prompt is 4 tokens, left-padded by the "tokenizer"
    expected = model.generate(ids, attention_mask=mask, **GREEDY)

    model.to(st.device())
    out = st.generate(model, ids.to(st.device()), attention_mask=mask, **GREEDY)
    assert out.device.type == "shardtensor"
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)


def test_sharded_weights_tensor_parallel():
    """The GPT-2's attention and MLP weights sharded Megatron-style over the 'model' axis of a (4, 2)
    mesh: the same tokens as eager torch, and still two programs."""
    model = tiny("gpt2")
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (1, 9))
    expected = model.generate(ids, **GREEDY)

    mesh = st.Mesh(range(8), (4, 2), ("data", "model"))
    st.set_global_mesh(mesh)
    model.to(st.device())
    for block in model.transformer.h:  # GPT-2's Conv1D weights are (in, out)
        for column in (block.attn.c_attn, block.mlp.c_fc):  # split the output features
            st.mark_sharding(column.weight, mesh, (None, "model"))
            st.mark_sharding(column.bias, mesh, ("model",))
        for row in (block.attn.c_proj, block.mlp.c_proj):  # split the input features
            st.mark_sharding(row.weight, mesh, ("model", None))
    st.sync()
    fresh_executable_cache()
    before = compiles()
    torch.testing.assert_close(st.generate(model, ids, **GREEDY), expected, rtol=0, atol=0)
    assert compiles() - before == 2
    assert model.transformer.h[0].mlp.c_fc.weight.partition_spec == st.P(None, "model")  # still sharded


def tiny_t5():
    """A one-layer random-init T5 (seed 0), in eval mode."""
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=1,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(config).eval()


def test_encoder_decoder():
    """T5: st.generate runs the encoder on the device once, then the decoder's prefill and decode step;
    a prompt of another length in the bucket compiles nothing; tokens as in eager torch."""
    model, greedy = tiny_t5(), {"max_new_tokens": NEW_TOKENS, "do_sample": False, "eos_token_id": None}
    first, second = torch.randint(3, VOCAB, (1, 7)), torch.randint(3, VOCAB, (1, 12))
    expected = [model.generate(first, **greedy), model.generate(second, **greedy)]

    model.to(st.device())
    st.sync()
    torch.testing.assert_close(st.generate(model, first, **greedy), expected[0], rtol=0, atol=0)
    before = compiles()
    torch.testing.assert_close(st.generate(model, second, **greedy), expected[1], rtol=0, atol=0)
    assert compiles() == before


def test_recompile_warning_in_generate_names_st_generate():
    from shardtensor.graph import recompile

    assert "st.generate" in recompile._generation_hint(("utils.py", 3248, "transformers.generation.utils"))
    assert recompile._generation_hint(("train.py", 3, "__main__")) == ""


def test_bucket_length_and_bad_input():
    assert [st.generation.bucket_length(n) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    model = tiny("gpt2")
    with pytest.raises(ValueError, match="2-D tensor"):
        st.generate(model, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="not 'offloaded'"):
        st.generate(model, torch.tensor([[1, 2, 3]]), cache_implementation="offloaded")
    with pytest.raises(ValueError, match="compile_decode=True needs the static cache"):
        st.generate(model, torch.tensor([[1, 2, 3]]), cache_implementation="dynamic", compile_decode=True)
    with pytest.raises(ValueError, match="makes its own cache"):
        st.generate(model, torch.tensor([[1, 2, 3]]), cache=None)


def test_model_generate_with_ids_on_device_keeps_the_tokens_on_the_host():
    """Plain model.generate with input_ids on st.device() and a static cache: the growing token
    tensors stay on the host (integrations/generate_on_host.py), so the whole generation is two
    programs; the result comes back on the device (read back without a program), tokens and scores as
    on CPU."""
    model = tiny("llama")
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row
    opts = dict(GREEDY, cache_implementation="static", return_dict_in_generate=True, output_scores=True)
    expected = model.generate(ids, attention_mask=mask, **opts)

    model.to(st.device())
    dev_ids, dev_mask = ids.to(st.device()), mask.to(st.device())
    st.sync()  # the prompt's upload (a program of the caller's) is not counted
    fresh_executable_cache()
    before = compiles()
    out = model.generate(dev_ids, attention_mask=dev_mask, **opts)
    assert isinstance(out.sequences, st.ShardedTensor)
    torch.testing.assert_close(out.sequences.cpu(), expected.sequences, rtol=0, atol=0)
    assert len(out.scores) == NEW_TOKENS and all(isinstance(s, st.ShardedTensor) for s in out.scores)
    torch.testing.assert_close(out.scores[-1].cpu(), expected.scores[-1], rtol=1e-4, atol=1e-4)
    assert compiles() - before == 2  # prefill and decode step for all 10 tokens; the reads ran none

    # code of the caller's (a logits processor) may hold device tensors: generate runs as it is, on the
    # device, one program per token, with the same tokens
    from transformers import LogitsProcessorList

    three = dict(GREEDY, max_new_tokens=3)  # (a program per token: a few are enough)
    plain = model.generate(dev_ids, attention_mask=dev_mask, logits_processor=LogitsProcessorList(), **three)
    torch.testing.assert_close(plain.cpu(), expected.sequences[:, : 7 + 3], rtol=0, atol=0)


def test_model_generate_encoder_decoder_with_ids_on_device():
    """T5's plain generate with input_ids on st.device(): the encoder joins the first decoder step's
    program, then one decode step: two programs, the tokens of eager torch."""
    from transformers.generation.utils import GenerationMixin

    assert GenerationMixin.generate._shardtensor_wrapped  # import shardtensor wrapped it
    model, greedy = tiny_t5(), {"max_new_tokens": NEW_TOKENS, "do_sample": False, "eos_token_id": None}
    ids = torch.randint(3, VOCAB, (1, 7))
    expected = model.generate(ids, cache_implementation="static", **greedy)

    model.to(st.device())
    dev_ids = ids.to(st.device())
    st.sync()
    fresh_executable_cache()
    before = compiles()
    out = model.generate(dev_ids, cache_implementation="static", **greedy)
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    assert compiles() - before == 2


def test_a_cache_that_cannot_fit_is_refused_and_a_failed_call_leaves_nothing():
    """Issue 35: max_new_tokens=10**6 grew host memory to 8.9 GB, and every later call failed too."""
    model = tiny("llama")
    torch.manual_seed(1)
    prompt = torch.randint(3, VOCAB, (1, 7))
    expected = model.generate(prompt, **GREEDY)
    model.to(st.device())  # not synced: its upload must not be lost with a refused generation
    # 2**30 positions x 2 layers x 2 KV heads x 16 x (keys, values) x 4 bytes: 512 GiB, refused at once
    assert st.generation.static_cache_bytes(model, 1, 2**30) == 2 * 2 * 2 * 16 * 2**30 * 4
    refused = r"static KV cache of 1073741824 positions .*512\.0 GiB, more than"
    with pytest.raises(torch.OutOfMemoryError, match=refused):
        st.generate(model, prompt, **dict(GREEDY, max_new_tokens=10**9))
    # a cache that passes that check, in a program refused under a device memory limit: the call fails,
    # then a normal call works (transformers' remembered cache size and the weights are untouched)
    previous = st.device_memory_limit()
    st.set_device_memory_limit("8MiB")
    try:
        with pytest.raises(torch.OutOfMemoryError, match="more than the limit of 8.0 MiB per device"):
            st.generate(model, prompt, **dict(GREEDY, max_new_tokens=20000))
    finally:
        st.set_device_memory_limit(previous)
    assert "_previous_max_cache_length" not in model.__dict__
    torch.testing.assert_close(st.generate(model, prompt, **GREEDY), expected, rtol=0, atol=0)


@pytest.mark.parametrize("batch,compile_decode", [(1, False), (3, False), (1, True)])
def test_second_call_with_the_same_shapes_compiles_nothing(batch, compile_decode):
    """Issue 37: the weights' upload still pending when generation starts (``model.to(st.device())``
    with no sync, as a user writes it) runs on its own, not inside the first call's prefill; so the
    second call, with the weights on the device, reuses the prefill and decode programs (it compiled
    its prefill again when the upload was part of the first one's). With ``compile_decode`` the second
    call traces nothing either: its decode step replays frozen from the first token. The device loop's
    prefill freezes on its second call (its decode step during the first): the third traces nothing."""
    model = tiny("llama")
    torch.manual_seed(6)
    ids = torch.randint(3, VOCAB, (batch, 7))
    expected = model.generate(ids, **GREEDY)
    model.to(st.device())  # pending: no st.sync()
    fresh_executable_cache()
    torch._dynamo.reset()
    try:
        first = st.generate(model, ids, compile_decode=compile_decode, **GREEDY)
        before, traces = compiles(), st.counter_value("CompileTrace") or 0
        second = st.generate(model, ids, compile_decode=compile_decode, **GREEDY)
        assert compiles() == before
        if not compile_decode:
            traces = st.counter_value("CompileTrace") or 0
            torch.testing.assert_close(st.generate(model, ids, **GREEDY), expected, rtol=0, atol=0)
        assert (st.counter_value("CompileTrace") or 0) == traces
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    torch.testing.assert_close(second, expected, rtol=0, atol=0)
