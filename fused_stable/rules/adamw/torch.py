"""AdamW's per-element math on fp32 torch tensors, for the torch backend's exact reference
(backends/torch/exact_reference.py): triton.py's two functions, op for op, in the same order.

Every operation is the update kernel's, in fp32 with IEEE division and square root, so the same inputs give the
same fp32 moments; only `exp` (in the bias correction) may round otherwise than the device's, which moves a
param by an ulp (docs/optimizer.md, "Low-precision state").

What the torch backend reads besides (backends/torch/updates.py; plain data, so the backend names no rule):
  TORCH_FUSED          "adamw": torch's `_fused_adamw_` computes this rule (fp32 state where the compiled CPU
                       update does not fit, and without the compiled ops);
  FP32_STATE_SCALARS   the compiled CPU update's scalars for fp32 state: `float64_step_scalars` (torch.optim.AdamW's
                       fp64 arithmetic, rounded once), not the kernel's `step_scalars`; bf16 and 8-bit state take
                       `step_scalars`, the exact reference's bits.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...layout import H_LR
from ...state_format import sqrt_rn
from . import RULE

SLOT = RULE.slots  # the rule's slots of the hyper-parameter row: SLOT.H_<NAME>


def expm1(x: torch.Tensor) -> torch.Tensor:
    """triton.py's `_expm1`: a Taylor series below |x| = 0.5, exp(x) - 1 above."""
    tail = 1.0 / 720 + x / 5040.0
    series = x * (1.0 + x * (0.5 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 + x * tail)))))
    # exp in fp64, rounded: torch's fp32 exp and numpy's (Triton's interpreter) differ in the last bit for ~40% of
    # inputs, the GPU's approximate one otherwise again; this only moves a param by an ulp, never a moment
    return torch.where(x.abs() < 0.5, series, torch.exp(x.double()).to(x.dtype) - 1.0)


def step_scalars(row: torch.Tensor, steps: torch.Tensor, grad_mul, lr_factor) -> tuple:
    """triton.py's `step_scalars`: from the group's fp32 hyper-parameter `row`, the tensors' `step` counters
    (already advanced; a column, one per row of the values the element sees) and the decisions' grad
    multiplier and lr factor (0-dim fp32 tensors). The kernel reads the last two from the decision buffer."""
    lr = row[H_LR] * lr_factor
    decay = 1.0 - lr * row[SLOT.H_WEIGHT_DECAY]
    signed_grad_mul = grad_mul * row[SLOT.H_GRAD_SIGN]
    bias_correction1 = -expm1(steps * row[SLOT.H_LOG_BETA1])
    bias_correction2_sqrt = sqrt_rn(-expm1(steps * row[SLOT.H_LOG_BETA2]))
    step_size = lr / bias_correction1
    return (
        signed_grad_mul,
        decay,
        row[SLOT.H_BETA2],
        row[SLOT.H_ONE_MINUS_BETA1],
        row[SLOT.H_ONE_MINUS_BETA2],
        row[SLOT.H_EPS],
        step_size,
        bias_correction2_sqrt,
    )


def adamw_element(p, g, m, v, v_max, scalars, amsgrad: bool) -> tuple:
    """triton.py's `adamw_element` on fp32 tensors: returns the new (p, m, v, v_max); `v_max` is used and
    changed only with amsgrad."""
    grad_mul, decay, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bias_correction2_sqrt = scalars
    g = g * grad_mul
    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * (g * g)
    if amsgrad:
        v_max = torch.maximum(v_max, v)
        denom = sqrt_rn(v_max) / bias_correction2_sqrt + eps
    else:
        denom = sqrt_rn(v) / bias_correction2_sqrt + eps
    p = p - step_size * (m / denom)
    return p, m, v, v_max


element = adamw_element  # the name the exact reference calls (rules/__init__.py)


def float64_step_scalars(hp: tuple, step: float, grad_mul, lr_factor) -> np.ndarray:
    """`step_scalars`' values (cpu.h's `Scalars`, in its order) computed as torch.optim.AdamW computes them: fp64
    from the group's hyper-parameters `hp` (lr first), the tensor's `step` (already advanced) and the host
    decisions' grad multiplier and lr factor (numpy fp32 scalars), each rounded once to fp32. `math.pow` and
    `math.sqrt` are the C library's `pow` and the correctly rounded square root, the functions the compiled op
    called when it computed these in C++: the same bits."""
    lr = float(lr_factor * hp[0])  # fp32 product of the factor and the base lr, as the decisions give it
    (beta1, beta2), eps, weight_decay, maximize = hp[1:5]
    bias_correction1 = 1.0 - math.pow(beta1, step)
    bias_correction2 = 1.0 - math.pow(beta2, step)
    signed_grad_mul = -float(grad_mul) if maximize else float(grad_mul)
    values = (
        signed_grad_mul,
        1.0 - lr * weight_decay,
        beta2,
        1.0 - beta1,
        1.0 - beta2,
        eps,
        lr / bias_correction1,
        math.sqrt(bias_correction2),
    )
    return np.array(values, dtype=np.float32)


TORCH_FUSED = "adamw"  # torch._fused_adamw_ is this rule (module doc)
FP32_STATE_SCALARS = float64_step_scalars  # the compiled CPU update's scalars for fp32 state (module doc)
