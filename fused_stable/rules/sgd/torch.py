"""SGD's per-element math on fp32 torch tensors, for the torch backend's exact reference
(backends/torch/exact_reference.py): triton.py's two functions, op for op, in the same order."""

from __future__ import annotations

import torch

from ...layout import H_LR
from . import RULE

SLOT = RULE.slots  # the rule's slots of the hyper-parameter row: SLOT.H_<NAME>


def step_scalars(row: torch.Tensor, steps: torch.Tensor, grad_mul, lr_factor) -> tuple:
    """triton.py's `step_scalars`, from the group's fp32 hyper-parameter `row`, the tensors' `step` counters
    (already advanced; a column, one per row of the values the element sees) and the decisions' grad multiplier and
    lr factor (0-dim fp32 tensors)."""
    lr = row[H_LR] * lr_factor
    grad_mul = grad_mul * row[SLOT.H_GRAD_SIGN]
    first = torch.where(steps <= 1.0, 1.0, 0.0)
    return (
        grad_mul,
        lr,
        row[SLOT.H_WEIGHT_DECAY],
        row[SLOT.H_MOMENTUM],
        row[SLOT.H_ONE_MINUS_DAMPENING],
        row[SLOT.H_NESTEROV],
        first,
    )


def element(p, g, buf, unused1, unused2, scalars, momentum_on: bool) -> tuple:
    """triton.py's `element` on fp32 tensors: returns the new (p, buf, unused1, unused2)."""
    grad_mul, lr, weight_decay, momentum, one_minus_dampening, nesterov, first = scalars
    g = g * grad_mul
    g = torch.where(weight_decay != 0.0, g + weight_decay * p, g)
    if momentum_on:
        buf = torch.where(first != 0.0, g, buf * momentum + one_minus_dampening * g)
        g = torch.where(nesterov != 0.0, g + momentum * buf, buf)
    p = p - lr * g
    return p, buf, unused1, unused2
