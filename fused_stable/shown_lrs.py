"""The lr that monitors read under an lr schedule: `param_groups[g]["lr"]` as a device view of the scheduled lr,
the groups' base lrs, and setting them. A mixin of FusedOptimizer (optim.py), whose settings and buffers it uses:
`policy`, `step_buffers`, `param_groups`, `device`, `_istate` and `_shown_lrs`.
"""

from __future__ import annotations

import torch

from . import layout
from .kernels.tables import check_not_capturing  # plain torch: does not import triton


class ShownLrs:
    """The shown lrs of FusedOptimizer (see the module doc)."""

    def _show_lrs(self) -> None:
        """With `lr_schedule`, every group keeps its base lr in `initial_lr` (the key torch's LR schedulers use for it)
        and `group["lr"]` is a 0-dim fp32 device tensor, a view of the step's hyper-parameter table, that each step sets
        on the device to the lr the next step will use: what Lightning's LearningRateMonitor or a loop that prints
        `group["lr"]` read, with no host read in step(). A value assigned to `group["lr"]` (anything but that view)
        becomes the group's new base lr; so does one loaded with a state dict. Without a schedule the groups are left as
        they are."""
        if self.policy.schedule is None:
            self._shown_lrs = []
            return
        previous = self._shown_lrs
        views = list(self.step_buffers.hparams[:, layout.H_SHOWN_LR].unbind(0))
        for index, (group, view) in enumerate(zip(self.param_groups, views)):
            lr = group["lr"]
            if not (index < len(previous) and lr is previous[index]):
                group["initial_lr"] = lr
            group["lr"] = view
        self._shown_lrs = views
        self._refresh_shown_lrs()

    def base_lrs(self) -> list[float | torch.Tensor]:
        """Every group's configured lr: under `lr_schedule` the base lr the schedule scales (`group["lr"]` shows the
        scheduled one), otherwise `group["lr"]`. What a caller that rescales the lr reads (the guard's rollback),
        instead of knowing where each case keeps it; a value assigned to `group["lr"]` since the last step counts."""
        if self.policy.schedule is None:
            return [group["lr"] for group in self.param_groups]
        shown = self._shown_lrs
        return [
            group["initial_lr"] if index < len(shown) and group["lr"] is shown[index] else group["lr"]
            for index, group in enumerate(self.param_groups)
        ]

    def set_base_lrs(self, lrs: list[float | torch.Tensor]) -> None:
        """Set every group's configured lr (one value per group; under `lr_schedule` the base lr, and the shown lr
        follows at once, on the device)."""
        if len(lrs) != len(self.param_groups):
            count = len(self.param_groups)
            raise ValueError(f"set_base_lrs: {len(lrs)} lrs for {count} param groups: give one lr per group")
        for group, lr in zip(self.param_groups, lrs):
            group["lr"] = lr
        if self.policy.schedule is not None:
            self._show_lrs()  # the assigned values become the base lrs; the groups show the scheduled lr again

    def _refresh_shown_lrs(self) -> None:
        """The shown lrs from the base lrs and the count of applied updates, on the device (no host read)."""
        check_not_capturing(self.device, "a changed lr (group['lr'] was assigned)")
        bases = [group["initial_lr"] for group in self.param_groups]
        base = torch.stack([torch.as_tensor(b, dtype=torch.float32, device=self.device).reshape(()) for b in bases])
        factor = self.policy.schedule.factor_tensor(self._istate[layout.I_APPLIED_STEPS])
        with torch.no_grad():
            torch.mul(base, factor, out=self.step_buffers.hparams[:, layout.H_SHOWN_LR])
