"""Running statistics of a scalar on the host (the guard's loss): mean, variance and z-score, with the
optimizer's grad-norm rules (a plain mean over a warm-up, EMAs after it, spikes folded in clamped)."""

from __future__ import annotations

import math

_LOSS_STD_EPS = 1e-8


class LossStats:
    """Running mean and variance of the loss, and its z-score: the optimizer's grad-norm rules, on the host.

    The first `warmup` finite values give a plain mean and (population) variance; after that both are EMAs
    with decay `alpha`. A value whose z-score exceeds `threshold` is folded in at mean + threshold * std, so
    one spike does not inflate the statistics it is judged by. Non-finite values are not folded in.
    """

    def __init__(self, alpha: float = 0.97, threshold: float = 6.0, warmup: int = 20, rel_floor: float = 0.01):
        self.alpha, self.threshold, self.warmup, self.rel_floor = alpha, threshold, warmup, rel_floor
        self.count = 0
        self.mean = 0.0
        self.var = 0.0
        self._sum = 0.0
        self._sumsq = 0.0

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))

    def zscore(self, value: float) -> float:
        """z-score of `value` against the statistics so far (0 during warm-up, inf for a non-finite value)."""
        if not math.isfinite(value):
            return math.inf
        if self.count < self.warmup:
            return 0.0
        scale = max(self.std, self.rel_floor * abs(self.mean), _LOSS_STD_EPS)
        return (value - self.mean) / scale

    def update(self, value: float) -> float:
        """Fold one value in; returns its z-score against the statistics before it."""
        z = self.zscore(value)
        if not math.isfinite(value):
            return z
        if z > self.threshold:
            value = self.mean + self.threshold * max(self.std, self.rel_floor * abs(self.mean), _LOSS_STD_EPS)
        if self.count < self.warmup:
            self._sum += value
            self._sumsq += value * value
            n = self.count + 1
            self.mean = self._sum / n
            self.var = max(self._sumsq / n - self.mean**2, 0.0)
        else:
            self.mean = self.alpha * self.mean + (1 - self.alpha) * value
            self.var = self.alpha * self.var + (1 - self.alpha) * (value - self.mean) ** 2
        self.count += 1
        return z

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "var": self.var, "sum": self._sum, "sumsq": self._sumsq}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.var = int(state["count"]), float(state["mean"]), float(state["var"])
        self._sum, self._sumsq = float(state["sum"]), float(state["sumsq"])
