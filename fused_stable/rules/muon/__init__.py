"""Muon, the rule: torch.optim.Muon's defaults and state name, its lr adjustment, and the check of a Muon group.

A Muon group (`use_muon=True`) holds 2-D matrices only. Its update is torch.optim.Muon's (torch 2.13): momentum
`buf.lerp_(g, 1 - momentum)`, the Nesterov direction `g.lerp(buf, momentum)` (or `buf`), Newton-Schulz
orthogonalisation in bf16, decoupled weight decay `p *= 1 - lr * weight_decay`, then `p -= adjusted_lr * O`.
The pieces beside this file:

  newton_schulz.py  `orthogonalize` and `ShapeBatches`: the Newton-Schulz iteration batched over matrices of one shape
  torch.py          `MuonSide`: the Muon groups' share of a fused step on torch tensors, decisions as device tensors
  param_groups.py   `muon_param_groups`: a model split into a Muon group and an AdamW group

A conv weight (4-D) is refused rather than flattened: torch.optim.Muon refuses it too (the parity oracle), and
the flattening (out, in*kh*kw) is a modelling choice whose lr adjustment differs between recipes (Keller Jordan
flattens then adjusts by the flat shape; Moonlight adjusts by shape[:2]). Flatten it yourself or give it to AdamW.

Importing this package imports neither triton nor torch.optim (the defaults are written here; a test reads
torch's signature and checks they agree).
"""

from __future__ import annotations

import math
import numbers

NAME = "muon"
# not a rule of the update kernel (RULES): Newton-Schulz needs whole matrices, so FusedMuon runs MuonSide after the
# fused step, on its decisions (fused_stable/muon.py)
ELEMENTWISE = False

STATE_NAMES = ("momentum_buffer",)  # torch.optim.Muon's state key, one buffer per matrix, the param's shape
TORCH_STATE_KEYS = STATE_NAMES

# torch.optim.Muon's defaults (torch 2.13; Keller Jordan's constants)
LR = 1e-3
WEIGHT_DECAY = 0.1
MOMENTUM = 0.95
NESTEROV = True
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
EPS = 1e-7
NS_STEPS = 5
ADJUST_LR_FN = None
DEFAULTS = {
    "lr": LR,
    "weight_decay": WEIGHT_DECAY,
    "momentum": MOMENTUM,
    "nesterov": NESTEROV,
    "ns_coefficients": NS_COEFFICIENTS,
    "eps": EPS,
    "ns_steps": NS_STEPS,
    "adjust_lr_fn": ADJUST_LR_FN,
}
ADJUST_LR_FNS = ("original", "match_rms_adamw")  # and None, which is "original"
MAX_NS_STEPS = 99  # torch refuses 100 or more "for computational efficiency"


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    """torch.optim.Muon's `_adjust_lr`: the lr that scales the orthogonalised update of a matrix of `shape`.

    None or "original" (Keller Jordan): lr * sqrt(max(1, A / B)); "match_rms_adamw" (Moonlight, "Muon is
    Scalable for LLM Training"): lr * 0.2 * sqrt(max(A, B)), so the update's RMS matches AdamW's."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        # torch's function silently uses 1.0 here (its constructor refuses the name first): refuse it here too
        raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', not {adjust_lr_fn!r}")
    return lr * ratio


def _check_number(group: dict, key: str, minimum: float = 0.0) -> None:
    value = group.get(key, DEFAULTS[key])
    # a tensor lr would need a host read to build the step's scalars: Muon groups take plain numbers
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Muon group: {key} must be a real number, not {type(value).__name__} {value!r}")
    if not value >= minimum:  # `not >=` refuses NaN too
        raise ValueError(f"Muon group: {key} must be >= {minimum}, got {value}")


def _check_params(params) -> None:
    for index, p in enumerate(params):
        if p.ndim == 4:
            raise ValueError(
                f"Muon group: param {index} is 4-D {tuple(p.shape)} (a conv weight): Muon takes 2-D matrices only. "
                "Reshape it to 2-D yourself (e.g. a parameter of shape (out, in * kh * kw)) or put it in an AdamW "
                "group (use_muon=False)"
            )
        if p.ndim != 2:
            raise ValueError(
                f"Muon group: param {index} has shape {tuple(p.shape)}: Muon takes 2-D matrices only; biases, "
                "norms and other non-2-D params belong in an AdamW group (use_muon=False)"
            )
        if p.is_complex() or not p.is_floating_point():
            raise ValueError(f"Muon group: param {index} has dtype {p.dtype}: Muon takes real floating point params")


def check_muon_group(group: dict) -> None:
    """Refuse a Muon group's bad keywords with a ValueError, as torch.optim.Muon's constructor does (and a little
    more: ns_steps and ns_coefficients here, not at the first step). A missing key takes torch's default."""
    for key in ("lr", "weight_decay", "momentum", "eps"):
        _check_number(group, key)
    if not isinstance(group.get("nesterov", NESTEROV), bool):
        raise ValueError(f"Muon group: nesterov must be True or False, not {group['nesterov']!r}")
    ns_steps = group.get("ns_steps", NS_STEPS)
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 < ns_steps <= MAX_NS_STEPS:
        raise ValueError(f"Muon group: ns_steps must be an int from 1 to {MAX_NS_STEPS}, got {ns_steps!r}")
    coefficients = group.get("ns_coefficients", NS_COEFFICIENTS)
    if (
        not isinstance(coefficients, (tuple, list))
        or len(coefficients) != 3
        or not all(isinstance(c, numbers.Real) and math.isfinite(c) for c in coefficients)
    ):
        raise ValueError(f"Muon group: ns_coefficients must be 3 finite numbers (a, b, c), got {coefficients!r}")
    adjust_lr_fn = group.get("adjust_lr_fn", ADJUST_LR_FN)
    if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"Muon group: adjust_lr_fn must be None, 'original' or 'match_rms_adamw': {adjust_lr_fn!r}")
    _check_params(group.get("params", []))
