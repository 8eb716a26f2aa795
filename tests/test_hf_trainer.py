"""Issue 13 §3: Hugging Face ``Trainer`` and ``accelerate`` train a small Llama wrapped in FSDPv2 on
8 simulated devices, selected with ``ACCELERATE_TORCH_DEVICE=shardtensor`` (docs/hf.md).

Each run is compared with the same run of the same library on CPU: per-step losses and gradient norms,
and the parameters after training. The model is random-init (no download), the dataset 16 sequences
of 16 tokens. Issue 14 §3: saving (``save_pretrained``, Trainer's checkpoints, ``accelerator.save_state``)
and resuming a Trainer run.
"""

import copy
import functools

import pytest
import safetensors.torch
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import shardtensor as st
from _training_helpers import reset_state
from shardtensor.fsdp import FSDPv2, transformer_auto_wrap_policy

STEPS = 4
# After 4 AdamW steps the losses and gradient norms agree to ~2e-7 relative (float32 reordering of
# sums in the sharded program); 1e-5 leaves a wide margin yet catches any wrong op. The parameters
# agree to 3e-8; Trainer's AdamW moves one by up to lr = 5e-5 per step, so 1e-6 absolute is 2% of one
# step (the accelerate run's lr is 1e-3: 0.1%).
LOSS_RTOL = 1e-5
PARAM_ATOL, PARAM_RTOL = 1e-6, 1e-5


@pytest.fixture(autouse=True)
def _clean():
    """A global mesh over 8 devices on 'fsdp'; accelerate's process-wide state reset afterwards, so
    that no later test finds the shardtensor device chosen."""
    reset_state()
    previous = st.get_global_mesh()
    st.set_global_mesh(st.Mesh(range(8), (8,), ("fsdp",)))
    yield
    st.set_global_mesh(previous)
    AcceleratorState._reset_state(reset_partial_state=True)
    reset_state()


