r"""AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization"), as torch.optim.AdamW computes it.

With g the grad times the step's multiplier (the clip coefficient and the loss scale; negated with maximize),
and t the param's `step` after this update counts it:

    p     = p * (1 - lr * weight_decay)                        (decoupled weight decay)
    m     = m + (1 - beta1) * (g - m)                          (exp_avg: beta1 * m + (1 - beta1) * g)
    v     = beta2 * v + (1 - beta2) * g^2                      (exp_avg_sq)
    v_max = max(v_max, v)                                      (max_exp_avg_sq; amsgrad only, then used for v)
    p     = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Names, defaults, checks and state keys are torch.optim.AdamW's (its `foreach`, `fused`, `capturable`,
`differentiable` and `decoupled_weight_decay` are kept in the groups for its call sites and state dicts). The
per-element math is beside this file, one file per language with the same functions in the same order: triton.py
(the update kernel), torch.py (the torch backend's exact reference), cpu.h (the compiled CPU op).
"""

from __future__ import annotations

import math

from ..declaration import (
    SIGNED,
    STOCHASTIC,
    UNSIGNED,
    HParam,
    Rule,
    State,
    at_least_zero,
    beta_pair,
    float_pair,
    learning_rate,
)


def _row(betas, eps: float, weight_decay: float, maximize: bool) -> tuple[float, ...]:
    """The rule's slots of a group's row. 1 - beta and log(beta) are derived on the host in float64: in fp32 on
    the device they lose ~1e-5 relative for beta2 = 0.999, which shows in exp_avg_sq and the bias correction."""
    beta1, beta2 = betas
    return (
        beta1,
        beta2,
        eps,
        weight_decay,
        1.0 - beta1,
        1.0 - beta2,
        math.log(beta1) if beta1 > 0 else float("-inf"),
        math.log(beta2) if beta2 > 0 else float("-inf"),
        -1.0 if maximize else 1.0,  # maximize: the update ascends
    )


RULE = Rule(
    name="adamw",
    title="AdamW",
    package=__name__,
    states=(
        State("exp_avg", SIGNED),
        # bf16: exp_avg_sq moves under half an ulp per step with beta2 = 0.999: stochastic rounding keeps its mean
        State("exp_avg_sq", UNSIGNED, bf16=STOCHASTIC),
        State("max_exp_avg_sq", UNSIGNED, option="amsgrad"),  # a running maximum: to nearest
    ),
    hparams=(
        HParam("lr", 1e-3, check=learning_rate),
        HParam("betas", (0.9, 0.999), check=beta_pair(closed=False), normalize=float_pair),
        HParam("eps", 1e-8, check=at_least_zero("epsilon")),
        HParam("weight_decay", 1e-2, check=at_least_zero("weight_decay")),
        HParam("amsgrad", False, normalize=bool),
        HParam("maximize", False, normalize=bool),
        # torch.optim.AdamW's own keys, kept in the groups (no effect here: the step is always the fused one)
        HParam("foreach", None),
        HParam("capturable", False),
        HParam("differentiable", False),
        HParam("fused", None),
        HParam("decoupled_weight_decay", True),
    ),
    row=(
        "beta1",
        "beta2",
        "eps",
        "weight_decay",
        "one_minus_beta1",
        "one_minus_beta2",
        "log_beta1",
        "log_beta2",
        "grad_sign",
    ),
    row_inputs=("betas", "eps", "weight_decay", "maximize"),
    fill_row=_row,
)
