"""The training loop. Read `Trainer.fit` top to bottom: for each optimizer step, grad_accum micro-batches of
autocast forward -> loss / tokens in the window -> (scale) -> backward; then one fused step (clip, inf check,
schedule and AdamW inside FusedAdamW) -> scaler update -> zero_grad.

Nothing reads the device between logging steps: the window loss, grad norm, lr and skip flag of every step
are stacked on the device and read once per `logging_steps`. At each logging step the stability guard
(fused_stable.guard) and the callbacks see the interval and may answer "stop" or "rollback".

Evaluations (`evaluator`, fused_stable.train.evaluation.held_out.HeldOutLosses: `eval_loss`, `retention_loss`) are
scheduled like logging: before the first step (the guard's reference), then every `eval_steps` optimizer steps
(an evaluation step is a logging step), and under guard=rollback also at every checkpoint step, so that every
checkpoint a rollback can return to passed its evaluation. Each evaluation reads the device once; its values
go on the metrics row of the step it evaluated.

Under DeepSpeed (`engine`, `deepspeed_run`) every micro-batch's backward and step go through the engine,
which steps FusedAdamW at its accumulation boundary (the window's last micro-batch), and checkpoints are the
engine's.

An interrupt (SIGINT or SIGTERM, see `Interrupts`) ends the step under way, logs it, saves a checkpoint and
stops the loop (`stopped_by == "interrupt"`); under torchrun every rank stops after the same step.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from fused_stable.guard import Decision, Guard
from fused_stable.train.data import packing
from fused_stable.train.data.instructions import IGNORE_INDEX, BatchOrder
from fused_stable.train.evaluation.held_out import HeldOutLosses
from fused_stable.train.run import checkpoint, checkpoint_contents, parallel
from fused_stable.train.run.report import AlertLog, Reporter
from fused_stable.train.run.runtime import Runtime

# (step, optimizer, metrics of the latest step) -> None | "stop" | "rollback"
Callback = Callable[[int, torch.optim.Optimizer, dict], str | None]


class Interrupts:
    """SIGINT / SIGTERM for the duration of a `with` block.

    While `deferring` (set once the run starts writing), the first signal is only recorded: the loop
    finishes the optimizer step under way, saves a checkpoint and stops. Before that (nothing written yet),
    and for any second signal, it raises KeyboardInterrupt at once: a second Ctrl-C during the save
    abandons it (its temporary directory is removed; earlier checkpoints stay as they were).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, announce: bool = True):
        self.signum = 0  # the first signal received (or agreed on under torchrun); 0: none
        self.deferring = False
        self.announce = announce  # print a line when the first signal arrives (rank 0 only)
        self._previous: dict = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + (self.signum or signal.SIGINT)

    def _handle(self, signum, frame) -> None:
        first = not self.signum
        if first:
            self.signum = signum
        if first and self.deferring:
            if self.announce:
                print(
                    f"fused-stable sft: {signal.Signals(signum).name} received: finishing this step, then saving a "
                    "checkpoint (Ctrl-C again abandons the save)",
                    file=sys.stderr,
                    flush=True,
                )
            return
        raise KeyboardInterrupt


@dataclass
class _PendingLog:
    """The steps since the last logging step: their device values (read once, at the next logging step), their
    (step, elapsed_s, tokens), and the tokens and time the interval's tokens/s is measured over."""

    since: float
    values: list = field(default_factory=list)
    meta: list = field(default_factory=list)
    tokens: int = 0


@dataclass
class TrainState:
    """Where the run is; saved in every checkpoint. The data position is `micro_batches` (see BatchOrder)."""

    step: int = 0  # optimizer steps taken (skipped ones included)
    micro_batches: int = 0  # micro-batches consumed
    tokens: int = 0  # non-padding tokens seen
    elapsed_s: float = 0.0  # training time before this process started (resumed runs)
    rollbacks: int = 0
    eval_start: dict | None = None  # the held-out losses before the first step (the guard's reference)


