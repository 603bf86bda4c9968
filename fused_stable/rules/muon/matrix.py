"""Muon as a matrix rule: what the fused step (fused_stable/matrix_step.py) calls for a group whose rule needs whole
params. The interface every matrix rule's matrix.py offers:

  check_group(group, precision)  refuse what the rule cannot step (ValueError, one line), before the group is added
  init_state(p, group)           the param's rule states, created at its first step (`step` is the machinery's)
  state_bytes(p, group)          the bytes those states take (or will take), as opt.state holds them
  build(params, states, groups)  the update of those params: `.step(grads, grad_mul, skip, lr_factor)`, the step's
                                 decisions as 0-dim device tensors (the clip multiplier before the momentum, the
                                 skip flag, the schedule's factor), none of them read on the host but on the CPU
"""

from __future__ import annotations

import torch

from . import DEFAULTS, check_muon_group
from .torch import MuonSide

# a Muon group's state_precision -> its momentum buffers' dtype (None: the param's, as torch.optim.Muon's); bf16
# rounds to nearest (momentum 0.95 moves a buffer 5% of g - buf a step, over half a bf16 ulp unless g is within 8%)
MOMENTUM_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def check_group(group: dict, precision: str) -> None:
    """torch.optim.Muon's checks (missing keys set to its defaults, in place), the momentum's precision, and the
    params a Muon group can hold here."""
    for key, default in DEFAULTS.items():
        group.setdefault(key, default)
    check_muon_group(group)
    if precision not in MOMENTUM_DTYPES:
        raise ValueError(
            f"a Muon group's momentum buffers are kept in fp32 (the param's dtype, as torch's) or bf16, not "
            f"{precision!r} (8-bit Muon momentum is not built yet): give the Muon group state_precision='bf16' "
            "or 'fp32' (the AdamW groups keep theirs)"
        )


def _buffer_dtype(p: torch.Tensor, group: dict) -> torch.dtype:
    return MOMENTUM_DTYPES[group["state_precision"]] or p.dtype


def init_state(p: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
    """torch's zero momentum buffer, shaped like the param (its dtype, or bf16 when the group asks for it)."""
    return {"momentum_buffer": torch.zeros_like(p, dtype=_buffer_dtype(p, group), memory_format=torch.preserve_format)}


def state_bytes(p: torch.Tensor, group: dict) -> int:
    return p.numel() * _buffer_dtype(p, group).itemsize


def build(params: list[torch.Tensor], states: list[dict], groups: list[dict]) -> MuonSide | ExpertStacks:
    """The update of `params` (a group's each, `groups[i]` with its base lr: the schedule's factor comes from the
    decisions), batched once by group, dtype and shape; a 3-D param (a stack of experts' matrices) is stepped as
    its experts' 2-D views (`ExpertStacks`)."""
    buffers = [state["momentum_buffer"] for state in states]
    if all(p.ndim == 2 for p in params):
        return MuonSide(params, buffers, groups)
    counts = [p.shape[0] if p.ndim == 3 else 1 for p in params]
    matrices = MuonSide(
        _matrices([p.detach() for p in params]),
        _matrices(buffers),
        [group for group, count in zip(groups, counts) for _ in range(count)],
    )
    return ExpertStacks(matrices)


def _matrices(tensors) -> list[torch.Tensor]:
    """Each 2-D tensor, and each 3-D one as its matrices: views (`unbind(0)`), so in-place updates land in it."""
    return [m for t in tensors for m in (t.unbind(0) if t is not None and t.ndim == 3 else (t,))]


class ExpertStacks:
    """The update of Muon params some of which are 3-D stacks of matrices (transformers 5's MoE experts: experts x
    out x in): a MuonSide over every matrix as a 2-D view of its param and momentum buffer, given the grads' views
    each step. Each expert is then exactly torch.optim.Muon's 2-D param: its own Newton-Schulz, its lr adjusted by
    its out x in, batched with the other matrices of its shape."""

    def __init__(self, matrices: MuonSide) -> None:
        self.matrices = matrices

    def step(self, grads, grad_mul: torch.Tensor, skip: torch.Tensor, lr_factor: torch.Tensor) -> None:
        self.matrices.step(_matrices(grads), grad_mul, skip, lr_factor)
