r"""Muon (Keller Jordan's "MomentUm Orthogonalized by Newton-Schulz"), as torch.optim.Muon (torch 2.13) computes it,
for 2-D matrices, one whole matrix at a time (a matrix rule: Newton-Schulz needs the whole param).

With g the grad times the step's multiplier (the clip coefficient and the loss scale), B the momentum buffer:

    B = B + (1 - momentum) * (g - B)                       (momentum_buffer: buf.lerp_(g, 1 - momentum))
    U = g + momentum * (B - g)   with nesterov, else B     (g.lerp(B, momentum))
    O = NewtonSchulz(U)                                    (ns_steps quintic iterations in bf16, on U / ||U||_F,
                                                            transposed when rows > cols; coefficients a, b, c)
    p = p * (1 - lr * weight_decay)                        (decoupled weight decay)
    p = p - adjusted_lr * O                                (adjust_lr_fn: None / "original": lr * sqrt(max(1,
                                                            rows / cols)); "match_rms_adamw": lr * 0.2 * sqrt(max(
                                                            rows, cols)), so the update's RMS matches AdamW's)

Names, defaults and the state key are torch.optim.Muon's (a test reads its signature). The pieces beside this file:

  matrix.py         the matrix rule's interface the fused step calls: states, the update, state bytes, checks
  newton_schulz.py  `orthogonalize` and `ShapeBatches`: the Newton-Schulz iteration batched over matrices of one shape
  torch.py          `MuonSide`: the Muon groups' update on torch tensors, the step's decisions as device tensors
  param_groups.py   `muon_param_groups`: a model split into a Muon group and an AdamW group
  lowbit.py         `CodedMomentum`: 8-bit momentum buffers decoded around MuonSide's step, encoded once

A 3-D param is a stack of matrices (transformers 5's MoE experts: experts x out x in), stepped as its experts'
2-D views: Newton-Schulz, the lr adjustment (by out x in) and the momentum per expert, exactly as torch.optim.Muon
on each expert as its own 2-D param (torch's refuses 3-D params). A conv1d weight is 3-D too but not a stack of
matrices: muon_param_groups gives it to AdamW; a hand-built group must too.
A conv weight (4-D) is refused rather than flattened: torch.optim.Muon refuses it too (the parity oracle), and
the flattening (out, in*kh*kw) is a modelling choice whose lr adjustment differs between recipes (Keller Jordan
flattens then adjusts by the flat shape; Moonlight adjusts by shape[:2]). Flatten it yourself or give it to AdamW.

Importing this package imports neither triton nor torch.
"""

from __future__ import annotations

import math
import numbers

from ..declaration import SIGNED, HParam, Rule, State

# torch.optim.Muon's defaults (torch 2.13; Keller Jordan's constants)
LR = 1e-3
WEIGHT_DECAY = 0.1
MOMENTUM = 0.95
NESTEROV = True
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
EPS = 1e-7
NS_STEPS = 5
ADJUST_LR_FN = None
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
        if p.ndim not in (2, 3):
            raise ValueError(
                f"Muon group: param {index} has shape {tuple(p.shape)}: Muon takes 2-D matrices and 3-D stacks of "
                "them (experts x out x in) only; biases, norms and other params belong in an AdamW group "
                "(use_muon=False)"
            )
        if p.is_complex() or not p.is_floating_point():
            raise ValueError(f"Muon group: param {index} has dtype {p.dtype}: Muon takes real floating point params")


def check_muon_group(group: dict) -> None:
    """Refuse a Muon group's bad keywords with a ValueError, as torch.optim.Muon's constructor does (and a little
    more: ns_steps and ns_coefficients here, not at the first step). A missing key takes torch's default."""
    RULE.check_group(group, DEFAULTS)
    _check_params(group.get("params", []))


def _number(key: str) -> object:
    return lambda value: _check_number({key: value}, key)


def _nesterov(value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"Muon group: nesterov must be True or False, not {value!r}")


def _ns_steps(value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_NS_STEPS:
        raise ValueError(f"Muon group: ns_steps must be an int from 1 to {MAX_NS_STEPS}, got {value!r}")


def _ns_coefficients(value) -> None:
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 3
        or not all(isinstance(c, numbers.Real) and math.isfinite(c) for c in value)
    ):
        raise ValueError(f"Muon group: ns_coefficients must be 3 finite numbers (a, b, c), got {value!r}")


def _adjust_lr_fn(value) -> None:
    if value is not None and value not in ADJUST_LR_FNS:
        raise ValueError(f"Muon group: adjust_lr_fn must be None, 'original' or 'match_rms_adamw': {value!r}")


RULE = Rule(
    name="muon",
    title="Muon",
    package=__name__,
    # torch.optim.Muon's state key, one buffer per matrix, the param's shape (8-bit: lowbit.py, AdamW exp_avg's codec)
    states=(State("momentum_buffer", SIGNED),),
    hparams=(
        HParam("lr", LR, check=_number("lr")),
        HParam("weight_decay", WEIGHT_DECAY, check=_number("weight_decay")),
        HParam("momentum", MOMENTUM, check=_number("momentum")),
        HParam("nesterov", NESTEROV, check=_nesterov),
        HParam("ns_coefficients", NS_COEFFICIENTS, check=_ns_coefficients),
        HParam("eps", EPS, check=_number("eps")),
        HParam("ns_steps", NS_STEPS, check=_ns_steps),
        HParam("adjust_lr_fn", ADJUST_LR_FN, check=_adjust_lr_fn),
    ),
    row=(),  # no slot of the kernels' row: its update runs outside them (matrix.py), from the step's decisions
    row_inputs=(),
    fill_row=lambda: (),
    torch_keeps_step=False,
    elementwise=False,
)
DEFAULTS = {h.name: h.default for h in RULE.hparams}  # a Muon group's keys at torch.optim.Muon's defaults
