"""Muon as a matrix rule: what the fused step (fused_stable/matrix_step.py) calls for a group whose rule needs whole
params. The interface every matrix rule's matrix.py offers:

  check_group(group, precision)  refuse what the rule cannot step (ValueError, one line), before the group is added
  init_state(p, group)           the param's rule states, created at its first step (`step` is the machinery's)
  state_bytes(p, group)          the bytes those states take (or will take), as opt.state holds them
  build(params, states, groups, compiled_ops)
                                 the update of those params: `.step(grads, grad_mul, skip, lr_factor)`, the step's
                                 decisions as 0-dim device tensors (the clip multiplier before the momentum, the
                                 skip flag, the schedule's factor), none of them read on the host but on the CPU
  COMPILED_STEP                  (optional) True: the update runs inside torch.compile's step (compiled.py)
                                 (`compiled_ops`: whether the backend runs the compiled CPU ops, where a rule's
                                 own op, rules/<rule>/cpu_matrix.cpp, built into their library, may step it:
                                 Adafactor's; Muon has none, its update is torch's matmuls)
"""

from __future__ import annotations

import torch

from ... import state_format
from ...sharding import is_dtensor
from . import DEFAULTS, check_muon_group
from .experts import ExpertStacks, muon_update
from .lowbit import KEY, CodedMomentum, is_coded
from .torch import MuonSide

# DTensor params sharded by rows (FSDP2's Shard(0)) step too: Newton-Schulz at each matrix's owner rank
# (fused_stable/matrix_exchange.py), the momentum buffers sharded like their params
ROW_SHARDS = True

# the compiled step (compiled.py) runs this rule's update inside its custom op, after the fused step
COMPILED_STEP = True

# a Muon group's state_precision -> its momentum buffers' dtype (None: the param's, as torch.optim.Muon's); bf16
# rounds to nearest (momentum 0.95 moves a buffer 5% of g - buf a step, over half a bf16 ulp unless g is within 8%);
# "8bit": AdamW exp_avg's Q8 codes and block scales (lowbit.py), fp32 below state_format.MIN_QUANTISED_NUMEL
MOMENTUM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "8bit": torch.float32}


def check_group(group: dict, precision: str) -> None:
    """torch.optim.Muon's checks (missing keys set to its defaults, in place), the momentum's precision, and the
    params a Muon group can hold here."""
    for key, default in DEFAULTS.items():
        group.setdefault(key, default)
    check_muon_group(group)
    if precision not in MOMENTUM_DTYPES:
        raise ValueError(
            f"a Muon group's momentum buffers are kept in fp32 (the param's dtype, as torch's), bf16 or 8bit, not "
            f"{precision!r}: give the Muon group state_precision='fp32', 'bf16' or '8bit'"
        )
    sharded = [p for p in group["params"] if is_dtensor(p)]
    if any(p.ndim == 3 for p in sharded):
        # the exchange brings a matrix's rows to its owner; FSDP2's Shard(0) of a stack cuts its experts instead
        raise ValueError(
            "a Muon group's 3-D expert stacks are stepped per expert, and under FSDP2 a stack's Shard(0) splits its "
            "experts between ranks (not built yet): give the experts use_muon=False (muon_param_groups(..., "
            "expert_stacks=False)) under FSDP2"
        )
    if precision == "8bit" and sharded:
        # the codes' blocks run over a whole matrix's elements, and a row shard holds a slice of them
        raise ValueError(
            "a Muon group's 8-bit momentum is coded in blocks over each whole matrix, and under FSDP2 a param holds "
            "a shard of its rows: give the Muon group state_precision='bf16' or 'fp32' under FSDP2"
        )


def _coded(p: torch.Tensor, group: dict) -> bool:
    return state_format.format_for(group["state_precision"], p.numel()) == state_format.Q8


def _buffer_dtype(p: torch.Tensor, group: dict) -> torch.dtype:
    return MOMENTUM_DTYPES[group["state_precision"]] or p.dtype


def init_state(p: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
    """torch's zero momentum buffer, shaped like the param (its dtype, or bf16 when the group asks for it), or its
    8-bit codes and block scales (zero codes with zero scales decode to exactly zero)."""
    if _coded(p, group):
        return state_format.zero_moment(p, KEY, state_format.Q8)
    return {KEY: torch.zeros_like(p, dtype=_buffer_dtype(p, group), memory_format=torch.preserve_format)}


def state_bytes(p: torch.Tensor, group: dict) -> int:
    if _coded(p, group):
        return state_format.planned_bytes(p.numel(), "8bit", states=1)
    return p.numel() * _buffer_dtype(p, group).itemsize


def build(
    params: list[torch.Tensor], states: list[dict], groups: list[dict], compiled_ops: bool = False
) -> MuonSide | ExpertStacks | CodedMomentum:
    """The update of `params` (a group's each, `groups[i]` with its base lr: the schedule's factor comes from the
    decisions), batched once by group, dtype and shape; a 3-D param (a stack of experts' matrices) is stepped as
    its experts' 2-D views (experts.py); 8-bit buffers decoded and encoded around it (lowbit.py)."""
    groups = [{**group, "lr": _host_lr(group["lr"])} for group in groups]
    if any(is_coded(state) for state in states):
        return CodedMomentum(params, states, groups)
    return muon_update(params, [state[KEY] for state in states], groups)


def _host_lr(lr):
    """A Muon group's lr as a number. A Muon group refuses tensor lrs when it is added (check_group), but
    torch.distributed.checkpoint's `set_optimizer_state_dict` (FSDP2's resume) makes the states with one step at
    `lr = torch.tensor(0.0)` and then puts the group's own lr back (the next step builds the update again): a 0-dim
    CPU tensor is host memory, read at no cost. Any other tensor is left to MuonHparams' check, which refuses it."""
    return float(lr) if torch.is_tensor(lr) and lr.device.type == "cpu" and lr.dim() == 0 else lr
