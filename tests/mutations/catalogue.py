"""One-line bugs planted by `run.py`, each with the test files that must catch it.

`old` must occur exactly once in `file` (else the mutation is reported stale: the code moved, update the
entry). `select` narrows the run to matching tests (`pytest -k`), to keep the check fast. `survives` is the
written reason for a mutation that no test can catch (empty: it must be caught).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str
    old: str
    new: str
    tests: list[str] = field(default_factory=list)
    what: str = ""            # the documented behaviour the mutation breaks
    select: str | None = None
    survives: str = ""


M = Mutation
TRAIN = "fused_stable/train/"

MUTATIONS: list[Mutation] = [
    # ------------------------------------------------------------------ no host reads
    M("loop-loss-read-per-micro-batch", TRAIN + "loop.py",
      "window_loss += loss.detach()", "window_loss += loss.detach().item()",
      ["tests/train/test_loop_host_reads.py"], "the loss is read once per logging interval, not per micro-batch",
      select="fp32"),
    M("loop-skip-flag-read-per-step", TRAIN + "loop.py",
      "            if self.guard is not None:\n                self.guard.observe_step(",
      "            if bool(opt.last_step_skipped) or self.guard is not None:\n                self.guard.observe_step(",
      ["tests/train/test_loop_host_reads.py"], "nothing read between logging steps", select="fp32"),
    M("guard-observe-step-reads", "fused_stable/guard.py",
      "        worse = key > self._worst_key\n", "        worse = key > self._worst_key\n        bool(worse)\n",
      ["tests/test_guard.py", "tests/test_host_reads.py"], "observe_step is device work only"),
    # ------------------------------------------------------------------ guard thresholds
    M("guard-grad-ratio-ignored", "fused_stable/guard.py",
      "(not c.grad_ratio or max_z_norm >= c.grad_ratio * norm_mean)", "(True or max_z_norm >= c.grad_ratio * norm_mean)",
      ["tests/test_thresholds.py"], "a grad-norm alert needs norm >= guard_grad_ratio x running mean"),
    M("guard-grad-z-ge", "fused_stable/guard.py",
      "if max_z > c.grad_z and", "if max_z >= c.grad_z and",
      ["tests/test_thresholds.py"], "grad-norm alert at z > guard_grad_z (docs/guard.md: z > 6)"),
    M("guard-loss-z-ge", "fused_stable/guard.py",
      "elif z > c.loss_z:", "elif z >= c.loss_z:",
      ["tests/test_thresholds.py"], "loss alert at z > guard_loss_z"),
    M("guard-config-drops-ratio", TRAIN + "config.py",
      "grad_ratio=cfg.guard_grad_ratio,", "",
      ["tests/train/test_trainer_promises.py"], "--guard_grad_ratio reaches the guard", select="guard_key"),
    # ------------------------------------------------------------------ checkpoints
    M("checkpoint-never-prunes", TRAIN + "checkpoint.py",
      "    if keep > 0:\n", "    if keep < 0:\n",
      ["tests/train/test_trainer_promises.py"], "save_total_limit keeps the newest N", select="save_total_limit"),
    M("checkpoint-file-not-fsynced", TRAIN + "checkpoint.py",
      "        torch.save(obj, f)\n        f.flush()\n        os.fsync(f.fileno())",
      "        torch.save(obj, f)\n        f.flush()",
      ["tests/train/test_trainer_promises.py"], "every checkpoint file is fsynced", select="fsynced"),
    M("checkpoint-weights-not-fsynced", TRAIN + "checkpoint.py",
      "        _fsync_path(os.path.join(tmp, \"weights.safetensors\"))\n", "",
      ["tests/train/test_trainer_promises.py"], "every checkpoint file is fsynced", select="fsynced"),
    M("checkpoint-dir-not-fsynced", TRAIN + "checkpoint.py",
      "        os.rename(tmp, final)\n        _fsync_path(root)\n", "        os.rename(tmp, final)\n",
      ["tests/train/test_trainer_promises.py"], "the rename is made durable before the marker", select="fsynced"),
    M("checkpoint-scaler-not-restored", TRAIN + "checkpoint.py",
      "if scaler is not None and os.path.isfile(scaler_path):", "if False:",
      ["tests/train/test_trainer_promises.py"], "--resume restores the GradScaler's scale and growth tracker",
      select="scaler"),
    M("checkpoint-marker-never-written", TRAIN + "checkpoint.py",
      "_write_bytes(os.path.join(final, COMPLETE_MARKER), json.dumps(marker, indent=1).encode())",
      "None",
      ["tests/train/test_checkpoint.py"], "a checkpoint is complete only with its marker",
      select="mid_save or rollback_restores"),
    # ------------------------------------------------------------------ the model side of the trainer
    M("decay-on-norms-and-biases", TRAIN + "model.py",
      "elif p.ndim < 2 or \"lora_magnitude_vector\" in name:", "elif \"lora_magnitude_vector\" in name:",
      ["tests/train/test_trainer_promises.py"], "no weight decay on norms and biases", select="decay"),
    M("decay-on-dora-magnitudes", TRAIN + "model.py",
      "elif p.ndim < 2 or \"lora_magnitude_vector\" in name:", "elif p.ndim < 2:",
      ["tests/train/test_trainer_promises.py"], "no weight decay on DoRA magnitudes", select="decay",
      survives="equivalent: peft keeps a Linear layer's DoRA magnitude as a 1-D vector, so `p.ndim < 2` alone "
               "already exempts it (test_weight_decay_spares_dora_magnitudes checks the outcome)"),
    M("gradient-checkpointing-ignored", TRAIN + "model.py",
      "    if cfg.gradient_checkpointing:\n", "    if False:\n",
      ["tests/train/test_trainer_promises.py"], "--gradient_checkpointing true recomputes activations",
      select="checkpointing"),
    # ------------------------------------------------------------------ data
    M("sharegpt-gpt-untrained", TRAIN + "data.py",
      "\"gpt\": (\"Assistant\", True),", "\"gpt\": (\"Assistant\", False),",
      ["tests/train/test_trainer_promises.py", "tests/train/test_data.py"], "ShareGPT gpt turns are trained"),
    M("sharegpt-assistant-untrained", TRAIN + "data.py",
      "\"assistant\": (\"Assistant\", True),", "\"assistant\": (\"Assistant\", False),",
      ["tests/train/test_trainer_promises.py"], "ShareGPT assistant turns (role/content) are trained",
      select="sharegpt"),
    M("labels-all-masked", TRAIN + "data.py",
      "labels += piece if trained else [IGNORE_INDEX] * len(piece)", "labels += [IGNORE_INDEX] * len(piece)",
      ["tests/train/test_data.py"], "answers carry labels"),
    # ------------------------------------------------------------------ integrations
    M("hf-mixin-grad-norm-pass-kept", "fused_stable/integrations/hf.py",
      "        if grad_norm is None and find_fused_optimizer(getattr(self, \"optimizer\", None)) is not None:\n",
      "        if False:\n",
      ["tests/integrations/test_integ_hf_trainer.py"], "the mixin removes transformers' extra grad-norm pass",
      select="same_trajectory or mixin"),
    # ------------------------------------------------------------------ the optimizer
    M("torch-step-equal-sync", "fused_stable/backends/torch_backend.py",
      "    torch._foreach_add_(lists.steps, 1.0 - skip)\n",
      "    torch._foreach_add_(lists.steps, 1.0 - skip)\n    torch.equal(skip, skip)\n",
      ["tests/test_host_reads.py"], "the CPU step makes no host read (torch.equal returns a Python bool)",
      select="torch"),
    M("torch-spike-skip-ge", "fused_stable/backends/torch_backend.py",
      "spike_skip = is_spike & (zscore > rules.spike_skip_threshold)",
      "spike_skip = is_spike & (zscore >= rules.spike_skip_threshold)",
      ["tests/test_thresholds.py"], "spike_skip_threshold skips steps above it", select="torch"),
    M("torch-zscore-spike-ge", "fused_stable/backends/torch_backend.py",
      "is_spike = ready & finite & (zscore > rules.zscore_threshold)",
      "is_spike = ready & finite & (zscore >= rules.zscore_threshold)",
      ["tests/test_thresholds.py"], "a spike is a z-score above zscore_threshold", select="torch"),
    M("kernel-spike-skip-ge", "fused_stable/kernels/adamw.py",
      "(zscore > spike_skip_threshold)", "(zscore >= spike_skip_threshold)",
      ["tests/test_thresholds.py"], "spike_skip_threshold skips steps above it (kernel)", select="interpret"),
    M("kernel-zscore-spike-ge", "fused_stable/kernels/adamw.py",
      "is_spike = stats_ready & ~nonfinite & (zscore > zscore_threshold)",
      "is_spike = stats_ready & ~nonfinite & (zscore >= zscore_threshold)",
      ["tests/test_thresholds.py"], "a spike is a z-score above zscore_threshold (kernel)", select="interpret"),
    M("applied-steps-not-recovered", "fused_stable/optim.py",
      "self._istate[layout.I_APPLIED_STEPS] = int(max(steps, default=0.0))", "pass",
      ["tests/test_resume_counters.py"], "a state without counters continues the schedule (DCP helpers)"),
]
