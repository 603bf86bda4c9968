"""Lion's per-element math on fp32 torch tensors, for the torch backend's exact reference
(backends/torch/exact_reference.py): triton.py's two functions, op for op, in the same order. The compiled CPU
update (backends/torch/updates.py's CompiledUpdate, with cpu.h's element) computes its scalars with
`step_scalars` below, so it is the reference bit for bit."""

from __future__ import annotations

import torch

from ...layout import H_LR
from . import RULE

SLOT = RULE.slots  # the rule's slots of the hyper-parameter row: SLOT.H_<NAME>


def step_scalars(row: torch.Tensor, steps: torch.Tensor, grad_mul, lr_factor) -> tuple:
    """triton.py's `step_scalars`, from the group's fp32 hyper-parameter `row` and the decisions' grad multiplier
    and lr factor (0-dim fp32 tensors); `steps` is not read (no bias correction)."""
    lr = row[H_LR] * lr_factor
    decay = 1.0 - lr * row[SLOT.H_WEIGHT_DECAY]
    return (
        grad_mul,
        decay,
        lr,
        row[SLOT.H_BETA1],
        row[SLOT.H_BETA2],
        row[SLOT.H_ONE_MINUS_BETA1],
        row[SLOT.H_ONE_MINUS_BETA2],
    )


def element(p, g, m, unused1, unused2, scalars, option: bool = False) -> tuple:
    """triton.py's `element` on fp32 tensors: returns the new (p, m, unused1, unused2)."""
    grad_mul, decay, lr, beta1, beta2, one_minus_beta1, one_minus_beta2 = scalars
    g = g * grad_mul
    p = p * decay
    interpolation = m * beta1 + one_minus_beta1 * g
    p = p - lr * torch.sign(interpolation)
    m = m * beta2 + one_minus_beta2 * g
    return p, m, unused1, unused2
