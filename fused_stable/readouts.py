"""FusedAdamW's read-outs: what the fused step decided and counted, as 0-dim views of the optimizer's device buffers.

Every property below is a view (or a tiny op) over the buffers laid out in layout.py, updated in place on the
device by every step, so reading one costs nothing until its value is asked for on the host (`.item()`, a
print). A mixin of its own because they are a reference list, one slot each, not logic: optim.py then reads as
the step. It reads the host class's `_fstate`, `_istate`, `_worst_sumsq`, `last_tables`, `_param_names`,
`param_groups` and `device` (optim.FusedAdamW sets them all in its constructor).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import layout


class ReadOuts:
    """The device-side read-outs of FusedAdamW (see the module doc)."""

    @property
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the last step's gradients, before clipping (inf/nan if they were not finite)."""
        return self._fstate[layout.F_GRAD_NORM]

    @property
    def skipped_steps(self) -> torch.Tensor:
        """Steps skipped so far because the gradients were not finite."""
        return self._istate[layout.I_SKIPPED_STEPS]

    @property
    def spike_skips(self) -> torch.Tensor:
        """Steps skipped so far because the norm's z-score exceeded spike_skip_threshold."""
        return self._istate[layout.I_SPIKE_SKIPS]

    @property
    def applied_steps(self) -> torch.Tensor:
        """Updates applied so far (what the lr schedule counts)."""
        return self._istate[layout.I_APPLIED_STEPS]

    @property
    def last_step_skipped(self) -> torch.Tensor:
        """Whether the last step was skipped (non-finite grads or a spike), as a 0-dim bool device tensor."""
        return self._istate[layout.I_LAST_STEP_SKIPPED] != 0

    @property
    def last_step_found_inf(self) -> torch.Tensor:
        """1.0 if the last step's gradients were not finite, else 0.0 (what a GradScaler backs off on)."""
        return self._fstate[layout.F_FOUND_INF]

    @property
    def last_lr(self) -> torch.Tensor:
        """Param group 0's effective lr in the last step (schedule applied)."""
        return self._fstate[layout.F_LAST_LR]

    @property
    def grad_norm_mean(self) -> torch.Tensor:
        return self._fstate[layout.F_NORM_MEAN]

    @property
    def grad_norm_std(self) -> torch.Tensor:
        return self._fstate[layout.F_NORM_VAR].clamp(min=0.0).sqrt()

    @property
    def last_zscore(self) -> torch.Tensor:
        return self._fstate[layout.F_LAST_ZSCORE]

    @property
    def spike_count(self) -> torch.Tensor:
        """Steps so far whose norm's z-score exceeded zscore_threshold (after the statistics' warm-up)."""
        return self._istate[layout.I_SPIKE_COUNT]

    @property
    def last_spike_step(self) -> torch.Tensor:
        """Applied-step index of the latest spike, -1 if none."""
        return self._istate[layout.I_LAST_SPIKE_STEP]

    @property
    def last_spike_norm(self) -> torch.Tensor:
        return self._fstate[layout.F_LAST_SPIKE_NORM]

    @property
    def max_zscore(self) -> torch.Tensor:
        """Largest grad-norm z-score since reset_max_zscore() (-inf if none): lets a guard that polls only at
        logging steps see a spike that happened between two polls."""
        return self._fstate[layout.F_MAX_ZSCORE]

    @property
    def max_zscore_norm(self) -> torch.Tensor:
        """The grad norm of the step with the largest z-score since reset_max_zscore()."""
        return self._fstate[layout.F_MAX_ZSCORE_NORM]

    @property
    def max_zscore_step(self) -> torch.Tensor:
        """Applied-step index of the step with the largest z-score since reset_max_zscore() (-1 if none)."""
        return self._istate[layout.I_MAX_ZSCORE_STEP]

    @property
    def worst_step(self) -> torch.Tensor:
        """Index, among all steps taken (applied or skipped, from 0), of the worst step since reset_max_zscore():
        the largest z-score, or the first step with non-finite gradients; -1 if none. `skipped_steps +
        spike_skips + applied_steps` is the count of steps taken, so the latest step's index is that count - 1."""
        return self._istate[layout.I_WORST_STEP]

    @property
    def worst_step_norm(self) -> torch.Tensor:
        """The global grad norm of the worst step since reset_max_zscore() (inf/nan for a non-finite step)."""
        return self._fstate[layout.F_WORST_NORM]

    @property
    def worst_step_zscore(self) -> torch.Tensor:
        """The worst step's z-score (0 during the statistics' warm-up, inf for a non-finite step; -inf if none)."""
        return self._fstate[layout.F_WORST_KEY]

    def worst_step_grad_norms(self) -> torch.Tensor:
        """Per-parameter gradient norms of the worst step since reset_max_zscore(), in param_groups order (0 for
        a param without a grad then). The decision kernel copies them when a step becomes the worst: reading them
        costs no per-step work."""
        return self._worst_sumsq.sqrt()

    def reset_max_zscore(self) -> None:
        """Starts a new polling window for max_zscore and the worst step (device writes only, no sync)."""
        self._fstate[layout.F_MAX_ZSCORE] = float("-inf")
        self._fstate[layout.F_MAX_ZSCORE_NORM] = 0.0
        self._istate[layout.I_MAX_ZSCORE_STEP] = -1
        self._reset_worst_step()

    def _reset_worst_step(self) -> None:
        self._fstate[layout.F_WORST_KEY] = float("-inf")
        self._fstate[layout.F_WORST_NORM] = 0.0
        self._istate[layout.I_WORST_STEP] = -1
        self._worst_sumsq.zero_()

    @property
    def param_names(self) -> list[str] | None:
        """Names for the parameters in param_groups order (e.g. from model.named_parameters()), for tools that
        report which tensor's gradient exploded: as set, else the groups' own (params given as (name, param)
        pairs), else None."""
        if self._param_names is None and all("param_names" in group for group in self.param_groups):
            return [name for group in self.param_groups for name in group["param_names"]]
        return self._param_names

    @param_names.setter
    def param_names(self, names: Iterable[str] | None) -> None:
        if names is None:
            self._param_names = None
            return
        names = [str(n) for n in names]
        count = sum(len(group["params"]) for group in self.param_groups)
        if len(names) != count:
            raise ValueError(f"param_names has {len(names)} names but the optimizer has {count} parameters")
        self._param_names = names

    def reset_grad_norm_stats(self) -> None:
        """Forget the running grad-norm statistics and warm them up again from the next step (device writes
        only). For a deliberate change of regime (a new data mix, a rollback to an earlier state), after which
        the old statistics would flag every step as a spike."""
        for index in (layout.F_NORM_MEAN, layout.F_NORM_VAR, layout.F_WARMUP_SUM, layout.F_WARMUP_SUMSQ):
            self._fstate[index] = 0.0
        self._istate[layout.I_STATS_COUNT] = 0

    def per_tensor_grad_norms(self) -> torch.Tensor:
        """L2 norm of each parameter's gradient in the last step, in param_groups order (0 where no grad).

        A by-product of the norm pass: no further pass over the gradients.
        """
        params = [p for group in self.param_groups for p in group["params"]]
        norms = torch.zeros(len(params), dtype=torch.float32, device=self.device)
        tables = self.last_tables
        if tables is not None and tables.per_tensor_sumsq is not None and tables.positions.numel() <= len(params):
            norms.index_copy_(0, tables.positions, tables.per_tensor_sumsq.sqrt())
        return norms
