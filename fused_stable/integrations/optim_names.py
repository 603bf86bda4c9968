"""The HF Trainer's `optim` names (`TrainingArguments.optim`, which LLaMA-Factory and ms-swift pass on) that a fused
rule runs, as the rule and state each stands for: read by the HF integration (`fused_trainer_optimizers`) and by
the trainer's LLaMA-Factory / ms-swift key mapping (train/config/foreign_configs.py), so both read a name alike.

Paged optimizers (bitsandbytes' paged buffers) move their state between GPU and host memory under memory
pressure; a fused optimizer's state stays where its params are, so a paged name gets the same state, not paged.
`adamw_hf` is transformers' old AdamW, gone from its `OptimizerNames`; older configs still name it.
"""

from __future__ import annotations

from typing import NamedTuple

from ..optimizers import OPTIMIZERS


class OptimName(NamedTuple):
    rule: str  # the rule's name in fused_stable.OPTIMIZERS: "adamw" (FusedAdamW), "lion" (FusedLion), ...
    state_precision: str  # the optimizer's state_precision
    words: str  # what the state is, in words (the trainer's mapping line)


_NOT_PAGED = "not paged: it stays beside the params"
_STATE_WORDS = {"fp32": "fp32 state", "bf16": "bf16 state", "8bit": "8-bit blockwise state"}


def _table() -> dict[str, OptimName]:
    """Every name of fused_stable.OPTIMIZERS' entries -> its rule, state precision and words."""
    table = {}
    for entry in OPTIMIZERS.values():
        for name, precision in entry.optim_names.items():
            words = f"{entry.title}, {_STATE_WORDS[precision]}" + (
                f", {_NOT_PAGED}" if name.startswith("paged_") else ""
            )
            table[name] = OptimName(entry.name, precision, words)
    return table


# the one table: name -> rule, state precision and words
OPTIMS = _table()
# the names a rule's entry says it does not stand for (another algorithm under a rule's name) -> why, in one line
NOT_MAPPED = {name: why for entry in OPTIMIZERS.values() for name, why in entry.not_optim_names.items()}


def _entry(optim) -> OptimName | None:
    # TrainingArguments keeps an OptimizerNames enum member; configs give the string
    return OPTIMS.get(str(getattr(optim, "value", optim)).strip().lower())


def lookup(optim) -> OptimName:
    """The rule and state an `optim` name stands for; ValueError for any other name, naming the supported."""
    entry = _entry(optim)
    name = str(getattr(optim, "value", optim)).strip().lower()
    if entry is None and name in NOT_MAPPED:
        raise ValueError(f"optim {name!r} has no fused rule here: {NOT_MAPPED[name]}")
    if entry is None:
        raise ValueError(
            f"optim {getattr(optim, 'value', optim)!r} has no fused rule here; the supported optim "
            f"values are: {', '.join(OPTIMS)}"
        )
    return entry


def describe(optim) -> str:
    """What an `optim` name's optimizer and state are here, in words (for the run's mapping line)."""
    entry = _entry(optim)
    return entry.words if entry else ""
