"""The optimizers fused_stable offers, one thin class per update rule over FusedOptimizer (optim.py), and
OPTIMIZERS, their one public registry: rule name -> class and the names other trainers give it. The trainer
(train/), the HF integration and its `optim` names (integrations/optim_names.py) and the DeepSpeed integration's
messages all read OPTIMIZERS; `fused_stable` exports every class listed here.

A new rule is its folder under rules/ (its declaration and element) plus, here, its class (torch's keywords and
defaults, over `FusedOptimizer`) and its line in OPTIMIZERS: docs/rules.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .layout import check_not_differentiable
from .muon import FusedMuon
from .optim import FusedOptimizer
from .rules import RULES

# what `fused_stable` exports from here: the registry and every optimizer class it lists
__all__ = ["OPTIMIZERS", "FusedAdafactor", "FusedAdamW", "FusedLion", "FusedMuon", "FusedSGD"]


def _check_torch_flags(name: str, differentiable, fused, foreach) -> None:
    """torch's call-site flags a class accepts with no effect: differentiable=True is refused (the fused step is not
    differentiable), and fused with foreach as torch refuses it."""
    check_not_differentiable(differentiable, f"{name}(differentiable=True)")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")  # torch's words


class FusedAdamW(FusedOptimizer):
    """AdamW with the global grad-norm clip, the non-finite check and the update fused on the device.

    Args:
        params: parameters, (name, parameter) pairs or param-group dicts, as for torch.optim.AdamW.
        lr, betas, eps, weight_decay, amsgrad, maximize: as torch.optim.AdamW (decoupled weight decay), per param
            group as there. `lr` may be a 1-element tensor; tensor `betas` are read once, when their group is
            added. amsgrad=True keeps torch's `max_exp_avg_sq` state (fp32, like the moments).
        foreach, fused: accepted for torch.optim.AdamW's call sites and kept in the param groups; they have no
            effect (the step is always the fused one). As in torch, they cannot both be True.
        differentiable: only False: the fused step is not differentiable (True is refused with an error, from
            the constructor, a param group or a loaded state dict).
        max_grad_norm: clip the global L2 norm over all groups to this value; None disables fixed clipping.
        lr_schedule: a `fused_stable.schedules` schedule, evaluated on the device from the count of applied
            updates, multiplying every group's lr (skipped steps do not advance it).
        master_weights: keep an fp32 copy of bf16/fp16 params in the state and update it (the param gets
            the rounded result), so small updates are not lost to rounding.
        state_precision: how the moments (exp_avg, exp_avg_sq, amsgrad's max_exp_avg_sq) are stored, also per
            param group: "fp32" (torch's state), "bf16", or "8bit" (blockwise codes with one fp32 scale per
            block; tensors of fewer than 4096 elements stay fp32). The update dequantises, updates and
            requantises in the same pass; state_dict() keeps the compact form, torch_state_dict() gives fp32
            moments under torch's keys (fused_stable/state_format.py, docs/optimizer.md).
        capturable: a whole step can be captured in a CUDA graph and replayed (docs/optimizer.md, "CUDA graphs"): every
            per-step value stays on the device (always true here); change lr through a tensor lr or
            `lr_schedule` so a replay sees the change. Anything that would upload host data while capturing
            (the first step, new grad storage, a changed float hyper-parameter) raises a clear error instead.
        clip: "fixed" (max_grad_norm only) or "zscore" (also clip spikes to mean + zscore_threshold * std of the
            running norm statistics, ZClip-style, after `zscore_warmup` finite steps).
        zscore_alpha, zscore_threshold, zscore_warmup: the running statistics (kept in every mode, for
            spike detection).
        spike_skip_threshold: skip steps whose norm's z-score exceeds this (counted in `spike_skips`).
        spike_skip_ratio: ...and only those whose norm is also at least this many times the running mean (0, the
            default: the z-score alone). Small-batch fine-tuning has normal steps at z ~ 10 but only a few times
            the mean norm; with a ratio of 5 a threshold near 6 skips real spikes and none of those.
        backend: None / "auto", "triton", "interpret" or "torch" (default: $FUSED_STABLE_BACKEND, else by device).
    """

    RULE = RULES["adamw"]

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        **step_options: Any,
    ) -> None:
        _check_torch_flags("FusedAdamW", differentiable, fused, foreach)
        defaults = self.RULE.defaults(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,  # kept in the groups for torch's call sites and state dicts
            fused=fused,
        )
        super().__init__(params, defaults, capturable=capturable, **step_options)


class FusedLion(FusedOptimizer):
    """Lion (lion-pytorch's update, names, defaults and `exp_avg` state) with the global grad-norm clip, the
    non-finite check and the update fused on the device: `p *= 1 - lr * weight_decay; p -= lr * sign(beta1 * m +
    (1 - beta1) * g); m = beta2 * m + (1 - beta2) * g`, with g the clipped (and unscaled) grad.

    Args:
        params: parameters, (name, parameter) pairs or param-group dicts.
        lr, betas, weight_decay: as lion_pytorch.Lion, per param group as there (lr >= 0 may be a 1-element
            tensor; betas in [0, 1]). Lion's update has the magnitude lr in every element: its lr is usually 3-10x
            smaller than AdamW's, its weight decay 3-10x larger (the Lion paper).
        max_grad_norm, clip, zscore_alpha, zscore_threshold, zscore_warmup, spike_skip_threshold,
        spike_skip_ratio, lr_schedule, master_weights, state_precision, capturable, backend: as FusedAdamW (the
            step-wide options every rule shares); state_precision stores `exp_avg` in fp32, bf16 (stochastic
            rounding) or 8-bit (signed blockwise codes).
    """

    RULE = RULES["lion"]

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        max_grad_norm: float | None = None,
        **step_options: Any,
    ) -> None:
        defaults = self.RULE.defaults(lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, **step_options)


class FusedSGD(FusedOptimizer):
    """SGD with momentum (torch.optim.SGD's update, names, defaults and `momentum_buffer` state) with the global
    grad-norm clip, the non-finite check and the update fused on the device: `g += weight_decay * p; B = g` on the
    buffer's first update, `B = momentum * B + (1 - dampening) * g` after it, `g = g + momentum * B` (nesterov) or
    `B`; `p -= lr * g`, with g the clipped (and unscaled) grad.

    Args:
        params: parameters, (name, parameter) pairs or param-group dicts, as for torch.optim.SGD.
        lr, momentum, dampening, weight_decay, nesterov, maximize: as torch.optim.SGD (weight decay added to the
            grad, not decoupled), per param group as there. momentum 0 (the default) keeps no buffer, as torch.
        foreach, fused, differentiable: accepted for torch.optim.SGD's call sites; no effect (differentiable=True
            is refused).
        max_grad_norm, clip, zscore_alpha, zscore_threshold, zscore_warmup, spike_skip_threshold,
        spike_skip_ratio, lr_schedule, master_weights, state_precision, capturable, backend: as FusedAdamW (the
            step-wide options every rule shares); state_precision stores `momentum_buffer` in fp32, bf16 (to
            nearest) or 8-bit (signed blockwise codes).
    """

    RULE = RULES["sgd"]

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        **step_options: Any,
    ) -> None:
        _check_torch_flags("FusedSGD", differentiable, fused, foreach)
        defaults = self.RULE.defaults(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
        )
        super().__init__(params, defaults, **step_options)


class FusedAdafactor(FusedOptimizer):
    """Adafactor (torch.optim.Adafactor's update, names, defaults and `row_var` / `col_var` / `variance` states) with
    the global grad-norm clip, the non-finite check, the spike skip and the schedule of the fused step: a matrix
    rule (rules/adafactor: the factored second moment and the RMS terms need whole params), stepped right after the
    fused step from its decisions, with no host read on the device (docs/optimizer.md, "FusedAdafactor").

    Args:
        params: parameters, (name, parameter) pairs or param-group dicts, as for torch.optim.Adafactor.
        lr, beta2_decay, eps, d, weight_decay, maximize: as torch.optim.Adafactor, per param group as there: the
            relative step is min(lr, 1 / sqrt(step)), scaled by the param's RMS (at least eps[1]); the update's RMS is
            clipped to d; weight decay is decoupled (p *= 1 - lr * weight_decay). `lr` may be a 1-element tensor.
        foreach: accepted for torch.optim.Adafactor's call sites and kept in the groups; no effect.
        max_grad_norm, clip, zscore_alpha, zscore_threshold, zscore_warmup, spike_skip_threshold,
        spike_skip_ratio, lr_schedule, backend: as FusedAdamW (the step-wide options every rule shares); the
            schedule's factor multiplies lr (in the relative step's cap and the weight decay).
        state_precision: "fp32" only: the states are torch's, in the param's dtype (factored moments hold rows +
            cols values per matrix: bf16 or 8-bit would save next to nothing).
        master_weights: False only: a bf16 param is updated in bf16, as torch.optim.Adafactor does.
    """

    RULE = RULES["adafactor"]

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        master_weights: bool = False,
        **step_options: Any,
    ) -> None:
        if master_weights:
            raise ValueError(
                "FusedAdafactor keeps no fp32 master weights (its update runs outside the fused step's master-weight "
                "pass): a bf16 param is updated in bf16, as torch.optim.Adafactor does; use fp32 params instead"
            )
        defaults = self.RULE.defaults(
            lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay, foreach=foreach, maximize=maximize
        )
        super().__init__(params, defaults, **step_options)


@dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer of the registry."""

    name: str  # the rule's name: `fused-stable sft --optim`, fused_trainer_optimizers(rule=...)
    cls: type  # the public class
    # the HF Trainer's `optim` names (TrainingArguments.optim, which LLaMA-Factory and ms-swift pass on) that mean
    # this rule, each with the state precision it names (bitsandbytes' 8-bit and paged variants included)
    optim_names: dict[str, str] = field(default_factory=dict)
    # its keywords from a transformers TrainingArguments besides lr and weight decay (the Trainer's adam betas...)
    trainer_keywords: Callable[[Any], dict] = lambda args: {}
    # it splits the model into its own param groups (FusedMuon: use_muon per group), so a trainer's groups
    # (decay / no-decay, LoRA+) do not apply
    own_param_groups: bool = False
    # the HF Trainer's `optim` names that look like this rule and are not it, each with why (refused in one line)
    not_optim_names: dict[str, str] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return self.cls.__name__


# why the HF Trainer's optim="adafactor" does not map to FusedAdafactor
TRANSFORMERS_ADAFACTOR = (
    "the HF Trainer's adafactor is transformers' own Adafactor (relative_step, scale_parameter, warmup_init), "
    "another algorithm than torch.optim.Adafactor, which FusedAdafactor is: for torch's, pass "
    "fused_trainer_optimizers(rule='adafactor')"
)


def _adam_betas(args) -> dict:
    return dict(betas=(args.adam_beta1, args.adam_beta2))


OPTIMIZERS: dict[str, OptimizerEntry] = {
    "adamw": OptimizerEntry(
        "adamw",
        FusedAdamW,
        {
            **dict.fromkeys(
                ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_torch_xla", "adamw_torch_npu_fused"), "fp32"
            ),
            "paged_adamw_32bit": "fp32",
            **dict.fromkeys(("adamw_bnb_8bit", "adamw_8bit", "adamw_torch_8bit", "paged_adamw_8bit"), "8bit"),
        },
        lambda args: {**_adam_betas(args), "eps": args.adam_epsilon},
    ),
    # Lion takes the Trainer's adam betas as transformers gives them to bitsandbytes' Lion (no eps)
    "lion": OptimizerEntry(
        "lion",
        FusedLion,
        {"lion_32bit": "fp32", "paged_lion_32bit": "fp32", "lion_8bit": "8bit", "paged_lion_8bit": "8bit"},
        _adam_betas,
    ),
    "muon": OptimizerEntry("muon", FusedMuon, own_param_groups=True),
    # the Trainer's `sgd` is torch.optim.SGD at its defaults (momentum 0): the same here
    "sgd": OptimizerEntry("sgd", FusedSGD, {"sgd": "fp32"}),
    # torch.optim.Adafactor; the Trainer's `adafactor` is transformers' own Adafactor, another algorithm: refused
    "adafactor": OptimizerEntry("adafactor", FusedAdafactor, not_optim_names={"adafactor": TRANSFORMERS_ADAFACTOR}),
}
