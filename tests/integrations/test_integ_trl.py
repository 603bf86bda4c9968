"""TRL's SFTTrainer on a tiny Llama with LoRA (CPU, tokenizer and model built locally): FusedAdamW trains the
adapters on the trajectory of the usual recipe (torch AdamW + the Trainer's own clipping, warm-up + cosine),
whether TRL creates the adapters (``peft_config=``, optimizer built by FusedStableTrainerMixin inside train())
or you wrap the model with peft yourself (mixin, or ``optimizers=fused_trainer_optimizers(...)``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("datasets")  # with trl, in the test extras; the GPU check's machine lacks both
pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from integ_floor import ExactAdamW, assert_steps_close, assert_within_floor
from integ_models import tiny_llama
from peft import LoraConfig, get_peft_model
from transformers import set_seed
from trl import SFTConfig, SFTTrainer

from fused_stable import FusedAdamW
from fused_stable.integrations.hf import (
    FusedStableCallback,
    FusedStableTrainerMixin,
    find_fused_optimizer,
    fused_trainer_optimizers,
)
from fused_stable.train.model.tiny import build_byte_tokenizer

LR = 5e-3
CLIP = 0.1
BATCH = 4
EXAMPLES = 24
STEPS = EXAMPLES // BATCH  # one epoch


class FusedSFTTrainer(FusedStableTrainerMixin, SFTTrainer):
    pass


def dataset() -> Dataset:
    texts = [f"{a} plus {b} is {a + b}." for a in range(6) for b in range(4)]
    return Dataset.from_dict({"text": texts})


def base_model(tokenizer):
    return tiny_llama(
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)


def sft_args(out, trl_defaults: bool = False, **overrides) -> SFTConfig:
    """Epoch-based (max_steps=-1): the schedule's length comes from the dataloader. fp32 and no gradient
    checkpointing unless ``trl_defaults`` (SFTConfig turns both on by default)."""
    kw = dict(
        output_dir=str(out),
        num_train_epochs=1,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        weight_decay=0.1,
        max_grad_norm=CLIP,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        max_length=32,
        optim="adamw_torch",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if not trl_defaults:
        kw.update(bf16=False, gradient_checkpointing=False)
    kw.update(overrides)
    return SFTConfig(**kw)


def train_logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def adapters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def own_peft_model(tokenizer, seed: int = 0):
    """What SFTTrainer(peft_config=...) does inside: the same seed before get_peft_model, so the same adapters."""
    model = base_model(tokenizer)
    set_seed(seed)
    return get_peft_model(model, lora())


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tokenizer):
    """The usual recipe: SFTTrainer(peft_config=...) with torch AdamW and the Trainer clipping at 0.1."""
    trainer = SFTTrainer(
        model=base_model(tokenizer),
        args=sft_args(tmp_path_factory.mktemp("ref")),
        train_dataset=dataset(),
        processing_class=tokenizer,
        peft_config=lora(),
    )
    trainer.train()
    return trainer


def build_peft_config_mixin(tokenizer, args):
    return FusedSFTTrainer(
        model=base_model(tokenizer),
        args=args,
        train_dataset=dataset(),
        processing_class=tokenizer,
        peft_config=lora(),
        fused_optimizer_kwargs={"master_weights": True},
    )


def build_own_peft_mixin(tokenizer, args):
    return FusedSFTTrainer(
        model=own_peft_model(tokenizer), args=args, train_dataset=dataset(), processing_class=tokenizer
    )


def build_own_peft_optimizers(tokenizer, args):
    model = own_peft_model(tokenizer)
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset(),
        processing_class=tokenizer,
        optimizers=fused_trainer_optimizers(model, args, num_training_steps=STEPS),
        callbacks=[FusedStableCallback()],
    )


ROUTES = {
    "peft_config+mixin": build_peft_config_mixin,
    "own_peft+mixin": build_own_peft_mixin,
    "own_peft+fused_trainer_optimizers": build_own_peft_optimizers,
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_sft_trainer_same_trajectory_as_torch_adamw_with_trainer_clipping(reference, tokenizer, tmp_path, route):
    trainer = ROUTES[route](tokenizer, sft_args(tmp_path))
    start = adapters(trainer.model)
    # same starting point as the reference (its adapters were created with the same seed)
    assert start.keys() == adapters(reference.model).keys()
    trainer.train()

    opt = find_fused_optimizer(trainer.optimizer)
    assert isinstance(opt, FusedAdamW)
    # the optimizer holds exactly the trainable (adapter) parameters, built after peft created them
    trainable = {id(p) for p in trainer.model.parameters() if p.requires_grad}
    assert {id(p) for g in opt.param_groups for p in g["params"]} == trainable
    assert len(trainable) == 2 * 7 * 2  # A and B of 7 linear layers per block, 2 blocks
    assert trainer.args.max_grad_norm == 0.0  # clipping moved into the fused step
    if route == "peft_config+mixin":
        assert opt.master_weights is True  # fused_optimizer_kwargs reached the optimizer

    logs, ref_logs = train_logs(trainer), train_logs(reference)
    assert len(logs) == len(ref_logs) == STEPS
    assert min(h["grad_norm"] for h in ref_logs) > CLIP  # the clip bites at every step
    for mine, ref in zip(logs, ref_logs):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert mine["learning_rate"] == pytest.approx(ref["learning_rate"], rel=1e-5, abs=1e-10)
        assert mine["skipped_steps"] == 0
    assert ref_logs[-1]["loss"] < ref_logs[0]["loss"]  # it learns something
    final, ref_final = adapters(trainer.model), adapters(reference.model)
    for name, value in final.items():
        assert not torch.equal(value, start[name]), name
        torch.testing.assert_close(value, ref_final[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert int(opt.applied_steps) == STEPS


def test_mixin_refuses_optimizer_cls_and_kwargs(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="fused_optimizer_kwargs"):
        FusedSFTTrainer(
            model=base_model(tokenizer),
            args=sft_args(tmp_path),
            train_dataset=dataset(),
            processing_class=tokenizer,
            peft_config=lora(),
            optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": LR}),
        )


def test_mixin_adds_one_callback_first(tmp_path, tokenizer):
    trainer = build_peft_config_mixin(tokenizer, sft_args(tmp_path))
    ours = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, FusedStableCallback)]
    assert len(ours) == 1 and trainer.callback_handler.callbacks[0] is ours[0]
    given = FusedStableCallback()
    trainer = FusedSFTTrainer(
        model=own_peft_model(tokenizer),
        args=sft_args(tmp_path),
        train_dataset=dataset(),
        processing_class=tokenizer,
        callbacks=[given],
    )
    assert [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, FusedStableCallback)] == [given]


def _bf16_torch_run(tmp_path, tokenizer, name, **trainer_kwargs):
    """SFTConfig's defaults with a torch AdamW: the reference (`adamw_torch`), or one of the floor's alternatives
    (integ_floor): `optim="adamw_torch_fused"`, or ExactAdamW through `optimizer_cls_and_kwargs`."""
    optim = trainer_kwargs.pop("optim", "adamw_torch")
    trainer = SFTTrainer(
        model=base_model(tokenizer),
        args=sft_args(tmp_path / name, trl_defaults=True, optim=optim),
        train_dataset=dataset(),
        processing_class=tokenizer,
        peft_config=lora(),
        **trainer_kwargs,
    )
    trainer.train()
    return trainer


def test_sft_config_defaults_bf16_and_gradient_checkpointing(tmp_path, tokenizer):
    """SFTConfig's own defaults (bf16 autocast and gradient checkpointing on): the peft_config + mixin route
    against torch AdamW. The LoRA weights stay fp32, but the forward runs in bf16: the trajectories are compared
    with the tolerance of low precision, measured on the same run (integ_floor)."""
    ref = _bf16_torch_run(tmp_path, tokenizer, "ref")
    assert ref.args.bf16 and ref.args.gradient_checkpointing
    alternatives = [
        _bf16_torch_run(tmp_path, tokenizer, "fused-torch", optim="adamw_torch_fused"),
        _bf16_torch_run(
            tmp_path,
            tokenizer,
            "exact-torch",
            optimizer_cls_and_kwargs=(ExactAdamW, {"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8}),
        ),
    ]
    trainer = build_peft_config_mixin(tokenizer, sft_args(tmp_path / "fused", trl_defaults=True))
    trainer.train()
    logs, ref_logs = train_logs(trainer), train_logs(ref)
    assert len(logs) == len(ref_logs) == STEPS
    for key in ("loss", "grad_norm"):
        assert_steps_close(key, [h[key] for h in logs], [h[key] for h in ref_logs], torch.bfloat16)
    final, ref_final = adapters(trainer.model), adapters(ref.model)
    assert final.keys() == ref_final.keys()
    as_list = [list(adapters(alt.model).values()) for alt in alternatives]
    assert_within_floor("adapters", list(final.values()), list(ref_final.values()), as_list)


def test_resume_from_checkpoint_is_exact(tmp_path, tokenizer):
    """The Trainer's own checkpoints with the mixin: resuming from step 3 gives the uninterrupted run's adapters,
    optimizer counters and logs (the device-side schedule continues from the saved applied-step count)."""
    args = dict(save_strategy="steps", save_steps=3)
    full = build_peft_config_mixin(tokenizer, sft_args(tmp_path / "full", **args))
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").exists()

    resumed = build_peft_config_mixin(tokenizer, sft_args(tmp_path / "resumed", **args))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    final, full_final = adapters(resumed.model), adapters(full.model)
    for name, value in final.items():
        assert torch.equal(value, full_final[name]), name
    opt, full_opt = find_fused_optimizer(resumed.optimizer), find_fused_optimizer(full.optimizer)
    assert int(opt.applied_steps) == int(full_opt.applied_steps) == STEPS
    logs = {h["step"]: h for h in train_logs(resumed)}
    for ref in train_logs(full)[3:]:
        for key in ("loss", "grad_norm", "learning_rate"):
            assert logs[ref["step"]][key] == ref[key], (ref["step"], key)
