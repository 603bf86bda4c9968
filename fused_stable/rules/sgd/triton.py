"""SGD's per-element math in Triton, called by the update kernel (kernels/update.py) for every block.

`step_scalars` turns a tensor's row of the hyper-parameter table into the update's scalars, `element` applies SGD
to fp32 values in torch.optim.SGD's order. torch.py and cpu.h beside this file hold the same two functions.
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
    H_MOMENTUM: tl.constexpr = SLOT.H_MOMENTUM,
    H_ONE_MINUS_DAMPENING: tl.constexpr = SLOT.H_ONE_MINUS_DAMPENING,
    H_WEIGHT_DECAY: tl.constexpr = SLOT.H_WEIGHT_DECAY,
    H_NESTEROV: tl.constexpr = SLOT.H_NESTEROV,
    H_GRAD_SIGN: tl.constexpr = SLOT.H_GRAD_SIGN,
):
    """This tensor's scalars for the update, from its group's row `hp`, the decision kernel's grad multiplier and
    lr factor, and its `step` counter (already advanced: 1 on the buffer's first update)."""
    lr = tl.load(hp + H_LR) * tl.load(fstate + F_LR_FACTOR)
    grad_mul = tl.load(fstate + F_GRAD_MUL) * tl.load(hp + H_GRAD_SIGN)  # sign -1: maximize (exact)
    first = tl.where(step <= 1.0, 1.0, 0.0)
    momentum = tl.load(hp + H_MOMENTUM)
    one_minus_dampening = tl.load(hp + H_ONE_MINUS_DAMPENING)
    weight_decay = tl.load(hp + H_WEIGHT_DECAY)
    nesterov = tl.load(hp + H_NESTEROV)
    return grad_mul, lr, weight_decay, momentum, one_minus_dampening, nesterov, first


@triton.jit
def element(p, g, buf, unused1, unused2, scalars, MOMENTUM: tl.constexpr):
    """SGD on fp32 values: the param `p`, its grad `g` as stored (times `grad_mul`, which carries the clip
    coefficient, the loss scale and, for maximize=True, the sign) and, with MOMENTUM (the group's momentum != 0),
    the buffer `buf` (`momentum_buffer`). Returns the new (p, buf, unused1, unused2)."""
    grad_mul, lr, weight_decay, momentum, one_minus_dampening, nesterov, first = scalars
    g = g * grad_mul
    g = tl.where(weight_decay != 0.0, g + weight_decay * p, g)  # torch adds nothing at 0 (an inf p stays out)
    if MOMENTUM:
        buf = tl.where(first != 0.0, g, buf * momentum + one_minus_dampening * g)
        g = tl.where(nesterov != 0.0, g + momentum * buf, buf)
    p = p - lr * g
    return p, buf, unused1, unused2
