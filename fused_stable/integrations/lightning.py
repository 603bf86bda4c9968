"""FusedAdamW or FusedLion inside PyTorch Lightning (the ``lightning`` package): one callback and one precision
helper.

Return ``FusedAdamW`` (or ``FusedLion``, any ``fused_stable.optim.FusedOptimizer``) from ``configure_optimizers`` as
any optimizer, and add the callback::

    def configure_optimizers(self):
        return FusedAdamW(self.parameters(), lr=3e-4, weight_decay=0.1, max_grad_norm=1.0,
                          lr_schedule=schedules.warmup_cosine(total_steps, warmup_steps))

    trainer = L.Trainer(callbacks=[FusedStableCallback()])   # no gradient_clip_val

Three things of Lightning's would fight the fused step:

- clipping: ``Trainer(gradient_clip_val=...)`` clips the gradients before ``optimizer.step()``. With
  ``max_grad_norm`` set as well, the fused step clips a second time and, worse, only ever sees clipped grads:
  ``grad_norm``, the spike statistics and the guard would read ~``max_norm`` while the true norm was larger.
  ``FusedStableCallback`` refuses that combination when the fit starts (and Lightning itself refuses any
  ``gradient_clip_val`` with FusedAdamW under ``16-mixed`` / ``bf16-mixed``, as for torch's fused AdamW).
- logging: ``opt.grad_norm`` (pre-clip, unscaled), ``skipped_steps``, ``spike_skips`` and ``last_lr`` (the lr
  the step really used, schedule applied) live on the device. The callback logs them through
  ``LightningModule.log`` at Lightning's logging steps only (``log_every_n_steps``), with one host read there.
- fp16: Lightning's ``precision="16-mixed"`` builds ``torch.amp.GradScaler``, whose ``step()`` makes an extra
  inf-check pass over every gradient before handing the scale to FusedAdamW. ``fp16_mixed_precision()``
  gives Lightning fused_stable's GradScaler instead (and is the way to get fp16 autocast on CPU, where
  Lightning turns ``precision="16-mixed"`` into ``bf16-mixed``).
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fused_stable.integrations.lightning needs the `lightning` package (pip install lightning); "
        "the older `pytorch_lightning` import name is not supported"
    ) from error
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden

from ..amp import GradScaler
from ..optim import FusedOptimizer
from ..state_format import check_precision

__all__ = ["FusedStableCallback", "find_fused_optimizers", "fp16_mixed_precision"]

# what the callback logs, in the order of the one stacked device read
_LOGGED = ("grad_norm", "skipped_steps", "spike_skips", "learning_rate")


def find_fused_optimizers(trainer: Trainer) -> list[FusedOptimizer]:
    """The fused optimizers (FusedAdamW, FusedLion) among ``trainer.optimizers`` (Lightning keeps the raw optimizers
    there)."""
    found = []
    for optimizer in trainer.optimizers:
        # LightningOptimizer and accelerate-style wrappers keep the real one in `.optimizer` / `._optimizer`
        for _ in range(8):
            if isinstance(optimizer, FusedOptimizer) or optimizer is None:
                break
            optimizer = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        if isinstance(optimizer, FusedOptimizer):
            found.append(optimizer)
    return found


def fp16_mixed_precision(device: str = "cuda", **scaler_kwargs: Any) -> MixedPrecision:
    """``Trainer(plugins=[fp16_mixed_precision()])``: fp16 autocast with fused_stable's GradScaler.

    Same arithmetic as ``precision="16-mixed"`` (torch's scale growth and back-off), without the extra
    inf-check pass torch's GradScaler makes before a FusedAdamW step. ``scaler_kwargs`` go to the scaler
    (``init_scale``, ``growth_interval``, ...). ``device="cpu"`` gives real fp16 autocast on CPU.
    """
    return MixedPrecision("16-mixed", device, scaler=GradScaler(device, **scaler_kwargs))


def _clips(opt: FusedOptimizer) -> bool:
    return getattr(getattr(opt, "policy", None), "max_grad_norm", None) is not None


class FusedStableCallback(Callback):
    """Lightning callback for a fused optimizer (FusedAdamW, FusedLion): one clip, and the optimizer's statistics in
    Lightning's logs.

    When the fit starts it checks the optimizers (``configure_optimizers`` must return at least one
    FusedAdamW or FusedLion) and the clipping set-up:

    - ``Trainer(gradient_clip_val=...)`` together with ``FusedAdamW(max_grad_norm=...)``: refused (a
      ``MisconfigurationException`` that says which one to drop), because Lightning's clip runs first and the
      fused step would then measure, and log, only clipped gradients;
    - ``gradient_clip_val`` without ``max_grad_norm``: refused under mixed precision (Lightning would refuse at
      the first step, with a less helpful message); at full precision it works, so it warns once that the
      logged ``grad_norm`` would be post-clip and leaves it out of the logs;
    - an overridden ``configure_gradient_clipping`` with ``max_grad_norm``: warns (it must not clip again).

    After every optimizer step that falls on a Lightning logging step (``Trainer(log_every_n_steps=...)``)
    it logs, with ``LightningModule.log`` (so loggers, the progress bar with ``prog_bar=True``,
    ``trainer.callback_metrics``, ModelCheckpoint and EarlyStopping see them): ``grad_norm`` (global norm
    before clipping, unscaled under fp16), ``skipped_steps`` (non-finite steps skipped so far),
    ``spike_skips`` and ``learning_rate`` (the lr group 0 used in the step, ``lr_schedule`` applied; read from
    the device, not from ``param_groups``). Names get ``prefix`` in front, and ``-1``, ``-2``, ... after them
    for the second, third, ... fused optimizer (manual optimization with several optimizers). Between logging
    steps it reads nothing from the device. Works with automatic and manual optimization, gradient
    accumulation and checkpoint resume (it keeps no state of its own).

    ``state_precision`` ("fp32", "bf16" or "8bit"; None: as the optimizers were built) sets how every fused
    optimizer's state (AdamW's moments, Lion's momentum) is stored, for all its param groups, when the fit starts;
    a state already loaded (a resumed fit) is converted at the next step, and checkpoints then hold the compact
    form.
    """

    def __init__(self, prefix: str = "", prog_bar: bool = False, state_precision: str | None = None) -> None:
        self.prefix = prefix
        self.prog_bar = prog_bar
        self.state_precision = None if state_precision is None else check_precision(state_precision)
        self._log_grad_norm = True
        self._seen_global_step: int | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        fused = find_fused_optimizers(trainer)
        if not fused:
            names = ", ".join(type(o).__name__ for o in trainer.optimizers) or "none"
            raise MisconfigurationException(
                "FusedStableCallback needs configure_optimizers() to return a fused_stable.FusedAdamW or FusedLion "
                f"(got: {names})"
            )
        self._check_clipping(trainer, pl_module, fused)
        if self.state_precision is not None:  # every group's: a state already there is converted at the next step
            for opt in fused:
                opt.defaults["state_precision"] = self.state_precision
                for group in opt.param_groups:
                    group["state_precision"] = self.state_precision
        self._seen_global_step = trainer.global_step

    def _check_clipping(self, trainer: Trainer, pl_module: LightningModule, fused: list[FusedOptimizer]) -> None:
        name = type(fused[0]).__name__  # the messages name the class the fit uses
        clip_val = trainer.gradient_clip_val
        lightning_clips = clip_val is not None and clip_val > 0
        fused_clips = any(_clips(opt) for opt in fused)
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm) or "norm"
        if lightning_clips and fused_clips:
            raise MisconfigurationException(
                f"Trainer(gradient_clip_val={clip_val}) and {name}(max_grad_norm=...) would clip twice: "
                f"Lightning clips first, so {name}'s grad_norm, spike statistics and guard would only see "
                f"clipped gradients. Remove gradient_clip_val from the Trainer; {name}'s max_grad_norm does "
                "the global-norm clip inside the fused step"
            )
        if lightning_clips and isinstance(trainer.precision_plugin, MixedPrecision):
            raise MisconfigurationException(
                f"Trainer(gradient_clip_val={clip_val}) cannot clip for {name} under precision="
                f"{trainer.precision_plugin.precision!r}: the gradients are still scaled when Lightning would "
                "clip (Lightning refuses this for every optimizer that unscales inside step()). Remove "
                f"gradient_clip_val and pass {name}(max_grad_norm=...) instead"
            )
        if lightning_clips:
            rank_zero_warn(
                f"Trainer(gradient_clip_val={clip_val}, gradient_clip_algorithm={algorithm!r}) clips before "
                f"{name}'s step, so {name} only sees clipped gradients: FusedStableCallback does not log "
                "grad_norm (it would be the clipped norm) and spike detection sees clipped norms. Prefer "
                f"{name}(max_grad_norm=...) and no gradient_clip_val: one fused pass instead of two, and the "
                "true pre-clip norm in the logs"
            )
        self._log_grad_norm = not lightning_clips
        if fused_clips and is_overridden("configure_gradient_clipping", pl_module):
            rank_zero_warn(
                f"{type(pl_module).__name__} overrides configure_gradient_clipping while {name} clips with "
                "max_grad_norm: make sure it does not clip as well, or the fused step sees clipped gradients"
            )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step counts optimizer steps: unchanged means an accumulation micro-batch, nothing new to log
        if trainer.global_step == self._seen_global_step:
            return
        self._seen_global_step = trainer.global_step
        # Lightning's own rule for "this batch's metrics reach the loggers" (its LearningRateMonitor and
        # DeviceStatsMonitor use it too): read the device only then
        if not trainer._logger_connector.should_update_logs:
            return
        fused = find_fused_optimizers(trainer)
        values = torch.stack(
            [
                torch.stack([o.grad_norm.float(), o.skipped_steps.float(), o.spike_skips.float(), o.last_lr.float()])
                for o in fused
            ]
        ).tolist()  # the one host read, at a logging step only
        for index, row in enumerate(values):
            suffix = f"-{index}" if index else ""
            for name, value in zip(_LOGGED, row):
                if name == "grad_norm" and not self._log_grad_norm:
                    continue
                if name in ("skipped_steps", "spike_skips"):
                    value = int(value)
                pl_module.log(
                    f"{self.prefix}{name}{suffix}",
                    value,
                    on_step=True,
                    on_epoch=False,
                    prog_bar=self.prog_bar,
                    logger=True,
                    batch_size=1,
                )
