"""AdamW's per-element math in Triton, called by the update kernel (kernels/update.py) for every block.

`step_scalars` turns a tensor's row of the hyper-parameter table into the update's scalars, `adamw_element`
applies AdamW to fp32 values. The kernel loads and stores (state formats, master weights, rounding): these two
never see memory. torch.py and cpu.h beside this file hold the same two functions, in the same order, so the
three read side by side; kernels/update.py's module doc says how the rounding matches torch's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ... import layout
from . import RULE

SLOT = RULE.slots  # the rule's slots of the hyper-parameter row: SLOT.H_<NAME>


@triton.jit
def _expm1(x):
    """exp(x) - 1 without the cancellation near 0 (a Taylor series there); x = -inf gives -1."""
    tail = 1.0 / 720 + tl.div_rn(x, 5040.0)
    series = x * (1.0 + x * (0.5 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 + x * tail)))))
    return tl.where(tl.abs(x) < 0.5, series, tl.exp(x) - 1.0)


@triton.jit
def step_scalars(
    hp,
    fstate,
    step,
    F_GRAD_MUL: tl.constexpr = layout.F_GRAD_MUL,
    F_LR_FACTOR: tl.constexpr = layout.F_LR_FACTOR,
    H_LR: tl.constexpr = layout.H_LR,
    H_BETA2: tl.constexpr = SLOT.H_BETA2,
    H_EPS: tl.constexpr = SLOT.H_EPS,
    H_WEIGHT_DECAY: tl.constexpr = SLOT.H_WEIGHT_DECAY,
    H_ONE_MINUS_BETA1: tl.constexpr = SLOT.H_ONE_MINUS_BETA1,
    H_ONE_MINUS_BETA2: tl.constexpr = SLOT.H_ONE_MINUS_BETA2,
    H_LOG_BETA1: tl.constexpr = SLOT.H_LOG_BETA1,
    H_LOG_BETA2: tl.constexpr = SLOT.H_LOG_BETA2,
    H_GRAD_SIGN: tl.constexpr = SLOT.H_GRAD_SIGN,
):
    """This tensor's scalars for the update, from its group's row `hp` of the hyper-parameter table, the decision
    kernel's grad multiplier and lr factor, and its `step` counter (already advanced for this step)."""
    lr = tl.load(hp + H_LR) * tl.load(fstate + F_LR_FACTOR)
    beta2 = tl.load(hp + H_BETA2)
    one_minus_beta1 = tl.load(hp + H_ONE_MINUS_BETA1)
    one_minus_beta2 = tl.load(hp + H_ONE_MINUS_BETA2)
    eps = tl.load(hp + H_EPS)
    decay = 1.0 - lr * tl.load(hp + H_WEIGHT_DECAY)
    grad_mul = tl.load(fstate + F_GRAD_MUL) * tl.load(hp + H_GRAD_SIGN)  # sign -1: maximize (exact)
    # 1 - beta ** step = -expm1(step * log(beta)), accurate in fp32 even for beta2 = 0.999 at step 1
    bias_correction1 = -_expm1(step * tl.load(hp + H_LOG_BETA1))
    bias_correction2_sqrt = tl.sqrt_rn(-_expm1(step * tl.load(hp + H_LOG_BETA2)))
    step_size = tl.div_rn(lr, bias_correction1)
    return grad_mul, decay, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bias_correction2_sqrt


@triton.jit
def adamw_element(p, g, m, v, v_max, scalars, AMSGRAD: tl.constexpr):
    """AdamW on fp32 values: the param `p`, its grad `g` as stored (times `grad_mul` here, which carries the clip
    coefficient, the loss scale and, for maximize=True, the sign), the moments `m`, `v` and, with AMSGRAD,
    `v_max` (else unused and returned as given). Returns the new (p, m, v, v_max)."""
    grad_mul, decay, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bias_correction2_sqrt = scalars
    g = g * grad_mul
    # the same arithmetic, in the same order, as torch.optim.AdamW's single-tensor path
    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * (g * g)
    if AMSGRAD:  # normalise by the largest second moment so far (torch: state "max_exp_avg_sq")
        v_max = tl.maximum(v_max, v, propagate_nan=tl.PropagateNan.ALL)
        denom = tl.div_rn(tl.sqrt_rn(v_max), bias_correction2_sqrt) + eps
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    return p, m, v, v_max


element = adamw_element  # the name the update kernel and the exact reference call (rules/__init__.py)
