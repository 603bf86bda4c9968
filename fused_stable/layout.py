"""What one fused step decides, and where each per-step scalar lives in the optimizer's device buffers.

The decision kernel (kernels/adamw.py), the torch backend (backends/torch_backend.py) and the optimizer's named views
(optim.py) all use the names below, so the layout and the rules are written exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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

# hyper-parameter table, one float32 row per param group
H_LR = 0
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
# written by the step, not read by it: with an lr schedule, the lr the next step will use (base lr x the schedule's
# factor), which param_groups[g]["lr"] shows as a 0-dim view
H_SHOWN_LR = 10
H_SIZE = 11

# learning-rate schedule kinds (fused_stable.schedules)
SCHEDULE_NONE = 0
SCHEDULE_CONSTANT = 1
SCHEDULE_LINEAR = 2
SCHEDULE_COSINE = 3

# clip modes
CLIP_FIXED = 0
CLIP_ZSCORE = 1

# absolute floor added to the running std before dividing (ZClip's eps)
ZSCORE_STD_EPS = 1e-6
# torch.nn.utils.clip_grad_norm_'s epsilon in max_norm / (norm + eps)
CLIP_EPS = 1e-6


@dataclass(frozen=True)
class StepRules:
    """The per-optimizer settings of the device-side decisions (clip, skip, statistics, schedule)."""

    max_grad_norm: float | None = None  # fixed global-norm ceiling; None = no fixed clipping
    clip_mode: int = CLIP_FIXED
    zscore_alpha: float = 0.97  # EMA decay of the running mean / variance of the grad norm
    zscore_threshold: float = 2.5  # z-score above which a norm counts as a spike (and is clipped in zscore mode)
    zscore_warmup: int = 25  # finite norms collected before the statistics (and spike detection) start
    spike_skip_threshold: float | None = None  # z-score above which the step is skipped; None = never
    spike_skip_ratio: float = 0.0  # ...and only if the norm is at least this many times its running mean (0: z alone)
    schedule: Any = None  # a fused_stable.schedules.Schedule, or None for the groups' lr as is


@dataclass(frozen=True)
class StepBuffers:
    """The optimizer's device buffers that a step reads and writes (laid out as above)."""

    fstate: torch.Tensor  # fp32 [F_SIZE]
    istate: torch.Tensor  # int64 [I_SIZE]
    hparams: torch.Tensor  # fp32 [num_groups, H_SIZE]
    worst_sumsq: torch.Tensor  # fp32 [every param of every group]: per-tensor sums of squares of the worst step