def tiny_llama(seed=0, **options) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        **options,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def token_dataset() -> list[dict]:
    ids = torch.randint(0, 100, (16, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def fsdp_wrap(model):
    """The recipe of docs/hf.md: each decoder layer and the whole model get an FSDPv2."""
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    return FSDPv2(model, auto_wrap_policy=policy)


def train_with_trainer(model, trainer_cls=Trainer, callbacks=None, resume_from_checkpoint=None, **options):
    """Trainer with default TrainingArguments apart from the run's length, logging, output and seed
    (no checkpoint unless ``options`` ask for one). Returns (losses, grad norms) per step and the Trainer."""
    arguments = dict(
        output_dir="unused",  # nothing is written with save_strategy="no"
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    args = TrainingArguments(**{**arguments, **options})
    trainer = trainer_cls(model=model, args=args, train_dataset=token_dataset(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == STEPS
    return [e["loss"] for e in logs], [e["grad_norm"] for e in logs], trainer


def assert_same_parameters(model, reference):
    params = {name.replace("_orig_module.", ""): p for name, p in model.named_parameters()}
    assert params.keys() == dict(reference.named_parameters()).keys()
    for name, ref in reference.named_parameters():
        got = params[name]
        assert got.device == st.device(), name
        torch.testing.assert_close(got.detach().cpu(), ref.detach(), atol=PARAM_ATOL, rtol=PARAM_RTOL, msg=name)


def check_trainer_matches_cpu(monkeypatch, **options):
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    ref_losses, ref_norms, ref_trainer = train_with_trainer(reference, **options)
    assert ref_trainer.args.device.type == "cpu"

    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "shardtensor")
    wrapped = fsdp_wrap(model)
    losses, norms, trainer = train_with_trainer(wrapped, **options)
    assert trainer.args.device == trainer.accelerator.device == torch.device("shardtensor")
    assert trainer.args.dataloader_pin_memory  # the default: pinned CPU batches go to the device
    # the column filter read the Llama's own arguments through FSDPv2
    assert {"input_ids", "attention_mask", "labels"} <= set(trainer._signature_columns)
    assert isinstance(trainer.model, FSDPv2) and isinstance(trainer.model.module.model.layers[0], FSDPv2)
    torch.testing.assert_close(losses, ref_losses, rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(norms, ref_norms, rtol=LOSS_RTOL, atol=0)
    assert_same_parameters(wrapped.module, reference)


def test_trainer_defaults_train_fsdp_llama_like_cpu(monkeypatch):
    """The true defaults: on torch >= 2.8 Trainer's optimizer is the fused AdamW."""
    assert TrainingArguments(output_dir="unused").optim == "adamw_torch_fused"
    check_trainer_matches_cpu(monkeypatch)


def test_accelerator_prepare_trains_fsdp_llama_like_cpu(monkeypatch):
    """``Accelerator().prepare(model, optimizer, dataloader)`` on the shardtensor device."""

    def train(model):
        accelerator = Accelerator()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(token_dataset(), batch_size=8, pin_memory=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        losses = []
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        device = accelerator.device
        AcceleratorState._reset_state(reset_partial_state=True)  # the next Accelerator reads the env again
        return device, losses

    reference = tiny_llama()
    model = copy.deepcopy(reference)
    _, ref_losses = train(reference)
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "shardtensor")
    wrapped = fsdp_wrap(model)
    device, losses = train(wrapped)
    assert device == torch.device("shardtensor")
    assert len(losses) == 2
    torch.testing.assert_close(losses, ref_losses, rtol=LOSS_RTOL, atol=0)
    assert_same_parameters(wrapped.module, reference)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied_embeddings"])
def test_save_pretrained_of_fsdp_llama_reloads_on_cpu(tmp_path, tied):
    """``save_pretrained`` of the Llama on the shardtensor device writes safetensors that ``from_pretrained``
    reloads on CPU with identical weights, tied embeddings saved once as on CPU (docs/hf.md, "Saving and resuming").
    ``model.module.save_pretrained(dir)``, FSDPv2 over the whole model (and over each decoder layer: their
    state dicts name the keys without FSDPv2's ``_orig_module.``)."""
    reference = tiny_llama(tie_word_embeddings=tied)
    model = copy.deepcopy(reference).to(st.device())
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight  # .to(st.device()) keeps the tie
        wrapped = fsdp_wrap(model)
    else:
        wrapped = FSDPv2(model)
    wrapped.module.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists()
    saved = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in saved) != tied  # a tied lm_head is found sharing the embedding's storage
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path)
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) == tied
    assert reloaded.state_dict().keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_accelerate_save_state_and_load_state(tmp_path, monkeypatch):
    """``accelerator.save_state(dir)`` of an FSDPv2 model (safetensors' ``save_model``, which keeps tensors
    that start their storage) under the plain model's names, and ``load_state`` back into it: the weights
    and each parameter's sharding."""
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "shardtensor")
    reference = tiny_llama()
    accelerator = Accelerator()
    model = FSDPv2(copy.deepcopy(reference).to(st.device()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    specs = {name: p.sharding_spec for name, p in model.named_parameters()}
    accelerator.save_state(tmp_path)
    assert safetensors.torch.load_file(tmp_path / "model.safetensors").keys() == reference.state_dict().keys()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state(tmp_path)
    for name, p in model.named_parameters():
        assert p.sharding_spec == specs[name], name
    assert_same_parameters(model.module, reference)


class ShardedStateTrainer(Trainer):
    """docs/hf.md's recipe: the optimizer Trainer creates loads a checkpoint's state sharded like the
    parameters (``st.keep_optimizer_state_sharded``), not replicated on every device."""

    def create_optimizer(self, model=None):
        return st.keep_optimizer_state_sharded(super().create_optimizer(model))


class OptimizerStateBytes(TrainerCallback):
    """Bytes each device holds of the optimizer state: at the first checkpoint written, and when training
    begins (after a resume has loaded the state, before any step)."""

    def __init__(self):
        self.at_save = self.at_begin = None

    @staticmethod
    def measure(optimizer):
        per_device = [0] * 8
        for state in optimizer.state.values():
            for value in state.values():
                for i, shard in enumerate(value.local_shards):
                    per_device[i] += shard.data.numel() * shard.data.element_size()
        return per_device

    def on_save(self, args, state, control, optimizer=None, **kwargs):
        self.at_save = self.at_save or self.measure(optimizer)

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.at_begin = self.measure(optimizer)


def test_trainer_checkpoints_are_plain_llama_checkpoints_and_a_resumed_run_continues_exactly(tmp_path, monkeypatch):
    """Issue 14 §3: ``save_strategy="steps"`` on the FSDPv2 Llama writes checkpoints under the plain model's
    names; ``train(resume_from_checkpoint=...)`` from the step-2 checkpoint gives the uninterrupted run's
    losses and gradient norms exactly, the optimizer state reloads sharded as it was saved (bytes per
    device), and the resumed run's ``save_model`` reloads with ``from_pretrained`` on CPU as the trained
    weights. The resumed run gives Trainer the Hugging Face model inside the wrapper (docs/hf.md: then
    Trainer writes complete ``from_pretrained`` directories, config.json included)."""
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "shardtensor")
    saving = dict(save_strategy="steps", save_steps=2)
    recorder = OptimizerStateBytes()
    wrapped = fsdp_wrap(tiny_llama())
    losses, norms, _ = train_with_trainer(wrapped, callbacks=[recorder], output_dir=str(tmp_path / "run"), **saving)
    trained = {k: v.cpu() for k, v in wrapped.state_dict().items()}

    plain = tiny_llama()
    for step in (2, 4):
        saved = safetensors.torch.load_file(tmp_path / f"run/checkpoint-{step}/model.safetensors")
        assert saved.keys() == plain.state_dict().keys()  # no "_orig_module." anywhere
    plain.load_state_dict(saved)  # the last checkpoint: the trained weights, into a plain CPU Llama
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=name)

    resumed_recorder = OptimizerStateBytes()
    other_init = fsdp_wrap(tiny_llama(seed=1)).module  # weights and optimizer state come from the checkpoint
    resumed_losses, resumed_norms, trainer = train_with_trainer(
        other_init,
        trainer_cls=ShardedStateTrainer,
        callbacks=[resumed_recorder],
        resume_from_checkpoint=str(tmp_path / "run/checkpoint-2"),
        output_dir=str(tmp_path / "resumed"),
        **saving,
    )
    assert trainer.state.global_step == STEPS
    assert (resumed_losses, resumed_norms) == (losses, norms)  # steps 1-2 from the checkpoint, 3-4 computed
    one_copy = sum(4 * 2 * p.numel() + 4 for p in plain.parameters())  # exp_avg, exp_avg_sq (float32), step
    assert resumed_recorder.at_begin == recorder.at_save  # as saved: sharded, where a replica holds one_copy each
    assert sum(recorder.at_save) < 2 * one_copy

    trainer.save_model(str(tmp_path / "final"))
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "final")
    assert reloaded.state_dict().keys() == trained.keys()
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=name)
