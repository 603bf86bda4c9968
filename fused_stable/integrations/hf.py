"""FusedAdamW or FusedLion inside the Hugging Face Trainer (and TRL's SFTTrainer, which inherits it).

One line swaps the optimizer in::

    trainer = Trainer(model, args, train_dataset=ds,
                      optimizers=fused_trainer_optimizers(model, args),
                      callbacks=[FusedStableCallback()])

or, when the trainer itself changes the model before training (``SFTTrainer(peft_config=...)`` adds the
adapters in its constructor, so an optimizer built beforehand would miss them), a mixin that makes the Trainer
build the fused optimizer in its own ``create_optimizer``::

    class FusedSFTTrainer(FusedStableTrainerMixin, SFTTrainer): pass
    trainer = FusedSFTTrainer(model=model, args=args, train_dataset=ds, peft_config=LoraConfig(...))

Three things of the Trainer's would fight the fused step, and this module moves each into the optimizer:

- clipping: the Trainer clips with ``accelerator.clip_grad_norm_`` (a norm pass plus a read-write pass over
  every grad) whenever ``args.max_grad_norm > 0``. ``fused_trainer_optimizers`` hands ``args.max_grad_norm``
  to FusedAdamW and sets it to 0 on ``args``, so the clip happens once, inside the fused step.
- the lr schedule: under fp16, accelerate decides "step skipped" by whether GradScaler called
  ``optimizer.step()``, and with FusedAdamW (``_step_supports_amp_scaling``) it always does, so a Trainer
  scheduler would advance on overflow steps; FusedAdamW also skips non-finite steps on its own under bf16
  or fp32, which no host-side scheduler can see. The schedule named by ``args.lr_scheduler_type`` therefore
  runs on the device (``FusedAdamW(lr_schedule=...)``, counted in applied updates), and the Trainer gets a
  ``DeviceScheduleLR``, which never writes ``group["lr"]`` (there FusedAdamW shows the lr the next step uses).
- logging: ``FusedStableCallback`` puts the optimizer's pre-clip ``grad_norm``, ``skipped_steps``,
  ``spike_skips`` and the lr really used into each training log (the Trainer's ``log_history`` and the
  callbacks after it), reading the device only at logging steps.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler
from transformers import TrainerCallback

from .. import schedules
from ..optim import FusedOptimizer
from ..optimizers import OPTIMIZERS
from ..rules.muon.param_groups import muon_param_groups
from . import optim_names

__all__ = [
    "DeviceScheduleLR",
    "FusedStableCallback",
    "FusedStableTrainerMixin",
    "find_fused_optimizer",
    "fused_trainer_optimizers",
    "schedule_from_training_args",
]

logger = logging.getLogger(__name__)

# lr_scheduler_type values that have a device-side equivalent in fused_stable.schedules
_DEVICE_SCHEDULES = ("linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup")


class DeviceScheduleLR(LRScheduler):
    """The Trainer's scheduler next to ``FusedAdamW(lr_schedule=...)``, whose schedule runs inside the fused step.

    It changes no lr: ``step()`` only counts (the Trainer saves and restores it with its checkpoints), and
    ``get_last_lr()`` returns the base lrs as plain numbers. The Trainer calls it after every step and turns a
    tensor into a number with ``.item()``, which would read the device every step; the lr the step really used
    reaches the logs through ``FusedStableCallback``, at logging steps only. (A torch scheduler such as a constant
    ``LambdaLR`` would write the base lr into ``group["lr"]``, where FusedAdamW shows the scheduled lr.)
    """

    def __init__(self, optimizer, *args: Any, **kwargs: Any) -> None:
        fused = find_fused_optimizer(optimizer)
        if fused is not None:  # the one torch scheduler FusedAdamW(lr_schedule=...) accepts: it writes no lr
            fused.device_schedule_only = True
        super().__init__(optimizer, *args, **kwargs)

    def get_lr(self) -> list[float]:
        return list(self.base_lrs)

    def step(self, epoch: int | None = None) -> None:
        self._step_count += 1
        self.last_epoch += 1
        self._last_lr = list(self.base_lrs)


def find_fused_optimizer(optimizer: Any) -> FusedOptimizer | None:
    """The fused optimizer (FusedAdamW, FusedLion) inside ``optimizer`` (accelerate's AcceleratedOptimizer wraps it),
    or None."""
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, FusedOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None


def _clips(opt: FusedOptimizer) -> bool:
    policy = getattr(opt, "policy", None)
    return getattr(policy, "max_grad_norm", None) is not None


def schedule_from_training_args(args, num_training_steps: int | None = None) -> schedules.Schedule:
    """The device-side equivalent of ``args.lr_scheduler_type`` with its warm-up.

    ``num_training_steps`` defaults to ``args.max_steps``; schedules that decay need one of the two.
    """
    kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    if kind not in _DEVICE_SCHEDULES:
        raise ValueError(
            f"lr_scheduler_type={kind!r} has no device-side equivalent; fused_stable supports "
            f"{', '.join(_DEVICE_SCHEDULES)} (or pass lr_schedule=... yourself)"
        )
    total = num_training_steps if num_training_steps is not None else args.max_steps
    if kind in ("constant", "constant_with_warmup") and (total is None or total <= 0):
        if kind == "constant_with_warmup" and not (args.warmup_steps >= 1 or args.warmup_steps == 0):
            raise ValueError("a warm-up given as a ratio needs num_training_steps= or max_steps > 0")
        warmup = int(args.warmup_steps) if kind == "constant_with_warmup" else 0
        return schedules.constant(warmup)
    if total is None or total <= 0:
        raise ValueError(
            f"lr_scheduler_type={kind!r} needs the number of training steps: set max_steps in the "
            "TrainingArguments or pass num_training_steps="
        )
    warmup = args.get_warmup_steps(total)
    kwargs = dict(args.lr_scheduler_kwargs or {})
    if kind == "constant":
        return schedules.constant(0)
    if kind == "constant_with_warmup":
        return schedules.constant(warmup)
    if kind == "linear":
        return schedules.warmup_linear(total, warmup)
    if kwargs.get("num_cycles", 0.5) != 0.5:
        raise ValueError(f"only num_cycles=0.5 (a half cosine) runs on the device, got {kwargs['num_cycles']}")
    if kind == "cosine":
        return schedules.warmup_cosine(total, warmup)
    if "min_lr_rate" in kwargs:
        ratio = float(kwargs["min_lr_rate"])
    elif "min_lr" in kwargs:
        ratio = float(kwargs["min_lr"]) / float(args.learning_rate)
    else:
        raise ValueError("lr_scheduler_type='cosine_with_min_lr' needs lr_scheduler_kwargs min_lr or min_lr_rate")
    return schedules.warmup_cosine(total, warmup, min_lr_ratio=ratio)


def _trainer_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The Trainer's own split: no weight decay on biases and norm weights, only trainable params."""
    from transformers import Trainer

    # Called unbound on purpose: the method only uses `model`, and calling it keeps the split identical
    # to the installed transformers' create_optimizer (its name patterns change between versions).
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("the model has no trainable parameters (every requires_grad is False)")
    return groups


def _trainer_rules() -> dict:
    """The rules fused_trainer_optimizers builds: fused_stable.OPTIMIZERS' entries, over the Trainer's param groups
    (FusedMuon over its own split, muon_param_groups)."""
    return dict(OPTIMIZERS)


def fused_trainer_optimizers(
    model: torch.nn.Module,
    args,
    num_training_steps: int | None = None,
    *,
    rule: str | None = None,
    state_precision: str | None = None,
    **fused_kwargs: Any,
) -> tuple[FusedOptimizer, DeviceScheduleLR]:
    """``(optimizer, scheduler)`` for ``Trainer(optimizers=...)``: FusedAdamW or FusedLion configured from ``args``
    (or FusedMuon with ``rule="muon"``: the hidden matrices on Muon, the rest on AdamW, split as LLaMA-Factory's
    ``use_muon`` splits them, ``muon_param_groups``, at ``args``' lr and weight decay for both).

    ``rule`` ("adamw" or "lion") chooses the optimizer; None (the default) takes it from ``args.optim``, which must
    name AdamW or Lion: ``adamw_torch`` (the Trainer's default), ``adamw_torch_fused`` or ``paged_adamw_32bit`` are
    FusedAdamW, ``lion_32bit`` or ``paged_lion_32bit`` FusedLion, all fp32; ``adamw_bnb_8bit``, ``adamw_8bit``,
    ``paged_adamw_8bit``, ``lion_8bit`` or ``paged_lion_8bit`` the same with 8-bit state, with the clip and the skip
    inside the step and the state not paged (integrations/optim_names.py); another name (``adafactor``, ...) is
    refused, since no fused optimizer runs it. ``state_precision`` ("fp32", "bf16" or "8bit") overrides the state
    ``args.optim`` names. The Trainer's checkpoints save the compact state (``optimizer.pt``) and resume from it
    exactly.

    Takes lr, betas (Lion too, as transformers gives them to bitsandbytes' Lion), eps (AdamW), weight decay (with
    the Trainer's decay / no-decay split), ``max_grad_norm`` (clipping moves into the fused step, and
    ``args.max_grad_norm`` is set to 0 so the Trainer does not clip again) and ``lr_scheduler_type`` + warm-up (run
    on the device, so skipped steps do not advance it; the returned scheduler is a ``DeviceScheduleLR``, which
    changes nothing). ``fused_kwargs`` (e.g. ``clip="zscore"``, ``spike_skip_threshold=6.0``,
    ``master_weights=True``, ``lr_schedule=...``, ``max_grad_norm=...``) override or extend what comes from
    ``args``. Call it before building the Trainer, with the same args.
    """
    named = optim_names.lookup(args.optim) if rule is None or state_precision is None else None
    rule = named.rule if rule is None else rule
    rules = _trainer_rules()
    if rule not in rules:
        raise ValueError(f"rule={rule!r}: fused_trainer_optimizers builds {' or '.join(map(repr, rules))}")
    cls = rules[rule].cls
    kwargs: dict[str, Any] = dict(
        lr=args.learning_rate,
        **rules[rule].trainer_keywords(args),
        weight_decay=args.weight_decay,
        state_precision=named.state_precision if state_precision is None else state_precision,
    )
    if "max_grad_norm" not in fused_kwargs:
        mgn = args.max_grad_norm
        kwargs["max_grad_norm"] = float(mgn) if mgn is not None and mgn > 0 else None
    if "lr_schedule" not in fused_kwargs:
        kwargs["lr_schedule"] = schedule_from_training_args(args, num_training_steps)
    kwargs.update(fused_kwargs)
    if rules[rule].own_param_groups:  # FusedMuon: LLaMA-Factory's use_muon split, one lr and weight decay for both
        groups = muon_param_groups(model, lr=kwargs.pop("lr"), weight_decay=kwargs.pop("weight_decay"))
        optimizer = cls(groups, **kwargs)
    else:
        optimizer = cls(_trainer_param_groups(model, kwargs.pop("weight_decay")), **kwargs)
    if args.max_grad_norm is not None and args.max_grad_norm > 0:
        # The fused step now owns clipping; a Trainer clip on top would be a second, wasted pass.
        args.max_grad_norm = 0.0
    return optimizer, DeviceScheduleLR(optimizer)


class FusedStableCallback(TrainerCallback):
    """Trainer callback for a fused optimizer (FusedAdamW, FusedLion): one clip, and the optimizer's statistics in
    the training logs.

    ``on_train_begin`` turns the Trainer's own clipping off when the fused optimizer clips (a no-op after
    ``fused_trainer_optimizers``, which already did). ``on_log`` adds ``grad_norm`` (pre-clip),
    ``skipped_steps``, ``spike_skips`` and ``learning_rate`` (the lr the last fused step used, schedule
    applied) to each training log, in the Trainer's ``state.log_history`` and in ``logs`` for the
    callbacks after this one. Reporting callbacks (TensorBoard, W&B) that transformers registers run
    before user callbacks; to have them see these values, pass this callback first via
    ``trainer.callback_handler.callbacks.insert(0, FusedStableCallback())``.
    """

    def __init__(self) -> None:
        self._trainer_clips = False

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        opt = find_fused_optimizer(optimizer)
        if opt is None:
            raise TypeError(
                "FusedStableCallback needs the Trainer's optimizer to be a fused_stable.FusedAdamW or FusedLion, got "
                f"{type(optimizer).__name__}: pass optimizers=fused_trainer_optimizers(model, args)"
            )
        self._trainer_clips = bool(args.max_grad_norm is not None and args.max_grad_norm > 0)
        if self._trainer_clips and _clips(opt):
            logger.info("%s clips the gradients itself: setting max_grad_norm=0 for the Trainer", type(opt).__name__)
            args.max_grad_norm = 0.0
            self._trainer_clips = False
        return control

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        opt = find_fused_optimizer(optimizer)
        if opt is None or logs is None or "loss" not in logs:  # evaluation and final summary logs
            return control
        values = torch.stack(
            [opt.grad_norm.float(), opt.skipped_steps.float(), opt.spike_skips.float(), opt.last_lr.float()]
        ).tolist()  # the one host read, at a logging step only
        extra = {
            "skipped_steps": int(values[1]),
            "spike_skips": int(values[2]),
            "learning_rate": values[3],
        }
        if not self._trainer_clips:
            # With the Trainer clipping, the optimizer only sees clipped grads: keep the Trainer's norm.
            extra["grad_norm"] = values[0]
        logs.update(extra)
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and "loss" in last:
            last.update(extra)
        return control


def _prepare_deepspeed_config(trainer) -> None:
    """The Trainer's DeepSpeed config (``TrainingArguments(deepspeed=...)``, its "auto" values filled by
    transformers) through ``fused_stable.integrations.deepspeed.prepare_config``, in place, before the engine is
    built. transformers filled ``gradient_clipping`` with ``max_grad_norm``, which FusedAdamW now applies: set to 0."""
    from .deepspeed import prepare_config

    config = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config
    fused = find_fused_optimizer(trainer.optimizer)
    clipping = config.get("gradient_clipping", 0)
    if fused is not None and _clips(fused) and clipping not in (0, 0.0, "auto"):
        if float(clipping) != float(fused.policy.max_grad_norm):
            name = type(fused).__name__
            raise ValueError(
                f"the DeepSpeed config clips at gradient_clipping={clipping}, {name} at max_grad_norm="
                f"{fused.policy.max_grad_norm}: give one value (the clip is {name}'s, once per engine step)"
            )
        config["gradient_clipping"] = 0.0
    prepared = prepare_config(config)
    config.clear()
    config.update(prepared)


class FusedStableTrainerMixin:
    """Mix in before a Trainer class to have the Trainer build the fused optimizer itself (FusedAdamW, or FusedLion
    for a Lion ``args.optim``)::

        class FusedSFTTrainer(FusedStableTrainerMixin, SFTTrainer): pass

        trainer = FusedSFTTrainer(model=model, args=args, train_dataset=ds, peft_config=LoraConfig(...),
                                  fused_optimizer_kwargs={"clip": "zscore"})

    - ``create_optimizer`` builds it from ``args`` exactly as ``fused_trainer_optimizers`` does (lr,
      betas, eps, the Trainer's decay split, ``max_grad_norm`` moved into the fused step, ``lr_scheduler_type`` on
      the device), plus ``fused_optimizer_kwargs``. The Trainer calls it inside ``train()``, once the model is
      final: after ``SFTTrainer(peft_config=...)`` has added the adapters, so FusedAdamW gets exactly the
      trainable adapter parameters. Without ``max_steps``, the number of training steps the schedule needs is
      the one the Trainer computes from the dataloader and ``num_train_epochs``.
    - ``create_scheduler`` returns the ``DeviceScheduleLR`` that goes with the device-side schedule.
    - A ``FusedStableCallback`` is put first in the callbacks unless one is there already.
    - ``TrainingArguments(deepspeed=...)`` (the way LLaMA-Factory and ms-swift run DeepSpeed): ``create_optimizer``
      passes the Trainer's DeepSpeed config, as transformers filled it, through
      ``fused_stable.integrations.deepspeed.prepare_config`` before the engine is built (the ``gradient_clipping``
      filled with ``max_grad_norm`` becomes 0: FusedAdamW clips), and once the engine exists the integration is
      attached to it (``_prepare_for_training``), so the clip, skip and schedule are decided once per engine step.
    - ``_get_grad_norm``: transformers >= 5 computes the grad norm every step even with ``max_grad_norm == 0``
      (``accelerator.clip_grad_norm_(params, inf)``: a norm pass and a multiply-by-one pass, plus an unscale
      pass under fp16) just to log it; FusedAdamW already has it, and the callback logs it.

    ``optimizers=(optimizer, scheduler)`` passed to the Trainer are kept as they are (then only the last point
    applies); ``args.optim`` names the rule and state precision (see ``fused_trainer_optimizers``);
    ``optimizer_cls_and_kwargs`` is refused (use ``fused_optimizer_kwargs``).
    """

    def __init__(self, *args: Any, fused_optimizer_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError(
                f"{type(self).__name__} builds the fused optimizer itself and cannot take optimizer_cls_and_kwargs: "
                "pass its options as fused_optimizer_kwargs={...} (rule='lion' chooses FusedLion) instead"
            )
        self.fused_optimizer_kwargs = dict(fused_optimizer_kwargs or {})
        self._fused_training_steps: int | None = None
        self._fused_scheduler: DeviceScheduleLR | None = None
        super().__init__(*args, **kwargs)
        callbacks = self.callback_handler.callbacks
        if not any(isinstance(callback, FusedStableCallback) for callback in callbacks):
            callbacks.insert(0, FusedStableCallback())  # first, so reporting callbacks see its values

    def set_initial_training_values(self, args, dataloader, *rest):
        values = super().set_initial_training_values(args, dataloader, *rest)
        self._fused_training_steps = values[-1]  # max_steps, from num_train_epochs when args.max_steps < 0
        return values

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer, self._fused_scheduler = fused_trainer_optimizers(
                self.model if model is None else model,
                self.args,
                num_training_steps=self._fused_training_steps,
                **self.fused_optimizer_kwargs,
            )
        if getattr(self, "is_deepspeed_enabled", False):
            _prepare_deepspeed_config(self)  # before the Trainer builds the engine with it
        # transformers < 5 has create_optimizer(self), without the model argument
        return super().create_optimizer() if model is None else super().create_optimizer(model)

    def _prepare_for_training(self, *args: Any, **kwargs: Any):
        prepared = super()._prepare_for_training(*args, **kwargs)
        engine = getattr(self, "deepspeed", None)
        if engine is not None and not hasattr(engine, "fused_stable_step"):
            from .deepspeed import attach

            attach(engine)  # the engine exists now; its first step is still to come
        return prepared

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None and self._fused_scheduler is not None:
            self.lr_scheduler = self._fused_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and find_fused_optimizer(getattr(self, "optimizer", None)) is not None:
            return None  # FusedStableCallback logs the optimizer's own pre-clip norm instead
        return super()._get_grad_norm(model, grad_norm=grad_norm)
