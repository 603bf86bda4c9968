"""AdamW, the rule: its slots of the hyper-parameter table, the row the step's backends read, and its state.

Row slot 0 (`layout.H_LR`, the lr the schedule multiplies) and the slots after `ROW_END` (`layout.H_SHOWN_LR`)
belong to the step; slots 1 to ROW_END - 1 are AdamW's. `ROW_LAYOUT` names them for the update kernel's cache
key (as layout.KERNEL_LAYOUT names the step's slots), so a slot that moves recompiles the kernel.

The per-element math is beside this file, one file per language with the same functions in the same order:
triton.py (the update kernel), torch.py (the torch backend's exact reference), cpu.h (the compiled CPU op).
"""

from __future__ import annotations

import math

from torch import Tensor

from ...layout import H_LR, H_SHOWN_LR, H_SIZE, HParams
from ...state_format import SIGNED, UNSIGNED

NAME = "adamw"
TITLE = "AdamW"

# the moments, in the order the element functions take and return them (torch.optim.AdamW's state keys)
STATE_NAMES = ("exp_avg", "exp_avg_sq")
OPTION = "amsgrad"  # the group key whose True adds OPTIONAL_STATE
OPTIONAL_STATE = AMSGRAD_STATE = "max_exp_avg_sq"  # amsgrad=True only: the largest exp_avg_sq so far
TORCH_STATE_KEYS = ("step", *STATE_NAMES, AMSGRAD_STATE)  # what torch.optim.AdamW's state dict holds per param
# 8-bit: exp_avg signed, the second moments unsigned (state_format.py); bf16: exp_avg_sq rounds stochastically, as
# it moves under half an ulp per step with beta2 = 0.999 (max_exp_avg_sq, a running maximum, to nearest)
CODECS = {"exp_avg": SIGNED, "exp_avg_sq": UNSIGNED, "max_exp_avg_sq": UNSIGNED}
STOCHASTIC_BF16 = frozenset({"exp_avg_sq"})


def state_names(amsgrad: bool) -> tuple[str, ...]:
    """The states a param of a group with this `amsgrad` keeps, in the element's order."""
    return STATE_NAMES + (AMSGRAD_STATE,) if amsgrad else STATE_NAMES


# AdamW's slots of the hyper-parameter table (one fp32 row per param group)
H_BETA1 = 1
H_BETA2 = 2
H_EPS = 3
H_WEIGHT_DECAY = 4
# derived on the host in float64: 1 - beta and log(beta) in fp32 on the device lose ~1e-5 relative for
# beta2 = 0.999, which shows in exp_avg_sq and in the bias correction
H_ONE_MINUS_BETA1 = 5
H_ONE_MINUS_BETA2 = 6
H_LOG_BETA1 = 7
H_LOG_BETA2 = 8
H_GRAD_SIGN = 9  # -1.0 for maximize=True (the update ascends), else 1.0
ROW_END = 10  # the first slot after the rule's: the step's own slots follow
assert H_LR < H_BETA1 and ROW_END <= H_SHOWN_LR, "AdamW's slots overlap the step's (layout.py)"

ROW_LAYOUT = ";".join(
    f"{name}={value!r}" for name, value in sorted(globals().items()) if name.startswith("H_") and type(value) is int
)


def group_hparams(group: dict) -> tuple:
    """A param group's hyper-parameters after the lr, in HParams' order (the optimizer puts the lr first)."""
    return (*group["betas"], group["eps"], group["weight_decay"], group["maximize"])


def hparam_row(lr, beta1: float, beta2: float, eps: float, weight_decay: float, maximize=False) -> list[float]:
    """One group's row of the hyper-parameter table, as every backend computes with it (fp32 on the device)."""
    row = [0.0] * H_SIZE
    row[H_LR] = 0.0 if isinstance(lr, Tensor) else float(lr)  # a tensor lr is copied in on the device
    row[H_BETA1], row[H_BETA2] = beta1, beta2
    row[H_EPS], row[H_WEIGHT_DECAY] = eps, weight_decay
    # derived on the host in float64: in fp32 on the device they lose ~1e-5 relative for beta2 = 0.999
    row[H_ONE_MINUS_BETA1], row[H_ONE_MINUS_BETA2] = 1.0 - beta1, 1.0 - beta2
    row[H_LOG_BETA1] = math.log(beta1) if beta1 > 0 else float("-inf")
    row[H_LOG_BETA2] = math.log(beta2) if beta2 > 0 else float("-inf")
    row[H_GRAD_SIGN] = -1.0 if maximize else 1.0
    return row


def check_group(group: dict, defaults: dict) -> None:
    """A param group's hyper-parameters (those it sets; the rest are the defaults, checked once), with
    torch.optim.AdamW's checks and words."""
    if any(key in group for key in ("lr", "betas", "eps", "weight_decay")):
        HParams.check(
            group.get("lr", defaults["lr"]),
            group.get("betas", defaults["betas"]),
            group.get("eps", defaults["eps"]),
            group.get("weight_decay", defaults["weight_decay"]),
        )


def normalize_group(group: dict) -> None:
    """Tensor betas (torch accepts 1-element ones) as floats, in place: the step's tables hold floats."""
    if "betas" in group:
        group["betas"] = HParams.float_betas(group["betas"])


# what a group pickled by an older FusedAdamW (or torch's AdamW) may lack
PICKLE_DEFAULTS = {"amsgrad": False, "maximize": False, "decoupled_weight_decay": True}
