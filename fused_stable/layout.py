"""What one fused step decides and takes, and where each per-step scalar lives in the optimizer's device buffers.

The decision kernel (kernels/decide.py), the update kernel (kernels/update.py), the torch backend
(backends/torch/torch_backend.py) and the optimizer's read-outs (readouts.py) all use the names below, so the layout and
the step's policy (`StepPolicy`: clip, skip, statistics, schedule, which checks itself) are written exactly once
(each update rule's hyper-parameters are its declaration's: fused_stable/rules).
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass
from typing import Any

import torch

# learning-rate schedule kinds: defined beside the schedules (fused_stable.schedules), which StepPolicy checks
from .schedules import SCHEDULE_CONSTANT as SCHEDULE_CONSTANT
from .schedules import SCHEDULE_COSINE as SCHEDULE_COSINE
from .schedules import SCHEDULE_LINEAR as SCHEDULE_LINEAR
from .schedules import SCHEDULE_NONE as SCHEDULE_NONE
from .schedules import Schedule

# float32 buffer
F_GRAD_NORM = 0  # global L2 norm of this step's (unscaled) grads, before clipping
F_GRAD_MUL = 1  # factor every grad is multiplied by in the update: clip coefficient / loss scale
F_SKIP = 2  # 1.0 when this step is skipped (non-finite grads or a spike), else 0.0
F_FOUND_INF = 3  # 1.0 when this step's grads were non-finite (what a GradScaler must back off on)
F_LR_FACTOR = 4  # schedule factor applied to every group's lr this step
F_LAST_LR = 5  # group 0's effective lr this step
F_NORM_MEAN = 6  # running (EMA) mean of the grad norm
F_NORM_VAR = 7  # running (EMA) variance of the grad norm
F_LAST_ZSCORE = 8  # z-score of this step's norm against the running statistics (0 during warm-up)
F_LAST_SPIKE_NORM = 9  # grad norm of the latest spike
F_WARMUP_SUM = 10  # sum of norms seen during the statistics warm-up
F_WARMUP_SUMSQ = 11  # sum of squared norms seen during the statistics warm-up
F_MAX_ZSCORE = 12  # largest z-score since the window was last reset (-inf when reset): what a guard polls
F_MAX_ZSCORE_NORM = 13  # the grad norm at that z-score
# the worst step since the window was last reset (what a guard names at its next check): the step whose key, its
# z-score or +inf when its grads were non-finite, is the largest; -inf when reset. The per-tensor sums of squares of
# that step are copied into StepBuffers.worst_sumsq by the same decision
F_WORST_KEY = 14
F_WORST_NORM = 15  # the grad norm of that step
F_SIZE = 16

# int64 buffer
I_APPLIED_STEPS = 0  # optimizer updates actually applied (drives the lr schedule)
I_SKIPPED_STEPS = 1  # steps skipped because the grads were non-finite
I_SPIKE_SKIPS = 2  # steps skipped because the norm's z-score exceeded spike_skip_threshold
I_SPIKE_COUNT = 3  # steps whose norm's z-score exceeded zscore_threshold (after warm-up)
I_LAST_SPIKE_STEP = 4  # applied-step index at the latest spike, -1 if none
I_LAST_STEP_SKIPPED = 5  # 1 if the latest step was skipped (either reason)
I_STATS_COUNT = 6  # finite norms folded into the running statistics
I_MAX_ZSCORE_STEP = 7  # applied-step index at that z-score
I_WORST_STEP = 8  # the worst step's index among all steps taken (applied or skipped, from 0), -1 when reset
I_SIZE = 9

# hyper-parameter table, one float32 row per param group: the step's slots here, then the rule's from FIRST_RULE_SLOT
# (each rule's declaration names its slots: fused_stable/rules; rules.H_SIZE is the table's width, from every rule)
H_LR = 0  # the group's lr (the base lr with a schedule), which the schedule's factor multiplies
# written by the step, not read by it: with an lr schedule, the lr the next step will use (base lr x the schedule's
# factor), which param_groups[g]["lr"] shows as a 0-dim view
H_SHOWN_LR = 1
FIRST_RULE_SLOT = 2

# clip modes, and their names as FusedAdamW(clip=...) takes them
CLIP_FIXED = 0
CLIP_ZSCORE = 1
CLIP_MODES = {"fixed": CLIP_FIXED, "zscore": CLIP_ZSCORE}

# absolute floor added to the running std before dividing (ZClip's eps)
ZSCORE_STD_EPS = 1e-6
# torch.nn.utils.clip_grad_norm_'s epsilon in max_norm / (norm + eps)
CLIP_EPS = 1e-6


@dataclass(frozen=True)
class StepPolicy:
    """The per-optimizer settings of the device-side decisions (clip, skip, statistics, schedule).

    Checks itself: a bad setting raises the error FusedAdamW's constructor documents, before anything is built.
    `clip` takes the mode by its name ("fixed" or "zscore", as FusedAdamW(clip=...) does) and sets `clip_mode`.
    """

    max_grad_norm: float | None = None  # fixed global-norm ceiling; None = no fixed clipping
    clip_mode: int = CLIP_FIXED
    zscore_alpha: float = 0.97  # EMA decay of the running mean / variance of the grad norm
    zscore_threshold: float = 2.5  # z-score above which a norm counts as a spike (and is clipped in zscore mode)
    zscore_warmup: int = 25  # finite norms collected before the statistics (and spike detection) start
    spike_skip_threshold: float | None = None  # z-score above which the step is skipped; None = never
    spike_skip_ratio: float = 0.0  # ...and only if the norm is at least this many times its running mean (0: z alone)
    schedule: Any = None  # a fused_stable.schedules.Schedule, or None for the groups' lr as is
    clip: InitVar[str | None] = None

    def __post_init__(self, clip: str | None) -> None:
        if self.max_grad_norm is not None and not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ValueError(f"max_grad_norm must be a positive finite number or None, got {self.max_grad_norm}")
        if clip is not None and clip not in CLIP_MODES:
            raise ValueError(f"clip must be one of {sorted(CLIP_MODES)}, got {clip!r}")
        if clip is None and self.clip_mode not in CLIP_MODES.values():
            raise ValueError(
                f"clip_mode must be one of {sorted(CLIP_MODES.values())} (layout.CLIP_*), got {self.clip_mode!r}"
            )
        if not 0.0 < self.zscore_alpha < 1.0:
            raise ValueError(f"zscore_alpha must be in (0, 1), got {self.zscore_alpha}")
        if not self.zscore_threshold > 0:
            raise ValueError(f"zscore_threshold must be > 0, got {self.zscore_threshold}")
        if int(self.zscore_warmup) < 1:
            raise ValueError(f"zscore_warmup must be >= 1, got {self.zscore_warmup}")
        if self.spike_skip_threshold is not None and not self.spike_skip_threshold >= self.zscore_threshold:
            raise ValueError(
                f"spike_skip_threshold ({self.spike_skip_threshold}) must be >= zscore_threshold "
                f"({self.zscore_threshold}): a step is skipped only when it is a spike"
            )
        if not (self.spike_skip_ratio >= 0 and math.isfinite(self.spike_skip_ratio)):
            raise ValueError(
                f"spike_skip_ratio must be a finite number >= 0 (0: the z-score alone), got {self.spike_skip_ratio}"
            )
        if self.schedule is not None and not isinstance(self.schedule, Schedule):
            raise TypeError(
                "lr_schedule must come from fused_stable.schedules (warmup_cosine, warmup_linear, constant); "
                "for a torch LR scheduler, pass the optimizer to the scheduler instead"
            )
        # checked as given, kept as the types the kernels' arguments take
        values = {
            "max_grad_norm": _optional_float(self.max_grad_norm),
            "clip_mode": CLIP_MODES[clip] if clip is not None else self.clip_mode,
            "zscore_alpha": float(self.zscore_alpha),
            "zscore_threshold": float(self.zscore_threshold),
            "zscore_warmup": int(self.zscore_warmup),
            "spike_skip_threshold": _optional_float(self.spike_skip_threshold),
            "spike_skip_ratio": float(self.spike_skip_ratio),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)


# the name pickles made before 2026-12-06 give StepPolicy (it was StepRules, a name that said "rules" of the update)
StepRules = StepPolicy


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def lr_row(lr, size: int = FIRST_RULE_SLOT) -> list[float]:
    """The row of a group the update pass leaves alone (a matrix rule's: its lr, which the step's shown-lr slot and
    read-outs use), `size` wide (a tensor lr is copied in on the device)."""
    row = [0.0] * size
    row[H_LR] = 0.0 if isinstance(lr, torch.Tensor) else float(lr)
    return row


def check_not_differentiable(differentiable, where: str) -> None:
    """differentiable=True is refused wherever it can come from (constructor, a param group, a state dict)."""
    if differentiable:
        raise ValueError(
            f"{where}: FusedAdamW's fused step cannot be differentiated through (autograd does not see inside "
            "its kernels); use torch.optim.AdamW(differentiable=True) for that, or differentiable=False"
        )


def new_counters(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 and int64 buffers above as a fresh optimizer's: zeros, and no spike yet (-1)."""
    fstate = torch.zeros(F_SIZE, dtype=torch.float32, device=device)
    istate = torch.zeros(I_SIZE, dtype=torch.int64, device=device)
    istate[I_LAST_SPIKE_STEP] = -1
    return fstate, istate


@dataclass(frozen=True)
class StepBuffers:
    """The optimizer's device buffers that a step reads and writes (laid out as above)."""

    fstate: torch.Tensor  # fp32 [F_SIZE]
    istate: torch.Tensor  # int64 [I_SIZE]
    hparams: torch.Tensor  # fp32 [num_groups, rules.H_SIZE]
    worst_sumsq: torch.Tensor  # fp32 [every param of every group]: per-tensor sums of squares of the worst step


# Every constant above as one string, which each kernel takes as a constexpr argument (`LAYOUT`, never read): the
# kernels' jit helpers take the slots they touch as constexpr defaults, and Triton's cache key holds a kernel's
# constexpr arguments but not its helpers' defaults, so this is what makes a change here recompile the kernels.
KERNEL_LAYOUT = ";".join(
    f"{name}={value!r}" for name, value in sorted(globals().items()) if name.isupper() and type(value) in (int, float)
)
