"""Lion's per-element math in Triton, called by the update kernel (kernels/update.py) for every block.

`step_scalars` turns a tensor's row of the hyper-parameter table into the update's scalars, `element` applies
Lion to fp32 values in lion-pytorch's order. torch.py beside this file holds the same two functions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ... import layout
from . import RULE

SLOT = RULE.slots  # the rule's slots of the hyper-parameter row: SLOT.H_<NAME>


@triton.jit
def step_scalars(
    hp,
    fstate,
    step,
    F_GRAD_MUL: tl.constexpr = layout.F_GRAD_MUL,
    F_LR_FACTOR: tl.constexpr = layout.F_LR_FACTOR,
    H_LR: tl.constexpr = layout.H_LR,
    H_BETA1: tl.constexpr = SLOT.H_BETA1,
    H_BETA2: tl.constexpr = SLOT.H_BETA2,
    H_WEIGHT_DECAY: tl.constexpr = SLOT.H_WEIGHT_DECAY,
    H_ONE_MINUS_BETA1: tl.constexpr = SLOT.H_ONE_MINUS_BETA1,
    H_ONE_MINUS_BETA2: tl.constexpr = SLOT.H_ONE_MINUS_BETA2,
):
    """This tensor's scalars for the update, from its group's row `hp` and the decision kernel's grad multiplier
    and lr factor (Lion has no bias correction: `step` is not read)."""
    lr = tl.load(hp + H_LR) * tl.load(fstate + F_LR_FACTOR)
    decay = 1.0 - lr * tl.load(hp + H_WEIGHT_DECAY)
    beta1 = tl.load(hp + H_BETA1)
    beta2 = tl.load(hp + H_BETA2)
    one_minus_beta1 = tl.load(hp + H_ONE_MINUS_BETA1)
    one_minus_beta2 = tl.load(hp + H_ONE_MINUS_BETA2)
    return tl.load(fstate + F_GRAD_MUL), decay, lr, beta1, beta2, one_minus_beta1, one_minus_beta2


@triton.jit
def element(p, g, m, unused1, unused2, scalars, OPTION: tl.constexpr):
    """Lion on fp32 values: the param `p`, its grad `g` as stored (times `grad_mul`, which carries the clip
    coefficient and the loss scale), the momentum `m` (`exp_avg`). The kernel's other two state slots are
    returned as given. Returns the new (p, m, unused1, unused2)."""
    grad_mul, decay, lr, beta1, beta2, one_minus_beta1, one_minus_beta2 = scalars
    g = g * grad_mul
    p = p * decay
    interpolation = m * beta1 + one_minus_beta1 * g
    # torch.sign's values: 1, -1, and 0.0 for +-0 and NaN (torch 2.13 on CPU)
    direction = tl.where(interpolation > 0.0, 1.0, tl.where(interpolation < 0.0, -1.0, 0.0))
    p = p - lr * direction
    m = m * beta2 + one_minus_beta2 * g
    return p, m, unused1, unused2
