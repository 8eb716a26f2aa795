"""Issue 18 §1: Hugging Face GPT-2, Llama, BERT and T5 train in one program per step and freeze.

transformers' mask helpers read mask values to pick a cheaper mask (``padding_mask.all()``, ...);
on ``st.device()`` they build the general mask instead, as under a tracer
(``shardtensor/integrations/transformers.py``), so nothing is read in the middle of a forward. Per
family, with a tiny random-init model (hidden 32, 2 layers, vocabulary 128, 2 sequences of 8):
two lazy training steps (forward, backward and SGD step in ``with st.step():``) run one program each, then
three ``st.compile`` calls of the same step freeze, and the five losses and the final parameters
equal the same training in eager torch on CPU — which takes transformers' shortcuts: the batches
alternate between an all-ones mask (CPU drops it: SDPA's ``is_causal``, or no mask) and a padded
one (CPU builds the mask too), while the device runs the same program for both.
"""

import copy
import importlib
import sys

import pytest
import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

import shardtensor as st
from _training_helpers import reset_state
from shardtensor.integrations import transformers as integration

VOCAB, BATCH, LENGTH, TARGET_LENGTH = 128, 2, 8, 6
LAZY_STEPS, COMPILED_STEPS = 2, 3


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    yield
    reset_state()


def tiny(kind: str) -> torch.nn.Module:
    """A random-init model without dropout (its random numbers are not torch's CPU ones)."""
    torch.manual_seed(0)
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    if kind == "gpt2":
        return GPT2LMHeadModel(
            GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, **no_dropout)
        )
    if kind == "llama":
        config = LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=VOCAB,
            max_position_embeddings=32,
        )
        return LlamaForCausalLM(config)
    if kind == "bert":
        config = BertConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return BertForMaskedLM(config)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def batches(kind: str) -> list[dict]:
    """Same shapes every step (one compiled signature); odd steps pad the second sequence."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(LAZY_STEPS + COMPILED_STEPS):
        ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=g)
        mask = torch.ones_like(ids)
        labels = ids.clone()
        if i % 2:
            mask[1, -3:] = 0
            labels[1, -3:] = -100  # (padding is not predicted)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if kind == "t5":
            batch["labels"] = torch.randint(3, VOCAB, (BATCH, TARGET_LENGTH), generator=g)
            batch["decoder_attention_mask"] = torch.ones(BATCH, TARGET_LENGTH, dtype=torch.long)
            if i % 2:
                batch["decoder_attention_mask"][0, -2:] = 0
        out.append(batch)
    return out


def trainer(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)

    def train_step(**batch):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return train_step


def programs() -> int:
    return st.counter_value("ExecuteReplicated") or 0


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert", "t5"])
def test_one_program_per_step_and_compiled_step_freezes(kind):
    model = tiny(kind)
    reference = copy.deepcopy(model)
    step_on_cpu = trainer(reference)
    expected = [step_on_cpu(**b) for b in batches(kind)]

    model.to(st.device())  # (tied embeddings stay tied)
    step = trainer(model)
    compiled = st.compile(step)
    frozen, replays = st.counter_value("CompileFrozen") or 0, st.counter_value("CompileReplay") or 0
    losses = []
    for i, batch in enumerate(batches(kind)):
        batch = {k: v.to(st.device()) for k, v in batch.items()}
        st.sync()  # (the batch's upload is not the step)
        before = programs()
        if i < LAZY_STEPS:
            with st.step():
                loss = step(**batch)
        else:
            loss = compiled(**batch)
        assert programs() - before == 1, f"step {i}: forward, backward and update in one program"
        losses.append(loss.cpu())
    assert (st.counter_value("CompileFrozen") or 0) == frozen + 1
    assert (st.counter_value("CompileReplay") or 0) - replays == COMPILED_STEPS - 2  # traced twice, then frozen
    # float32 sums in another order (XLA's fusion, the materialised mask): losses within 2e-7
    # relative, parameters within 3e-7; five steps move them by 0.1 to 0.16: a wrong mask or
    # update cannot hide within these tolerances
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(
            p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_t5_greedy_decode_one_program_per_token():
    """st.generate: the encoder's padding mask is no longer read on every decoder step, so after the
    prefill each new token is one program (it was two); tokens as in eager torch."""
    torch.manual_seed(0)
    model = tiny("t5").eval()
    ids = torch.randint(3, VOCAB, (1, 7))
    greedy = {"do_sample": False, "eos_token_id": None}
    expected = {n: model.generate(ids, max_new_tokens=n, **greedy) for n in (3, 8)}

    model.to(st.device())
    st.sync()
    counts = {}
    for n in (3, 8):
        before = programs()
        torch.testing.assert_close(st.generate(model, ids, max_new_tokens=n, **greedy), expected[n], rtol=0, atol=0)
        counts[n] = programs() - before
    assert counts[8] - counts[3] == 5  # five more tokens, five more programs
    assert counts[3] == 3  # the encoder with the prefill (one program: lazy), then two decode steps


def test_mask_helpers_answer_for_sharded_tensors_only():
    """The wrapped is_tracing is transformers' own for CPU tensors, so their masks keep the shortcut."""
    from transformers import masking_utils

    assert getattr(masking_utils.is_tracing, "_shardtensor_wrapped", False)
    ones = torch.ones(2, 4, dtype=torch.bool)
    assert masking_utils.is_tracing(ones) is False and masking_utils.is_tracing() is False
    assert masking_utils.is_tracing(ones.to(st.device())) is True
    # CPU: an all-ones mask is dropped (SDPA's is_causal); on the device the causal mask is built
    assert masking_utils.sdpa_mask(batch_size=2, q_length=4, kv_length=4, attention_mask=ones) is None
    on_device = masking_utils.sdpa_mask(
        batch_size=2, q_length=4, kv_length=4, attention_mask=ones.to(st.device()), device=st.device()
    )
    expected = torch.ones(4, 4, dtype=torch.bool).tril().expand(2, 1, 4, 4)
    assert torch.equal(on_device.cpu(), expected)


def test_wrapped_when_the_mask_helpers_are_imported_later(tmp_path, monkeypatch):
    """import shardtensor before transformers: the helper is wrapped as its module loads, once."""
    (tmp_path / "late_masks.py").write_text("def is_tracing(tensor=None):\n    return False\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(integration, "MASKING_MODULE", "late_masks")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    integration.install()
    integration.install()  # (one finder, not two)
    finders = [f for f in sys.meta_path if isinstance(f, integration._WrapWhenLoaded) and f.name == "late_masks"]
    assert len(finders) == 1
    try:
        module = importlib.import_module("late_masks")
        assert module.is_tracing(torch.ones(1).to(st.device())) is True and module.is_tracing(torch.ones(1)) is False
        assert not any(isinstance(f, integration._WrapWhenLoaded) and f.name == "late_masks" for f in sys.meta_path)
        wrapped = module.is_tracing
        integration.install()  # already imported: wrapped now, and not twice
        assert module.is_tracing is wrapped
    finally:
        sys.modules.pop("late_masks", None)
