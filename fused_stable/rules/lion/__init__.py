r"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as lion-pytorch defines it.

With g the grad times the step's multiplier (the clip coefficient and the loss scale: the clip comes before the
momentum, as `clip_grad_norm_` then `Lion.step()`):

    p = p * (1 - lr * weight_decay)                    (decoupled weight decay, scaled by lr)
    p = p - lr * sign(beta1 * m + (1 - beta1) * g)     (the update: the sign of the interpolation)
    m = beta2 * m + (1 - beta2) * g                    (the momentum, exp_avg, after the update)

Names, defaults and the state key are lion-pytorch's (`Lion(params, lr=1e-4, betas=(0.9, 0.99),
weight_decay=0.0)`), the package bitsandbytes tests its Lion against; its `decoupled_weight_decay=True` (weight
decay divided by the initial lr) is not taken. lion-pytorch keeps no `step`; fused_stable's state adds one.
The per-element math is beside this file: triton.py (the update kernel), torch.py (the exact reference), cpu.h
(the compiled CPU op).
"""

from __future__ import annotations

from ..declaration import SIGNED, STOCHASTIC, HParam, Rule, State, at_least_zero, beta_pair, float_pair, learning_rate


def _row(betas, weight_decay: float) -> tuple[float, ...]:
    """The rule's slots of a group's row; 1 - beta derived on the host in float64, as lion-pytorch's `1. - beta`."""
    beta1, beta2 = betas
    return (beta1, beta2, weight_decay, 1.0 - beta1, 1.0 - beta2)


RULE = Rule(
    name="lion",
    title="Lion",
    package=__name__,
    states=(
        # bf16: an EMA with beta2 = 0.99 moves 1% of (g - m) per step, under half a bf16 ulp (0.2-0.4%) whenever g
        # is within ~20% of m, so rounding to nearest would freeze it; stochastic rounding keeps its mean
        State("exp_avg", SIGNED, bf16=STOCHASTIC),
    ),
    hparams=(
        HParam("lr", 1e-4, check=learning_rate),
        HParam(
            "betas",
            (0.9, 0.99),
            check=beta_pair(closed=True, meaning=" (beta1 for the update's interpolation, beta2 for the momentum)"),
            normalize=float_pair,
        ),
        HParam("weight_decay", 0.0, check=at_least_zero("weight_decay", finite=True)),
    ),
    row=("beta1", "beta2", "weight_decay", "one_minus_beta1", "one_minus_beta2"),
    row_inputs=("betas", "weight_decay"),
    fill_row=_row,
    torch_keeps_step=False,
)
