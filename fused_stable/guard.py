"""The stability guard: spike and divergence detection from device-side counters, and what to do about it.

Pure logic, usable without a model or a trainer, and no file I/O (alerts.jsonl is written by
`fused_stable.train.run.report.AlertLog`). A `Guard` does nothing per step: it is checked at logging steps with
`check`, which does one device read for the whole interval and returns a `Decision`. Everything it needs about
the steps in between, the optimizer's decision kernel already keeps on the device: the running statistics of
the global grad norm, the largest z-score since the last poll (`FusedAdamW.max_zscore`, so a spike between two
logging steps is seen) and the worst step of the interval (`FusedAdamW.worst_step`, a non-finite step counting
as the worst) with its per-tensor grad norms, so an alert names the tensors of the step that spiked.

Alert kinds (`Alert.kind`):
- `grad_spike`: the grad norm's z-score above `grad_z` (6), with a norm >= `grad_ratio` (5) x its running mean;
- `nonfinite_grads`: steps the optimizer skipped for inf/NaN gradients (`skipped_steps`); `nonfinite_storm` (3)
  of them in one interval escalate to the policy;
- `loss_spike`: a step's loss z-score above `loss_z` (6), against running statistics of the loss (`LossStats`,
  the optimizer's grad-norm rules on the host);
- `nonfinite_loss`: a step's loss was inf/NaN;
- `loss_rise`: an interval's median loss (or its last 3's) above `loss_rise` (1.5) x the best interval so far;
- `data_shift`: the data changed, not the model: the loss statistics start over instead of rolling back. Two
  witnesses: a loss rise at a check whose evaluation held (eval_loss and retention_loss within `eval_rise` of
  their bests, as the model's knowledge does when only the data moved) with finite grads and nothing else
  wrong; or, at a check with no evaluation, the restored model's first loss after a rollback, already bad;
- `eval_loss_rise` / `retention_loss_rise`: an evaluation's held-out loss (`eval_loss`, the user's own held-out
  data) or retention loss (`retention_loss`, the base model's own answers to general prompts) above `eval_rise`
  (1.3) x its best so far (the model before its first step included). Forgetting moves neither the training
  loss nor the gradient norms: these are the signals that see it. The trainer puts the values on the metrics
  row of the step it evaluated (one device read per evaluation, `train.evaluation.held_out`); the guard only
  compares numbers.

Alerts fire far above the optimizer's clip threshold (z 2.5, exceeded by ~1% of normal steps, which ZClip
clips gently by design). Policies: `warn` records the alert and goes on; `skip` makes the optimizer skip
spiking steps on the device (`spike_skip_threshold` = `skip_z` and `spike_skip_ratio` = `skip_ratio`: z > 6
and a norm >= 5x its running mean by default, the alert rule; normal small-batch steps reach z 9-12 but only
~3x the mean norm, so the ratio is what keeps them) and records them; `stop` asks the trainer to checkpoint and
exit; `rollback` asks it to restore the last good checkpoint, multiplies the lr by `lr_factor` and skips the
data window that caused the spike, and gives up (stops) after `max_rollbacks` rollbacks. An evaluation's rise
has nothing the optimizer could skip: under `skip` it warns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any

import torch

from fused_stable.guard_config import GuardConfig
from fused_stable.loss_stats import LossStats

# alert kinds
GRAD_SPIKE = "grad_spike"  # grad-norm z-score above grad_z (and norm >= grad_ratio x mean)
NONFINITE_GRADS = "nonfinite_grads"  # steps skipped for inf/NaN gradients in the interval
LOSS_SPIKE = "loss_spike"  # loss z-score above loss_z
NONFINITE_LOSS = "nonfinite_loss"  # a step's loss was inf/NaN
LOSS_RISE = "loss_rise"  # an interval's median loss (or its last 3's) rose above loss_rise x the best so far
DATA_SHIFT = "data_shift"  # a loss rise the held-out losses did not follow, or a restored model finding it too
EVAL_LOSS_RISE = "eval_loss_rise"  # an evaluation's held-out loss rose above eval_rise x its best so far
RETENTION_LOSS_RISE = "retention_loss_rise"  # ...its retention loss (the base model's own answers) did
# the metrics-row fields an evaluation fills in, and the alert each one raises
EVALUATED = {"eval_loss": EVAL_LOSS_RISE, "retention_loss": RETENTION_LOSS_RISE}

# what happened (or will happen) because of an alert
ACTION_WARN = "warn"  # recorded, training goes on
ACTION_SKIPPED = "skipped"  # the optimizer skipped the step(s) on the device
ACTION_STOP = "stop"  # checkpoint + exit (code 3)
ACTION_ROLLBACK = "rollback"  # restore the last good checkpoint, lower the lr, skip the data window
ACTION_GIVE_UP = "give_up"  # rollback budget exhausted: stop
ACTION_REBASELINE = "rebaseline"  # the loss statistics start over on the new data (no rollback)
# alerts whose cure is a smaller lr; a storm of non-finite steps is rolled back without touching the lr
_LR_KINDS = (GRAD_SPIKE, LOSS_SPIKE, LOSS_RISE, EVAL_LOSS_RISE, RETENTION_LOSS_RISE)

RISE_TAIL = 3  # the loss rise also looks at the median of an interval's last 3 losses (one spike does not move it)


@dataclass(kw_only=True)  # by name only: six positional fields read alike
class Alert:
    step: int  # the optimizer step where it happened (trainer count, skipped steps included)
    kind: str  # GRAD_SPIKE | NONFINITE_GRADS | LOSS_SPIKE | NONFINITE_LOSS | LOSS_RISE | DATA_SHIFT | EVAL_...
    value: float  # the z-score, the count of non-finite steps, or (rises) the ratio to the best so far
    threshold: float
    action: str  # ACTION_*
    detected_at: int  # the logging step at which the guard read it
    grad_norm: float | None = None
    loss: float | None = None
    top_tensors: list = field(default_factory=list)  # [{"name", "grad_norm"}], largest first

    def describe(self) -> str:
        if self.kind == GRAD_SPIKE:
            what = f"grad-norm spike z={self.value:.1f} > {self.threshold:g}"
        elif self.kind == NONFINITE_GRADS:
            what = f"{int(self.value)} step(s) with non-finite gradients (storm at {int(self.threshold)})"
        elif self.kind == LOSS_SPIKE:
            what = f"loss spike z={self.value:.1f} > {self.threshold:g}"
        elif self.kind == NONFINITE_LOSS:
            what = "non-finite loss"
        elif self.kind == LOSS_RISE:
            what = f"loss rose to {self.value:.2f}x its best logging-interval median (alert above {self.threshold:g}x)"
        elif self.kind in (EVAL_LOSS_RISE, RETENTION_LOSS_RISE):
            measure = "held-out loss (eval_loss)" if self.kind == EVAL_LOSS_RISE else "retention loss"
            what = f"{measure} rose to {self.value:.2f}x its best so far (alert above {self.threshold:g}x)"
        else:
            what = (
                f"the data changed, not the model: the loss is {self.value:.2f}x the best so far while the model "
                "held up (its held-out losses, or a restored model's first loss); the loss statistics start over"
            )
        extra = []
        if self.grad_norm is not None:
            extra.append(f"grad norm {self.grad_norm:.4g}")
        if self.loss is not None:
            extra.append(f"loss {self.loss:.4g}")
        tops = ", ".join(f"{t['name']} ({_fmt_norm(t['grad_norm'])})" for t in self.top_tensors[:3])
        text = f"guard: step {self.step}: {what}" + (f" ({', '.join(extra)})" if extra else "")
        text += f" -> {self.action}"
        return text + (f" | largest grads: {tops}" if tops else "")


@dataclass
class Decision:
    action: str = "continue"  # "continue" | "stop" | "rollback"
    alerts: list = field(default_factory=list)
    message: str = ""
    cut_lr: bool = False  # for a rollback: whether the lr is cut...
    lr_factor: float = 1.0  # ...by this (lr_factor, or eval_lr_factor when an evaluation's rise is among the alerts)


def _fmt_norm(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


class Guard:
    """Spike checks at logging steps and the policy's answer. See the module docstring.

    Use: `guard.bind(optimizer)` once (a FusedAdamW); `decision = guard.check(step, optimizer, rows)` at logging
    steps, where `step` counts optimizer steps (one `optimizer.step()` call each, skipped ones included) and rows
    are the per-step metrics read since the last check (at least "step" and "loss"). After a rollback restored
    the optimizer, call `guard.apply_rollback(optimizer)`.
    """

    def __init__(self, config: GuardConfig | None = None, **kwargs: Any):
        self.config = config if config is not None else GuardConfig(**kwargs)
        c = self.config
        self.loss_stats = LossStats(c.loss_alpha, c.loss_z, c.loss_warmup, c.loss_rel_floor)
        self.best_interval_loss: float | None = None
        self.best_eval: dict[str, float] = {}  # the lowest eval_loss / retention_loss so far
        # [step, best_eval after that check] per evaluated check: a rollback forgets the bests of the steps it undid
        self.eval_history: list[list] = []
        self.after_rollback = False
        self.grace_until = -1  # after a data shift: spike alerts only warn up to this step
        self.rollbacks = 0
        self.lr_scale = 1.0
        self.alerts_total = 0
        self.base_lrs: list[float] = []
        self._seen_skipped = 0  # optimizer counters at the last check
        self._seen_spike_skips = 0

    # ------------------------------------------------------------------------------------------ binding
    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Remember the configured lrs (rollbacks scale them) and the counters to compare against (one read)."""
        self.base_lrs = [float(lr) for lr in _configured_lrs(optimizer)]
        self._rebaseline(optimizer)

    def resync(self, optimizer) -> None:
        """After the optimizer's state was loaded (resume): compare the counters against their loaded values."""
        self._rebaseline(optimizer)

    def _rebaseline(self, optimizer) -> None:
        counters = torch.stack([optimizer.skipped_steps, optimizer.spike_skips]).tolist()
        self._seen_skipped, self._seen_spike_skips = int(counters[0]), int(counters[1])
        optimizer.reset_max_zscore()  # the polling windows: the largest z-score and the worst step

    # ------------------------------------------------------------------------------------------ at logging steps
    @torch.no_grad()
    def check(self, step: int, optimizer, rows: list[dict]) -> Decision:
        """Read the interval's counters (one device read), update the loss statistics, decide."""
        c = self.config
        scalars = torch.stack(
            [
                x.double()
                for x in (
                    optimizer.max_zscore,
                    optimizer.max_zscore_norm,
                    optimizer.skipped_steps,
                    optimizer.spike_skips,
                    optimizer.applied_steps,
                    optimizer.worst_step,
                    optimizer.worst_step_norm,
                    optimizer.grad_norm,
                    optimizer.grad_norm_mean,
                )
            ]
        )
        if c.top_k:  # the worst step's per-tensor grad norms, kept by the decision kernel
            scalars = torch.cat([scalars, optimizer.worst_step_grad_norms().double()])
        values = scalars.tolist()  # the one device read
        max_z, max_z_norm, skipped, spike_skips, applied, worst_index, worst_norm, last_norm, norm_mean = values[:9]
        tensor_norms = values[9:]
        new_skipped = int(skipped) - self._seen_skipped
        new_spike_skips = int(spike_skips) - self._seen_spike_skips
        self._seen_skipped, self._seen_spike_skips = int(skipped), int(spike_skips)
        optimizer.reset_max_zscore()

        observed = worst_index >= 0
        # the worst step's index counts every step the optimizer took; `step` is the latest one's number
        steps_taken = int(applied) + int(skipped) + int(spike_skips)
        where = step - (steps_taken - 1 - int(worst_index)) if observed else step
        top = self._top_tensors(tensor_norms, getattr(optimizer, "param_names", None)) if observed else []
        # the optimizer already neutralised isolated non-finite steps (skipped) and, when spike skipping is on,
        # the spikes it skipped: those are recorded, and escalate only as a storm of non-finite steps
        storm = new_skipped >= c.nonfinite_storm
        alerts: list[Alert] = []

        def alert(at: int, kind: str, value: float, threshold: float, action: str, **extra) -> Alert:
            found = dict(
                value=float(value), threshold=float(threshold), action=action, detected_at=step, top_tensors=top
            )
            return Alert(step=at, kind=kind, **found, **extra)

        if new_skipped > 0:
            norm = worst_norm if observed else last_norm
            action = "" if storm else ACTION_SKIPPED
            alerts.append(alert(where, NONFINITE_GRADS, new_skipped, c.nonfinite_storm, action, grad_norm=norm))
        # heavy tails: small-batch fine-tuning has normal steps at z ~ 10 but only ~3x the mean norm
        if max_z > c.grad_z and (not c.grad_ratio or max_z_norm >= c.grad_ratio * norm_mean):
            at = where if observed and math.isfinite(worst_norm) else step
            action = ACTION_SKIPPED if new_spike_skips > 0 else ""
            alerts.append(alert(at, GRAD_SPIKE, max_z, c.grad_z, action, grad_norm=max_z_norm))
        if self.after_rollback and rows:
            alerts += self._check_data_shift(rows[0], step, optimizer)
        for row in rows:
            loss = float(row["loss"])
            z = self.loss_stats.update(loss)
            # a bad loss on a step whose update the optimizer skipped did no harm (rows may say so per step)
            skipped_row = row.get("skipped")
            if not math.isfinite(loss):
                handled = bool(skipped_row) if skipped_row is not None else new_skipped > 0 and not storm
                action = ACTION_SKIPPED if handled else ""
                alerts.append(alert(int(row["step"]), NONFINITE_LOSS, loss, math.inf, action, loss=loss))
            elif z > c.loss_z:
                action = ACTION_SKIPPED if skipped_row else ""
                alerts.append(alert(int(row["step"]), LOSS_SPIKE, z, c.loss_z, action, loss=loss))
        alerts += self._check_rise(rows, step, top)
        alerts += self._check_evaluations(rows, step, in_grace=step <= self.grace_until)
        evaluated = any(row.get(key) is not None for row in rows for key in EVALUATED)
        if evaluated and self._only_the_data_moved(alerts, step):
            alerts = self._accept_shift(alerts, step, optimizer)
        if evaluated:
            self.eval_history.append([step, dict(self.best_eval)])
        return self._decide(alerts, in_grace=step <= self.grace_until)

    def eval_reference(self, values: dict) -> None:
        """The evaluation of the model before its first step (the trainer's step 0): the best so far that later
        evaluations are compared with."""
        for key in EVALUATED:
            value = values.get(key)
            if value is not None and math.isfinite(float(value)):
                self.best_eval[key] = float(value)
        self.eval_history = [[0, dict(self.best_eval)]]

    def _check_evaluations(self, rows: list[dict], step: int, in_grace: bool = False) -> list[Alert]:
        """Each evaluated row's eval_loss and retention_loss against the best so far: above `eval_rise` x it
        (or not finite), an alert; lower, the new best. After a data shift (`in_grace`) the held-out losses
        move with the new data: each evaluation is then the reference, and watching resumes from the level the
        new data settles at."""
        alerts = []
        for row in rows:
            for key, kind in EVALUATED.items():
                if row.get(key) is None:
                    continue
                value, best = float(row[key]), self.best_eval.get(key)
                if math.isfinite(value) and (in_grace or best is None or value < best):
                    self.best_eval[key] = value
                    continue
                ratio = value / best if best else math.inf  # a non-finite first value: inf (NaN stays NaN)
                if self.config.eval_rise and not ratio <= self.config.eval_rise:  # a NaN ratio alerts too
                    rise = dict(value=ratio, threshold=self.config.eval_rise, action="", detected_at=step, loss=value)
                    alerts.append(Alert(step=int(row["step"]), kind=kind, **rise))
        return alerts

    def _check_rise(self, rows: list[dict], step: int, top: list) -> list[Alert]:
        """The interval's median loss (finite, applied steps: one spike does not move it), and the median of its
        last RISE_TAIL losses, against the best interval median so far. The tail catches a divergence that starts
        late in an interval: the whole interval's median would pass it, and the weights a checkpoint (a rollback
        target) saves at this check are the diverging ones."""
        kept = [float(r["loss"]) for r in rows if math.isfinite(float(r["loss"])) and not r.get("skipped")]
        if not kept:
            return []
        whole = median(kept)
        latest = max(whole, median(kept[-RISE_TAIL:]))
        best = self.best_interval_loss
        if best is None:
            # the very first interval: its first steps show the starting model (the lr is still warming up),
            # the reference a too-high lr must not get to move before the first check
            best = min(whole, median(kept[: max(1, len(kept) // 2)]))
        self.best_interval_loss = min(best, whole)
        if self.config.loss_rise and best > 0 and latest > self.config.loss_rise * best:
            rise = dict(value=latest / best, threshold=self.config.loss_rise, action="", detected_at=step, loss=latest)
            return [Alert(step=int(rows[-1]["step"]), kind=LOSS_RISE, **rise, top_tensors=top)]
        return []

    def _only_the_data_moved(self, alerts: list[Alert], step: int) -> bool:
        """A loss rise at a check whose evaluation held (no eval or retention rise: the model still knows what
        it knew), with every grad and loss of the interval finite and no grad spike left unskipped: the loss
        rose because the data changed (a shift that persists), not because the weights broke."""
        if step <= self.grace_until or not any(a.kind == LOSS_RISE for a in alerts):
            return False
        moved = (LOSS_RISE, LOSS_SPIKE)  # the new data's first losses are spikes against the old statistics
        return all(a.kind in moved or (a.kind == GRAD_SPIKE and a.action == ACTION_SKIPPED) for a in alerts)

    def _accept_shift(self, alerts: list[Alert], step: int, optimizer) -> list[Alert]:
        """The loss rise becomes a data shift and the interval's loss spikes follow it (no rollback): the
        statistics start over on the new data."""
        rise = next(a for a in alerts if a.kind == LOSS_RISE)
        for alert in alerts:
            if alert.kind == LOSS_SPIKE:
                alert.action = ACTION_REBASELINE
        self._start_over(step, optimizer)
        shift = replace(rise, kind=DATA_SHIFT, action=ACTION_REBASELINE, detected_at=step)
        return [a for a in alerts if a is not rise] + [shift]

    def _check_data_shift(self, first: dict, step: int, optimizer) -> list[Alert]:
        """After a rollback the first loss comes from the restored, good weights: if it is already bad, the data
        changed (not the model), and rolling back again would not help: start the loss statistics over."""
        self.after_rollback = False
        loss, best = float(first["loss"]), self.best_interval_loss
        if not math.isfinite(loss) or best is None or best <= 0:
            return []
        bad_z = self.loss_stats.zscore(loss) > self.config.loss_z
        bad_rise = bool(self.config.loss_rise) and loss > self.config.loss_rise * best
        if not (bad_z or bad_rise):
            return []
        self._start_over(step, optimizer)
        c = self.config
        shift = dict(value=loss / best, threshold=c.loss_rise, action=ACTION_REBASELINE, detected_at=step, loss=loss)
        return [Alert(step=int(first["step"]), kind=DATA_SHIFT, **shift)]

    def _start_over(self, step: int, optimizer) -> None:
        """New data: the loss statistics start over, and the optimizer's grad-norm statistics, which describe the
        old data too, warm up again. Until the loss statistics are warm, spikes are recorded but do not roll back."""
        optimizer.reset_grad_norm_stats()
        c = self.config
        self.loss_stats = LossStats(c.loss_alpha, c.loss_z, c.loss_warmup, c.loss_rel_floor)
        self.best_interval_loss = None
        self.grace_until = step + c.loss_warmup

    def _top_tensors(self, norms: list[float], names: list[str] | None) -> list[dict]:
        k = self.config.top_k
        if not k or not norms:
            return []
        # non-finite norms first (the tensors that overflowed), then the largest
        order = sorted(
            range(len(norms)), key=lambda i: (math.isfinite(norms[i]), -norms[i] if math.isfinite(norms[i]) else 0)
        )
        return [
            {"name": names[i] if names and i < len(names) else f"param[{i}]", "grad_norm": norms[i]} for i in order[:k]
        ]

    def _decide(self, alerts: list[Alert], in_grace: bool = False) -> Decision:
        """The policy's answer. Alerts the optimizer already handled (action "skipped") never escalate."""
        c = self.config
        if not alerts:
            return Decision()
        self.alerts_total += len(alerts)
        open_alerts = [a for a in alerts if a.action not in (ACTION_SKIPPED, ACTION_REBASELINE)]
        if in_grace:
            for alert in open_alerts:
                if alert.kind in _LR_KINDS:
                    alert.action = ACTION_WARN
            open_alerts = [a for a in open_alerts if a.kind not in _LR_KINDS]
        action, message = "continue", ""
        if open_alerts and c.policy in ("stop", "rollback"):
            if c.policy == "rollback" and self.rollbacks < c.max_rollbacks:
                action = ACTION_ROLLBACK
            else:
                action = ACTION_STOP
        for alert in open_alerts:
            if action == ACTION_ROLLBACK:
                alert.action = ACTION_ROLLBACK
            elif action == ACTION_STOP:
                alert.action = ACTION_GIVE_UP if c.policy == "rollback" else ACTION_STOP
            else:
                alert.action = ACTION_WARN
        first = open_alerts[0] if open_alerts else alerts[0]
        if action == ACTION_STOP:
            if c.policy == "rollback":
                message = (
                    f"guard: gave up at step {first.detected_at} after {self.rollbacks} rollback(s) "
                    f"(max_rollbacks={c.max_rollbacks}): training keeps spiking ({first.kind}); lower the lr "
                    "or inspect the data around the steps in alerts.jsonl, then continue with --resume latest"
                )
            else:
                message = (
                    f"guard: stopped at step {first.detected_at} ({first.kind}); a checkpoint was saved: "
                    "look at alerts.jsonl and curves.png, then continue with --resume latest"
                )
        cut_lr = action == ACTION_ROLLBACK and any(a.kind in _LR_KINDS for a in open_alerts)
        factor = 1.0
        if cut_lr:
            evaluated = any(a.kind in EVALUATED.values() for a in open_alerts)
            factor = c.eval_lr_factor if evaluated else c.lr_factor
        return Decision(action, alerts, message, cut_lr, factor)

    # ------------------------------------------------------------------------------------------ rollback
    def apply_rollback(
        self, optimizer, cut_lr: bool = True, to_step: int | None = None, lr_factor: float | None = None
    ) -> None:
        """After the trainer restored a checkpoint (of step `to_step`): count the rollback, scale the lr, re-read
        the restored optimizer's counters, and take the evaluations' bests back to `to_step`'s (a best of the
        undone steps is not the restored model's: docs/guard.md). The loss statistics are kept: they have
        absorbed the spike at a clipped value, so a new plateau stops alerting after a few checks."""
        if to_step is not None:
            self._rewind_evaluations(to_step)
        self.rollbacks += 1
        if cut_lr:  # by the decision's factor (lr_factor when none is given)
            self.lr_scale *= self.config.lr_factor if lr_factor is None else lr_factor
        self.after_rollback = True
        self.apply_lr(optimizer)
        self._rebaseline(optimizer)

    def _rewind_evaluations(self, to_step: int) -> None:
        """The bests as they were after the last evaluated check at or before `to_step`."""
        self.eval_history = [entry for entry in self.eval_history if entry[0] <= to_step]
        self.best_eval = dict(self.eval_history[-1][1]) if self.eval_history else {}

    def apply_lr(self, optimizer) -> None:
        """Every group's lr = its configured lr x lr_scale (a restored checkpoint may carry an older lr)."""
        if not self.base_lrs:
            return
        lrs = [base * self.lr_scale for base in self.base_lrs]
        if hasattr(optimizer, "set_base_lrs"):  # FusedAdamW: under lr_schedule the base lr, not the shown one
            optimizer.set_base_lrs(lrs)
            return
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {
            "loss_stats": self.loss_stats.state_dict(),
            "best_interval_loss": self.best_interval_loss,
            "best_eval": dict(self.best_eval),
            "eval_history": [[step, dict(best)] for step, best in self.eval_history],
            "grace_until": self.grace_until,
            "rollbacks": self.rollbacks,
            "lr_scale": self.lr_scale,
            "alerts_total": self.alerts_total,
            "base_lrs": list(self.base_lrs),
        }

    def load_state_dict(self, state: dict) -> None:
        self.loss_stats.load_state_dict(state["loss_stats"])
        self.best_interval_loss = state.get("best_interval_loss")
        self.best_eval = {k: float(v) for k, v in state.get("best_eval", {}).items()}
        self.eval_history = [
            [int(step), {k: float(v) for k, v in best.items()}] for step, best in state.get("eval_history", [])
        ]
        self.grace_until = int(state.get("grace_until", -1))
        self.rollbacks = int(state["rollbacks"])
        self.lr_scale = float(state["lr_scale"])
        self.alerts_total = int(state.get("alerts_total", 0))
        if state.get("base_lrs"):
            self.base_lrs = [float(x) for x in state["base_lrs"]]


def _configured_lrs(optimizer) -> list:
    """Each group's configured lr: FusedAdamW says it (`base_lrs()`); any other optimizer keeps it in `lr`, or,
    under one of torch's LR schedulers, in `initial_lr` (`lr` then shows the scheduled one)."""
    if hasattr(optimizer, "base_lrs"):
        return optimizer.base_lrs()
    return [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