@dataclass
class Trainer:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    batches: BatchOrder
    runtime: Runtime
    reporter: Reporter | None
    output_dir: str
    config: dict  # the run's config (stored in checkpoints)
    total_steps: int
    grad_accum: int
    logging_steps: int
    save_steps: int
    save_total_limit: int = 0
    callbacks: list[Callback] = field(default_factory=list)
    guard: Guard | None = None
    evaluator: HeldOutLosses | None = None  # eval_loss / retention_loss during training (None: not measured)
    eval_steps: int = (
        0  # evaluate every N optimizer steps (0: only before the first step and, under rollback, at checkpoints)
    )
    eval_seconds: float = 0.0  # time spent evaluating during fit (this process)
    evaluations: int = 0  # evaluations during fit (this process)
    alert_log: AlertLog | None = None
    interrupts: Interrupts | None = None
    engine: object | None = (
        None  # fused_stable.train.run.deepspeed_run.Engine: the loop runs through DeepSpeed (model: its engine)
    )
    attention: packing.PackedAttention | None = None  # packed rows: how they reach the model (None: not packed)
    state: TrainState = field(default_factory=TrainState)
    stopped_by: str | None = None  # "guard" | "callback" | "interrupt"
    stop_message: str = ""
    last_checkpoint: str | None = None  # the path of the newest checkpoint this process saved
    _fit_started: float | None = field(default=None, init=False, repr=False)  # perf_counter() at fit start

    def elapsed(self) -> float:
        """Training time of the whole run: before this process (from the checkpoint) plus this fit so far."""
        running = time.perf_counter() - self._fit_started if self._fit_started is not None else 0.0
        return self.state.elapsed_s + running

    # --------------------------------------------------------------------------------------------- the loop
    def fit(self) -> TrainState:
        """Train to total_steps (or until the guard, a callback or an interrupt stops the run); each step reads
        as its named parts: the window's forward and backward, the optimizer step, the step counted, and at a
        logging step the one device read, the evaluation, the guard and the callbacks."""
        self.evaluate_start()  # a no-op when done already (the command does it before it times training)
        self.model.train()
        self._fit_started = time.perf_counter()
        log = _PendingLog(since=self._fit_started)
        needs_rollback_target = self.guard is not None and self.guard.config.policy == "rollback"
        if needs_rollback_target and not checkpoint.latest_checkpoint(self.output_dir):
            self.save()  # a rollback needs a good state to go back to, from the first step on
        while self.state.step < self.total_steps:
            window = [self.batches.batch(self.state.micro_batches + i) for i in range(self.grad_accum)]
            window_loss = self._forward_backward(window)
            self._optimizer_step()
            self._count_step(window, window_loss, log)
            signum = self._agreed_signal()
            if self._logging_step() or signum:  # an interrupt logs the steps since the last log first
                action = self._log_and_decide(log, signum)
                if action == "stop":
                    break
                if action == "rollback" and not signum:
                    continue
            if self.save_steps and self.state.step % self.save_steps == 0 or signum:
                self.save()
            if signum:
                self.stopped_by = "interrupt"
                break
        self.state.elapsed_s = self.elapsed()
        self._fit_started = None
        return self.state

    def _forward_backward(self, window: list) -> torch.Tensor:
        """Every micro-batch of the window: autocast forward, its summed loss over the window's label tokens,
        (scaled) backward. Returns the window's loss, on the device."""
        model, scaler, device = self.model, self.scaler, self.runtime.device
        # the loss is the mean over every label token of the window, so each micro-batch's summed loss is
        # divided by the window's token count (a host int), not averaged per micro-batch
        label_tokens = max(1, sum(b.num_label_tokens for b in window))
        window_loss = torch.zeros((), device=device)
        for batch in window:
            parallel.set_grad_sync(model, batch is window[-1])  # torchrun/DDP: all-reduce once per window
            inputs = packing.model_inputs(batch, device, self.attention)  # packed rows: positions, neat mask
            labels = batch.labels.to(device, non_blocking=True)
            with self.runtime.autocast():
                logits = model(**inputs).logits
            loss = (
                F.cross_entropy(
                    logits[:, :-1].float().reshape(-1, logits.size(-1)),
                    labels[:, 1:].reshape(-1),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
                / label_tokens
            )
            if self.engine is not None:
                self.engine.backward(loss)
                self.engine.step()  # the window's last micro-batch is the engine's boundary: the fused step
            else:
                (scaler.scale(loss) if scaler is not None else loss).backward()
            window_loss += loss.detach()
        return window_loss

    def _optimizer_step(self) -> None:
        """The fused step (clip, inf check, schedule and AdamW inside FusedAdamW), the scaler's update, zero_grad."""
        opt, scaler = self.optimizer, self.scaler
        if self.engine is not None:
            self.engine.check_step(self.state.step + 1)  # DeepSpeed zeroed the grads at its boundary
        elif scaler is not None:
            scaler.step(opt)  # FusedAdamW unscales, checks inf/nan and clips in its own norm pass
            scaler.update()
        else:
            opt.step()
        if self.engine is None:
            opt.zero_grad(set_to_none=True)

    def _count_step(self, window: list, window_loss: torch.Tensor, log: _PendingLog) -> None:
        """The step is done: count it, and keep its device values for the next logging step (no read here)."""
        opt = self.optimizer
        self.state.step += 1
        self.state.micro_batches += self.grad_accum
        window_tokens = sum(b.num_tokens for b in window)
        self.state.tokens += window_tokens
        log.tokens += window_tokens
        log.values.append(
            torch.stack(
                [
                    window_loss,
                    opt.grad_norm.float(),
                    opt.last_lr.float(),
                    opt.last_step_skipped.float(),
                    opt.skipped_steps.float() + opt.spike_skips.float(),
                ]
            )
        )
        log.meta.append((self.state.step, self.elapsed(), window_tokens))

    def _agreed_signal(self) -> int:
        """torchrun: a signal on any rank stops every rank after this same step (a CPU all-reduce)."""
        signum = parallel.agree_signal(self.interrupts.signum if self.interrupts is not None else 0)
        if signum and self.interrupts is not None:
            self.interrupts.signum = self.interrupts.signum or signum
        return signum

    def _log_and_decide(self, log: _PendingLog, signum: int) -> str | None:
        """A logging step: the interval's rows (one device read), the evaluation when one is due, the report, then
        the guard and the callbacks. Returns "stop" (saved, the run ends), "rollback" (done) or None."""
        rows = self._read_rows(log)
        if self._evaluation_step() and not signum:  # an interrupt saves at once
            rows[-1].update(self._evaluate())
            self.evaluations += 1
            log.since = time.perf_counter()  # the next interval's tokens/s leaves the evaluation out
        log.tokens = 0
        if self.reporter is not None:
            self.reporter.log(rows)
        decision = self._run_guard(rows)
        action = self._run_callbacks(rows[-1])
        if "stop" in (decision.action, action):
            self.save()
            self.stopped_by = "guard" if decision.action == "stop" else "callback"
            self.stop_message = decision.message
            return "stop"
        if "rollback" in (decision.action, action):
            self.rollback()
            if self.guard is not None:
                self.guard.apply_rollback(
                    self.optimizer, decision.cut_lr, to_step=self.state.step, lr_factor=decision.lr_factor
                )
            if self.reporter is not None:
                self.reporter.rewind(self.state.step)
            return "rollback"
        return None

    def _read_rows(self, log: _PendingLog) -> list[dict]:
        """The one device read of this interval (torchrun: with the loss averaged and the tokens summed over the
        ranks by one all-reduce): one metrics row per step since the last log."""
        values, log.tokens = parallel.read_for_logging(torch.stack(log.values), log.tokens)
        now = time.perf_counter()
        tokens_per_s = log.tokens / max(now - log.since, 1e-9)
        rows = [
            {
                "step": step,
                "loss": v[0],
                "grad_norm": v[1],
                "lr": v[2],
                "skipped": bool(v[3]),
                "skipped_total": int(v[4]),
                "tokens_per_s": tokens_per_s,
                "elapsed_s": elapsed,
            }
            for v, (step, elapsed, _) in zip(values, log.meta)
        ]
        if self.scaler is not None:
            rows[-1]["loss_scale"] = self.scaler.get_scale()
        log.values.clear()
        log.meta.clear()
        log.since = now
        return rows

    # --------------------------------------------------------------------------------------------- seams
    def _logging_step(self) -> bool:
        step = self.state.step
        if step % self.logging_steps == 0 or step == self.total_steps or self._evaluation_step():
            return True
        # a checkpoint is what a rollback returns to: the guard looks at the steps before it is written
        return self.guard is not None and bool(self.save_steps) and step % self.save_steps == 0

    def _evaluation_step(self) -> bool:
        if self.evaluator is None:
            return False
        step = self.state.step
        if self.eval_steps and step % self.eval_steps == 0:
            return True
        # under rollback a checkpoint is a rollback target: it is written only after its evaluation passed
        rolling_back = self.guard is not None and self.guard.config.policy == "rollback"
        return rolling_back and bool(self.save_steps) and step % self.save_steps == 0

    def _evaluate(self) -> dict:
        """The held-out losses now (one device read), timed; the console and TensorBoard get them."""
        started = time.perf_counter()
        values = self.evaluator.measure(self.model, self.runtime.autocast)
        seconds = time.perf_counter() - started
        self.eval_seconds += seconds
        if self.reporter is not None and self.runtime.is_main:
            self.reporter.evaluation(self.state.step, values, seconds)
        return values

    def evaluate_start(self) -> dict | None:
        """The held-out losses of the model before its first step, once per run (kept in checkpoints): the
        guard's reference for a rise (for retention_loss: the base model's loss on its own answers)."""
        if self.evaluator is None or self.state.step != 0 or self.state.eval_start is not None:
            return None
        seconds_before = self.eval_seconds
        self.state.eval_start = self._evaluate()
        self.eval_seconds = seconds_before  # before training: not part of the cost during training
        if self.guard is not None:
            self.guard.eval_reference(self.state.eval_start)
        return self.state.eval_start

    def _run_guard(self, rows: list[dict]) -> Decision:
        if self.guard is None:
            return Decision()
        decision = self.guard.check(self.state.step, self.optimizer, rows)
        if decision.alerts and self.runtime.is_main:
            if self.alert_log is not None:
                self.alert_log.write(decision.alerts)
            if self.reporter is not None:
                self.reporter.alerts(decision.alerts)
        return decision

    def _run_callbacks(self, metrics: dict) -> str | None:
        action = None
        for callback in self.callbacks:
            answer = callback(self.state.step, self.optimizer, metrics)
            if answer not in (None, "continue", "stop", "rollback"):
                raise ValueError(f"a training callback returned {answer!r}; expected None, 'stop' or 'rollback'")
            if answer in ("stop", "rollback"):
                action = answer if action != "stop" else action  # stop wins over rollback
        return action

    def save(self) -> str | None:
        """Every rank: a checkpoint of this step (`checkpoint_contents.save`); its path on rank 0."""
        path = checkpoint_contents.save(self)
        self.last_checkpoint = path or self.last_checkpoint
        return path

    def restore(self, path: str, restore_data_position: bool = True) -> None:
        """Load a checkpoint into the live model, optimizer, scaler and RNGs (resume, or a rollback)."""
        saved = checkpoint_contents.load(self, path)
        before = self.state
        self.state = TrainState(**{k: saved[k] for k in asdict(TrainState()) if k in saved})
        if not restore_data_position:
            # a rollback: the data, tokens and time already spent stay spent (the guard keeps its own count)
            self.state.micro_batches, self.state.tokens = before.micro_batches, before.tokens
            self.state.elapsed_s = before.elapsed_s
        elif self.guard is not None and "guard" in saved:
            self.guard.load_state_dict(saved["guard"])
            self.guard.resync(self.optimizer)

    def rollback(self) -> None:
        """Back to the newest complete checkpoint, keeping the data position: the window that caused the
        trouble is not replayed. A damaged checkpoint is passed over (and said so) for the newest that verifies;
        with none there is nothing to roll back to."""
        path, passed_over = checkpoint.latest_verified_checkpoint(self.output_dir)
        if self.reporter is not None:
            for reason in passed_over:
                self.reporter.message(f"rollback: passed over a damaged checkpoint: {reason}")
        if path is None:
            raise RuntimeError("rollback requested but no complete checkpoint exists yet")
        rollbacks = self.state.rollbacks + 1
        self.restore(path, restore_data_position=False)
        self.state.rollbacks = rollbacks
