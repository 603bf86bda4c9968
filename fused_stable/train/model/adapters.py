"""The trainable part of a base model: peft LoRA/DoRA adapters on a frozen base, or every weight for full
fine-tuning (`apply_tuner`), and the optimizer's param groups (weight decay on matrices only, LoRA+)."""

from __future__ import annotations

from dataclasses import dataclass

from fused_stable.errors import UserError
from fused_stable.train.config.keys import TrainConfig


def apply_tuner(model, cfg: TrainConfig):
    """Freeze the base and add peft LoRA/DoRA adapters (fp32), or leave every weight trainable (tuner=full)."""
    if cfg.gradient_checkpointing:
        # non-reentrant checkpointing needs no requires_grad trick on the inputs of a frozen embedding
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if cfg.tuner == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if cfg.quant_bits is not None:
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=cfg.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    targets = cfg.target_modules.strip()
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules="all-linear"
        if targets == "all-linear"
        else [t.strip() for t in targets.split(",") if t.strip()],
        use_dora=cfg.tuner == "dora",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as exc:
        raise UserError(f"target_modules={cfg.target_modules!r}: {str(exc).splitlines()[0]}") from None


@dataclass
class ParamGroups:
    groups: list[dict]  # for the optimizer
    names: list[str]  # one per param, in the optimizer's order (for per-tensor grad norms)


def param_groups(model, cfg: TrainConfig) -> ParamGroups:
    """AdamW groups: weight decay on matrices only (not on norms, biases or DoRA magnitudes), and under
    LoRA+ the B matrices at lr x loraplus_lr_ratio (Hayou et al. 2024)."""
    decay, no_decay, lora_b = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if cfg.loraplus_lr_ratio is not None and ("lora_B" in name or "lora_embedding_B" in name):
            lora_b.append((name, p))
        elif p.ndim < 2 or "lora_magnitude_vector" in name:
            no_decay.append((name, p))
        else:
            decay.append((name, p))
    groups, names = [], []
    for members, extra in (
        (decay, {"weight_decay": cfg.weight_decay}),
        (no_decay, {"weight_decay": 0.0}),
        (lora_b, {"weight_decay": cfg.weight_decay, "lr": cfg.lr * (cfg.loraplus_lr_ratio or 1.0)}),
    ):
        if members:
            groups.append({"params": [p for _, p in members], **extra})
            names += [n for n, _ in members]
    if not groups:
        raise UserError("nothing to train: no parameter requires a gradient (check target_modules)")
    return ParamGroups(groups, names)
