"""Lion, the rule (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as lion-pytorch defines it:
its slots of the hyper-parameter table, the row the step's backends read, and its one state.

    p   = p * (1 - lr * weight_decay)                 (decoupled weight decay, scaled by lr)
    p   = p - lr * sign(beta1 * m + (1 - beta1) * g)  (the update: the sign of the interpolation)
    m   = beta2 * m + (1 - beta2) * g                 (the momentum, after the update)

Names, defaults and the state key (`exp_avg`) are lion-pytorch's (`Lion(params, lr=1e-4, betas=(0.9, 0.99),
weight_decay=0.0)`), the package bitsandbytes tests its Lion against; its `decoupled_weight_decay=True` (weight
decay divided by the initial lr) is not taken. `g` is the grad times the step's grad multiplier (the clip
coefficient and loss scale), so clipping comes before the momentum, as `clip_grad_norm_` then `Lion.step()`.

Row slot 0 (`layout.H_LR`) and the slots after `ROW_END` belong to the step; slots 1 to ROW_END - 1 are Lion's.
The per-element math is beside this file: triton.py (the update kernel) and torch.py (the exact reference).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from torch import Tensor

from ...layout import H_LR, H_SHOWN_LR, H_SIZE
from ...state_format import SIGNED

NAME = "lion"
TITLE = "Lion"

STATE_NAMES = ("exp_avg",)  # lion-pytorch's state key
OPTION = None  # no group option adds a state
OPTIONAL_STATE = None
TORCH_STATE_KEYS = ("exp_avg",)  # lion-pytorch keeps no `step`; fused_stable's state adds one (loads fill it)
CODECS = {"exp_avg": SIGNED}
# (no `import torch` here: the package's torch.py submodule would shadow it)
# bf16: the momentum is an EMA with beta2 = 0.99, moving 1% of (g - m) per step: under half a bf16 ulp (0.2-0.4%)
# whenever g is within ~20% of m, so rounding to nearest would freeze it; stochastic rounding keeps its mean
STOCHASTIC_BF16 = frozenset({"exp_avg"})
PICKLE_DEFAULTS: dict = {}

H_BETA1 = 1
H_BETA2 = 2
H_WEIGHT_DECAY = 3
# derived on the host in float64, as lion-pytorch's `1. - beta` is
H_ONE_MINUS_BETA1 = 4
H_ONE_MINUS_BETA2 = 5
ROW_END = 6
assert H_LR < H_BETA1 and ROW_END <= H_SHOWN_LR, "Lion's slots overlap the step's (layout.py)"

ROW_LAYOUT = ";".join(
    f"{name}={value!r}" for name, value in sorted(globals().items()) if name.startswith("H_") and type(value) is int
)


class HParams(NamedTuple):
    """One Lion param group's hyper-parameters as a fused step takes them (FusedLion.hparam_rows)."""

    lr: float | Tensor  # with an lr schedule, the group's base lr; a tensor is read on the device
    beta1: float
    beta2: float
    weight_decay: float


def state_names(option: bool = False) -> tuple[str, ...]:
    return STATE_NAMES


def group_hparams(group: dict) -> tuple:
    """A param group's hyper-parameters after the lr, in HParams' order."""
    return (*group["betas"], group["weight_decay"])


def hparam_row(lr, beta1: float, beta2: float, weight_decay: float) -> list[float]:
    """One group's row of the hyper-parameter table, as every backend computes with it (fp32 on the device)."""
    row = [0.0] * H_SIZE
    row[H_LR] = 0.0 if isinstance(lr, Tensor) else float(lr)  # a tensor lr is copied in on the device
    row[H_BETA1], row[H_BETA2], row[H_WEIGHT_DECAY] = beta1, beta2, weight_decay
    row[H_ONE_MINUS_BETA1], row[H_ONE_MINUS_BETA2] = 1.0 - beta1, 1.0 - beta2
    return row


def defaults(lr, betas, weight_decay) -> dict:
    """FusedLion's param-group defaults, checked."""
    values = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
    check_group(values, values)
    return {"lr": lr, "betas": _float_pair(betas), "weight_decay": weight_decay}


def check_group(group: dict, defaults: dict) -> None:
    """A param group's hyper-parameters (those it sets, else the defaults), with clear errors: lr >= 0 (a float
    or a 1-element tensor), two betas in [0, 1] (lion-pytorch's range), weight_decay >= 0."""
    lr = group.get("lr", defaults["lr"])
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    lr_value = float(lr.detach().reshape(()).cpu()) if isinstance(lr, Tensor) else float(lr)
    if not lr_value >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
    betas = group.get("betas", defaults["betas"])
    if len(betas) != 2:
        raise ValueError(
            f"betas must be a pair (beta1 for the update's interpolation, beta2 for the momentum), got {betas}"
        )
    for index, beta in enumerate(_float_pair(betas)):
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta} (must be in [0, 1])")
    weight_decay = group.get("weight_decay", defaults["weight_decay"])
    if not (weight_decay >= 0.0 and math.isfinite(weight_decay)):
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be a finite number >= 0)")


def normalize_group(group: dict) -> None:
    """Tensor betas as floats, in place: the step's tables hold floats."""
    if "betas" in group:
        group["betas"] = _float_pair(group["betas"])


def _float_pair(betas) -> tuple[float, float]:
    return tuple(float(b.detach().reshape(())) if isinstance(b, Tensor) else float(b) for b in betas)
