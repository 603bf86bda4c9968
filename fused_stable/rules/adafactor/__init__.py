r"""Adafactor (Shazeer and Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost"), as
torch.optim.Adafactor (torch 2.13) computes it: a matrix rule (its factored second moment and its RMS terms need
the whole param).

With g the grad times the step's multiplier (the clip coefficient and the loss scale; negated with maximize), t the
param's `step` (already counted for this step), lr the group's lr times the schedule's factor:

    beta2_t' = t ** beta2_decay                           (1 - beta2_t: the EMA's weight of this step's g * g)
    rho      = min(lr, 1 / sqrt(t))                       (the relative step size, capped by lr)
    alpha    = max(eps2, ||p||_2 / sqrt(numel)) * rho     (scaled by the param's RMS, before the decay)
    p        = p * (1 - lr * weight_decay)                (decoupled weight decay)
    a >= 2-D param (factored over its last two dims, rows R x cols C):
      row_var = lerp(row_var, mean(g * g, dim=-1), beta2_t')     (keepdim: [..., R, 1])
      col_var = lerp(col_var, mean(g * g, dim=-2), beta2_t')     (keepdim: [..., 1, C])
      V       = (row_var @ col_var) / max(mean(row_var, dim=-2), eps1)
    a 0-D or 1-D param:
      variance = lerp(variance, g * g, beta2_t');  V = variance
    U     = g * rsqrt(max(V, eps1 ** 2))                  (eps1 None: the param dtype's machine epsilon)
    denom = max(1, ||U||_2 / (sqrt(numel) * d))           (the update's RMS clipped to d)
    p     = p - alpha / denom * U

The means are torch's: `norm(g, dim).square() / n`. Names, defaults, checks and state keys are
torch.optim.Adafactor's (a test reads its signature); its `foreach` is kept in the groups for its call sites and
state dicts. `matrix.py` beside this file is the interface the fused step calls, `torch.py` the update on torch
tensors. A param with no element is left alone (torch's step divides by its numel of 0 and raises).

Importing this package imports neither triton nor torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..declaration import UNSIGNED, HParam, Rule, State

LR = 1e-2
BETA2_DECAY = -0.8
EPS = (None, 1e-3)
D = 1.0
WEIGHT_DECAY = 0.0


def row_shape(shape: Sequence[int]) -> tuple[int, ...] | None:
    """row_var: the param's shape with its last dim 1 (torch's keepdim mean over it); None below 2-D."""
    return (*shape[:-1], 1) if len(shape) >= 2 else None


def col_shape(shape: Sequence[int]) -> tuple[int, ...] | None:
    """col_var: the param's shape with its second-to-last dim 1; None below 2-D."""
    return (*shape[:-2], 1, shape[-1]) if len(shape) >= 2 else None


def vector_shape(shape: Sequence[int]) -> tuple[int, ...] | None:
    """variance: the param's own shape, for a 0-D or 1-D param only."""
    return tuple(shape) if len(shape) < 2 else None


def _real(value) -> float:
    # torch reads a tensor lr with .item() every step; a 1-element tensor is taken here too (read on the step)
    if hasattr(value, "numel"):
        if value.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")  # torch's words
        return float(value.detach().reshape(()).cpu())
    return value


def _lr(lr) -> None:
    if not 0.0 <= _real(lr):
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")  # torch's words, as each below


def _beta2_decay(value) -> None:
    if not 0.0 >= value:
        raise ValueError(f"beta2_decay should be <= 0 but is: {value}")


def _eps(eps) -> None:
    if len(eps) != 2:
        raise ValueError(f"eps must be a pair (epsilon1 or None, epsilon2), got {eps}")
    if eps[0] is not None and not 0.0 <= eps[0]:
        raise ValueError(f"epsilon1 should be >= 0 but is: {eps[0]}")
    if not 0.0 <= eps[1]:
        raise ValueError(f"epsilon2 should be >= 0 but is: {eps[1]}")


def _d(value) -> None:
    if not 1.0 <= value:
        raise ValueError(f"Clipping threshold d should be >= 1 but is: {value}")


def _weight_decay(value) -> None:
    if not 0.0 <= value:
        raise ValueError(f"weight_decay should be >= 0 but is: {value}")


RULE = Rule(
    name="adafactor",
    title="Adafactor",
    package=__name__,
    # torch.optim.Adafactor's keys and shapes, in the param's dtype (matrix.py: fp32 state_precision only); a state
    # whose shape is None for a param's rank is not created (row_var / col_var for >= 2-D, variance for the rest)
    states=(
        State("row_var", UNSIGNED, shape=row_shape),
        State("col_var", UNSIGNED, shape=col_shape),
        State("variance", UNSIGNED, shape=vector_shape),
    ),
    hparams=(
        HParam("lr", LR, check=_lr),
        HParam("beta2_decay", BETA2_DECAY, check=_beta2_decay),
        HParam("eps", EPS, check=_eps, normalize=tuple),
        HParam("d", D, check=_d),
        HParam("weight_decay", WEIGHT_DECAY, check=_weight_decay),
        HParam("foreach", None),  # torch's key, kept in the groups (no effect: the step is always the fused one)
        HParam("maximize", False, normalize=bool),
    ),
    row=(),  # no slot of the kernels' row: its update runs outside them (matrix.py), from the step's decisions
    row_inputs=(),
    fill_row=lambda: (),
    elementwise=False,
)
DEFAULTS = {h.name: h.default for h in RULE.hparams}  # an Adafactor group's keys at torch.optim.Adafactor's defaults
