"""The guard's settings (`GuardConfig`): thresholds, the policy, the rollback's lr cuts and budget, each checked.

Apart from guard.py so that the settings, which the trainer's keys and the stress suite fill, read on their own;
guard.py re-exports them (`from fused_stable.guard import GuardConfig` keeps working).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

POLICIES = ("warn", "skip", "stop", "rollback")


@dataclass
class GuardConfig:
    policy: str = "warn"
    grad_z: float = 6.0  # alert when the grad norm's z-score exceeds this...
    grad_ratio: float = 5.0  # ...and the norm is at least this many times its running mean (0: z alone)
    skip_z: float = 6.0  # under skip / rollback the optimizer skips steps whose z-score exceeds this...
    skip_ratio: float = 5.0  # ...and whose norm is at least this many times its running mean (0: z alone)
    loss_z: float = 6.0  # alert when the loss's z-score exceeds this
    loss_alpha: float = 0.97  # EMA decay of the loss statistics
    loss_warmup: int = 20  # steps of loss collected before loss z-scores count
    loss_rel_floor: float = (
        0.01  # the loss std is floored at this fraction of the mean (a flat loss is not a hair trigger)
    )
    loss_rise: float = 1.5  # alert when a logging interval's median loss exceeds this x the best one so far (0: off)
    # alert when an evaluation's eval_loss or retention_loss exceeds this x its best so far (0: off); chosen
    # from the clean runs' own noise (docs/guard.md: their worst rise over the best so far was 1.13x on the tiny
    # model, 1.06x on SmolLM2-135M)
    eval_rise: float = 1.3
    nonfinite_storm: int = 3  # non-finite-gradient steps within one logging interval that escalate to the policy
    lr_factor: float = 0.5  # rollback multiplies every group's lr by this
    # ...or by this when an evaluation's rise asked for it: the probes see damage the loss does not show, late
    # (a check later), so one halving per rollback spent the budget on SmolLM2 at 30x (docs/guard.md)
    eval_lr_factor: float = 0.25
    max_rollbacks: int = 3  # give up (stop) when one more rollback would exceed this
    top_k: int = 5  # tensors with the largest grad norm named in each alert

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"guard policy must be one of {' | '.join(POLICIES)}, got {self.policy!r}")
        for name in ("grad_z", "loss_z", "skip_z"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"guard {name} must be a positive number, got {value}")
        if not 0.0 < self.loss_alpha < 1.0:
            raise ValueError(f"guard loss_alpha must be in (0, 1), got {self.loss_alpha}")
        if self.loss_warmup < 1:
            raise ValueError(f"guard loss_warmup must be >= 1, got {self.loss_warmup}")
        for name in ("grad_ratio", "skip_ratio"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"guard {name} must be a finite number >= 0 (0: the z-score alone), got {value}")
        for name in ("loss_rise", "eval_rise"):
            value = getattr(self, name)
            if value and not (value > 1.0 and math.isfinite(value)):
                raise ValueError(f"guard {name} must be > 1 (or 0 to disable), got {value}")
        if self.loss_rel_floor < 0:
            raise ValueError(f"guard loss_rel_floor must be >= 0, got {self.loss_rel_floor}")
        if self.nonfinite_storm < 1:
            raise ValueError(f"guard nonfinite_storm must be >= 1, got {self.nonfinite_storm}")
        for name in ("lr_factor", "eval_lr_factor"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"guard {name} must be in (0, 1], got {getattr(self, name)}")
        if self.max_rollbacks < 0:
            raise ValueError(f"guard max_rollbacks must be >= 0, got {self.max_rollbacks}")
        if self.top_k < 0:
            raise ValueError(f"guard top_k must be >= 0, got {self.top_k}")

    def optimizer_kwargs(self, zscore_threshold: float = 2.5) -> dict:
        """What FusedAdamW needs for this policy: under `skip` and `rollback` the optimizer itself skips the
        spikes on the device (a rollback is then kept for what got through)."""
        if self.policy in ("skip", "rollback"):
            return {"spike_skip_threshold": max(self.skip_z, zscore_threshold), "spike_skip_ratio": self.skip_ratio}
        return {}
