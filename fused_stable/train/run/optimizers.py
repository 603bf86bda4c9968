"""The update rules `fused-stable sft --optim` can train with: one table (`RULES`) from the rule's name to how its
optimizer is built from the run's keys, and what a run cannot combine it with.

Every rule takes the same step options (the clip, the schedule, state_precision, the guard's spike rules), built
once by setup.py; what differs per rule is the class (fused_stable.OPTIMIZERS) and, for a rule with its own param
groups (Muon), how the model is split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from fused_stable.errors import UserError
from fused_stable.optimizers import OPTIMIZERS


@dataclass(frozen=True)
class Rule:
    """One update rule the trainer builds."""

    title: str  # the optimizer class, as the header and messages name it
    build: Callable  # (cfg, model, groups, step_options) -> the optimizer, with `param_names` set
    # (cfg, deepspeed) -> why this run (through DeepSpeed or not) cannot have the rule, in one line, or None
    missing: Callable = lambda cfg, deepspeed: None


def _build_over_groups(cls) -> Callable:
    """An elementwise rule's optimizer over the trainer's param groups (decay / no-decay, LoRA+)."""

    def build(cfg, model, groups, options):
        optimizer = cls(groups.groups, lr=cfg.lr, weight_decay=cfg.weight_decay, **options)
        optimizer.param_names = groups.names
        return optimizer

    return build


def _launched_ranks() -> int:
    """The run's process count (parallel.world_size's reading: the process group is joined before the run is
    checked; importing train.run.parallel here would close an import circle through the model loader)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _muon_missing(cfg, deepspeed: bool) -> str | None:
    if cfg.loraplus_lr_ratio is not None:
        return "optim muon builds its own param groups (muon_param_groups), so loraplus_lr_ratio cannot apply"
    if cfg.tuner == "full" and cfg.state_precision == "8bit" and not deepspeed and _launched_ranks() > 1:
        # torchrun's full fine-tune is FSDP2 (parallel.wrap); DeepSpeed's stages are checked in deepspeed_run
        return (
            "optim muon with tuner full and state_precision 8bit under torchrun: FSDP2 shards each matrix by rows, "
            "and 8-bit Muon momentum is coded in blocks over whole matrices; use state_precision bf16 (or one process)"
        )
    return None


def _muon(cfg, model, groups, options):
    import fused_stable

    # Muon orthogonalises whole matrices: its own split of the trainable params (use_muon per group)
    # (hidden 2-D weights and expert stacks to Muon; embeddings, head, norms, biases and LoRA factors to AdamW, at
    # the same lr and weight decay, as LLaMA-Factory's use_muon does; muon_lora: the LoRA factors to Muon, as
    # ms-swift does). The header and run_manifest.json say where each went (FusedMuon.describe())
    muon_groups = fused_stable.muon_param_groups(
        model, lr=cfg.lr, weight_decay=cfg.weight_decay, muon_lora=cfg.muon_lora
    )
    optimizer = fused_stable.FusedMuon(muon_groups, **options)
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer.param_names = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return optimizer


# every optimizer of fused_stable.OPTIMIZERS, at the run's lr (the same default for every rule: the sweep on the
# default task, docs/trainer.md "The update rule", found 1e-3 best for Lion too, where the Lion paper's 3-10x
# smaller lr did not teach the identity in 27 steps); a rule that splits the model into its own groups brings its
# own builder
_OWN_GROUPS = {"muon": Rule("FusedMuon", _muon, _muon_missing)}
RULES: dict[str, Rule] = {
    name: _OWN_GROUPS[name] if entry.own_param_groups else Rule(entry.title, _build_over_groups(entry.cls))
    for name, entry in OPTIMIZERS.items()
}


def check_available(cfg, deepspeed: bool) -> None:
    """With the config's other checks (`validate`), before the model loads: the run's rule exists in this
    fused_stable and fits its keys and engine (UserError)."""
    why = RULES[cfg.optim].missing(cfg, deepspeed)
    if why:
        raise UserError(why)


def build(cfg, model, groups, options: dict):
    """The run's optimizer: its rule's class over the run's param groups with the shared step options (the rule
    checked by `check_available`). A refusal of the class (a ValueError: its one line, e.g. a state precision the
    rule cannot keep) is the run's UserError."""
    try:
        return RULES[cfg.optim].build(cfg, model, groups, options)
    except ValueError as error:
        raise UserError(f"optim {cfg.optim}: {error}") from None
