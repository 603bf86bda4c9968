"""The HF Trainer's `optim` names (`TrainingArguments.optim`, which LLaMA-Factory and ms-swift pass on) that a fused
rule runs, as the rule and state each stands for: read by the HF integration (`fused_trainer_optimizers`) and by
the trainer's LLaMA-Factory / ms-swift key mapping (train/config/foreign_configs.py), so both read a name alike.

Paged optimizers (bitsandbytes' paged buffers) move their state between GPU and host memory under memory
pressure; a fused optimizer's state stays where its params are, so a paged name gets the same state, not paged.
`adamw_hf` is transformers' old AdamW, gone from its `OptimizerNames`; older configs still name it.
"""

from __future__ import annotations

from typing import NamedTuple


class OptimName(NamedTuple):
    rule: str  # fused_stable.rules' NAME: "adamw" (FusedAdamW) or "lion" (FusedLion)
    state_precision: str  # the optimizer's state_precision
    words: str  # what the state is, in words (the trainer's mapping line)


_NOT_PAGED = "not paged: it stays beside the params"
# the one table: name -> rule, state precision and words
OPTIMS = {
    "adamw_torch": OptimName("adamw", "fp32", "FusedAdamW, fp32 state"),
    "adamw_torch_fused": OptimName("adamw", "fp32", "FusedAdamW, fp32 state"),
    "adamw_hf": OptimName("adamw", "fp32", "FusedAdamW, fp32 state"),
    # torch's AdamW on other devices: the same rule
    "adamw_torch_xla": OptimName("adamw", "fp32", "FusedAdamW, fp32 state"),
    "adamw_torch_npu_fused": OptimName("adamw", "fp32", "FusedAdamW, fp32 state"),
    "paged_adamw_32bit": OptimName("adamw", "fp32", f"FusedAdamW, fp32 state, {_NOT_PAGED}"),
    "adamw_bnb_8bit": OptimName("adamw", "8bit", "FusedAdamW, 8-bit blockwise state"),
    "adamw_8bit": OptimName("adamw", "8bit", "FusedAdamW, 8-bit blockwise state"),
    "adamw_torch_8bit": OptimName("adamw", "8bit", "FusedAdamW, 8-bit blockwise state"),
    "paged_adamw_8bit": OptimName("adamw", "8bit", f"FusedAdamW, 8-bit blockwise state, {_NOT_PAGED}"),
    "lion_32bit": OptimName("lion", "fp32", "FusedLion, fp32 state"),
    "paged_lion_32bit": OptimName("lion", "fp32", f"FusedLion, fp32 state, {_NOT_PAGED}"),
    "lion_8bit": OptimName("lion", "8bit", "FusedLion, 8-bit blockwise state"),
    "paged_lion_8bit": OptimName("lion", "8bit", f"FusedLion, 8-bit blockwise state, {_NOT_PAGED}"),
}


def _entry(optim) -> OptimName | None:
    # TrainingArguments keeps an OptimizerNames enum member; configs give the string
    return OPTIMS.get(str(getattr(optim, "value", optim)).strip().lower())


def lookup(optim) -> OptimName:
    """The rule and state an `optim` name stands for; ValueError for any other name, naming the supported."""
    entry = _entry(optim)
    if entry is None:
        raise ValueError(
            f"optim {getattr(optim, 'value', optim)!r} has no fused rule here (AdamW and Lion); the supported optim "
            f"values are: {', '.join(OPTIMS)}"
        )
    return entry


def describe(optim) -> str:
    """What an `optim` name's optimizer and state are here, in words (for the run's mapping line)."""
    entry = _entry(optim)
    return entry.words if entry else ""
