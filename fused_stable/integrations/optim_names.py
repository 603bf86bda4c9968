"""The HF Trainer's `optim` names (`TrainingArguments.optim`, which LLaMA-Factory and ms-swift pass on) that are
AdamW, as the FusedAdamW state each stands for: read by the HF integration (`fused_trainer_optimizers`) and by
the trainer's LLaMA-Factory / ms-swift key mapping (train/config/foreign_configs.py), so both read a name alike.

Paged optimizers (bitsandbytes' paged buffers) move their state between GPU and host memory under memory
pressure; FusedAdamW's state stays where its params are, so a paged name gets the same state, not paged.
`adamw_hf` is transformers' old AdamW, gone from its `OptimizerNames`; older configs still name it.
"""

from __future__ import annotations

# name -> (FusedAdamW's state_precision, what the state is, in words)
ADAMW_OPTIMS = {
    "adamw_torch": ("fp32", "FusedAdamW, fp32 state"),
    "adamw_torch_fused": ("fp32", "FusedAdamW, fp32 state"),
    "adamw_hf": ("fp32", "FusedAdamW, fp32 state"),
    "adamw_torch_xla": ("fp32", "FusedAdamW, fp32 state"),  # torch's AdamW on other devices: the same rule
    "adamw_torch_npu_fused": ("fp32", "FusedAdamW, fp32 state"),
    "paged_adamw_32bit": ("fp32", "FusedAdamW, fp32 state, not paged: it stays beside the params"),
    "adamw_bnb_8bit": ("8bit", "FusedAdamW, 8-bit blockwise state"),
    "adamw_8bit": ("8bit", "FusedAdamW, 8-bit blockwise state"),
    "adamw_torch_8bit": ("8bit", "FusedAdamW, 8-bit blockwise state"),
    "paged_adamw_8bit": ("8bit", "FusedAdamW, 8-bit blockwise state, not paged: it stays beside the params"),
}


def _entry(optim) -> tuple[str, str] | None:
    # TrainingArguments keeps an OptimizerNames enum member; configs give the string
    return ADAMW_OPTIMS.get(str(getattr(optim, "value", optim)).strip().lower())


def state_precision_of(optim) -> str:
    """The state_precision an AdamW `optim` name stands for; ValueError for any other rule, naming the supported."""
    entry = _entry(optim)
    if entry is None:
        raise ValueError(
            f"optim {getattr(optim, 'value', optim)!r} is not AdamW; the optimizer here is FusedAdamW, and the "
            f"supported optim values are: {', '.join(ADAMW_OPTIMS)}"
        )
    return entry[0]


def describe(optim) -> str:
    """What the state of an AdamW `optim` name is here, in words (for the run's mapping line)."""
    entry = _entry(optim)
    return entry[1] if entry else ""
