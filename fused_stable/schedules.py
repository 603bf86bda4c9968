"""Learning-rate schedules evaluated on the device, from the count of applied (non-skipped) updates.

`FusedAdamW(..., lr_schedule=warmup_cosine(1000, 100))` multiplies every group's base lr by the schedule's
factor inside the fused step, so a skipped step (non-finite grads, a spike) does not advance the schedule
and nothing is read back to the host. The factor for the n-th applied update (n = 0, 1, ...) equals the
lambda of transformers' get_cosine_schedule_with_warmup / get_linear_schedule_with_warmup /
get_constant_schedule_with_warmup at n, with two deliberate differences: `min_lr_ratio` lifts the floor
(as transformers' get_cosine_with_min_lr_schedule_with_warmup does), and past `total_steps` the factor
stays at its final value instead of rising again along the cosine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# the kinds, as the decision kernel and the torch backend switch on them (fused_stable.layout re-exports them)
SCHEDULE_NONE = 0
SCHEDULE_CONSTANT = 1
SCHEDULE_LINEAR = 2
SCHEDULE_COSINE = 3


@dataclass(frozen=True)
class Schedule:
    kind: int
    total_steps: int
    warmup_steps: int
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.kind != SCHEDULE_CONSTANT and self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def factor(self, applied_steps: int) -> float:
        """Plain-Python reference of the factor for the update that follows `applied_steps` applied ones."""
        n = float(applied_steps)
        if n < self.warmup_steps:
            return n / max(1.0, float(self.warmup_steps))
        return self._decay(n)

    def _decay(self, n: float) -> float:
        if self.kind == SCHEDULE_CONSTANT:
            return 1.0
        span = max(1.0, float(self.total_steps - self.warmup_steps))
        if self.kind == SCHEDULE_LINEAR:
            shape = max(0.0, (self.total_steps - n) / span)
        else:
            progress = min(1.0, max(0.0, (n - self.warmup_steps) / span))
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape

    def factor_tensor(self, applied_steps: torch.Tensor) -> torch.Tensor:
        """The same factor from a 0-dim integer device tensor, with tensor ops only (no host read)."""
        n = applied_steps.to(torch.float32)
        warm = n / max(1.0, float(self.warmup_steps))
        if self.kind == SCHEDULE_CONSTANT:
            decay = torch.ones_like(n)
        else:
            span = max(1.0, float(self.total_steps - self.warmup_steps))
            if self.kind == SCHEDULE_LINEAR:
                shape = ((self.total_steps - n) / span).clamp(min=0.0)
            else:
                progress = ((n - self.warmup_steps) / span).clamp(0.0, 1.0)
                shape = 0.5 * (1.0 + torch.cos(math.pi * progress))
            decay = self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape
        return torch.where(n < self.warmup_steps, warm, decay)


def warmup_cosine(total_steps: int, warmup_steps: int, min_lr_ratio: float = 0.0) -> Schedule:
    """Linear warm-up from 0 over `warmup_steps`, then half a cosine down to `min_lr_ratio` at `total_steps`."""
    return Schedule(SCHEDULE_COSINE, int(total_steps), int(warmup_steps), float(min_lr_ratio))


def warmup_linear(total_steps: int, warmup_steps: int, min_lr_ratio: float = 0.0) -> Schedule:
    """Linear warm-up from 0 over `warmup_steps`, then linear decay to `min_lr_ratio` at `total_steps`."""
    return Schedule(SCHEDULE_LINEAR, int(total_steps), int(warmup_steps), float(min_lr_ratio))


def constant(warmup_steps: int = 0) -> Schedule:
    """Linear warm-up from 0 over `warmup_steps`, then the base lr."""
    return Schedule(SCHEDULE_CONSTANT, 0, int(warmup_steps), 0.0)
