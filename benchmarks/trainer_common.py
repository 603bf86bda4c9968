"""What the two trainer benchmarks share (gpu_trainer.py on a GPU, trainer_vs_hf.py on CPU): `fused-stable sft`
and `transformers.Trainer` on the same job, timed the same way.

- `sft_setup(argv)`: the fused-stable trainer built by its own Python API (`fused_stable.train.run.sft.setup_run`:
  config, model, adapters, data, FusedAdamW, schedule), nothing started.
- `hf_trainer(setup, out_dir)`: a `transformers.Trainer` on the *same* model object, fed the fused-stable
  trainer's own micro-batches (`setup.trainer.batches`) in the same order, with the same step count,
  accumulation, lr, schedule and warm-up, clip, weight decay and precision, and `optim="adamw_torch_fused"`.
- `StepClock` with `clock_fused` / `clock_hf`: step boundaries and the optimizer phase of each step, as CUDA
  events on a GPU (no host sync while training; read once at the end) or `time.perf_counter` on CPU.
- `MemoryWatch`: peak allocated device memory (CUDA), or the peak resident set growth (CPU, sampled).

Nothing here changes either trainer: the fused-stable trainer is timed by wrapping its optimizer's `step` (an
instance attribute, as tests/train/test_loop_host_reads.py does), the HF Trainer by a wrapped `training_step` and
a `TrainerCallback`.
"""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from dataclasses import dataclass

import torch

# the HF Trainer names of the fused-stable schedules (both warm up linearly from 0 over int(ratio x steps))
HF_SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


# ------------------------------------------------------------------------------------------------ building
def sft_setup(argv: list[str]):
    """The fused-stable run for these flags, built and checked, nothing written (a `RunSetup`)."""
    from fused_stable.cli import offline_environment
    from fused_stable.train.run import runtime, sft

    offline_environment()
    runtime.quiet_third_party_noise()
    return sft.setup_run([str(a) for a in argv])


def fit(setup):
    """Start the run (manifest, run.yaml, reporter) and train it; the final adapter is not saved."""
    setup.start()
    try:
        return setup.trainer.fit()
    finally:
        setup.trainer.reporter.close()


def window_tokens(setup) -> list[int]:
    """Non-padding tokens of each optimizer step's window, from the trainer's own batch order (host ints)."""
    trainer = setup.trainer
    batches, accum = trainer.batches, trainer.grad_accum
    return [sum(batches.batch(s * accum + i).num_tokens for i in range(accum)) for s in range(trainer.total_steps)]


def trainable_fingerprint(model) -> float:
    """A float64 sum over the trainable tensors: equal for two models built the same way (initial weights)."""
    total = 0.0
    for p in model.parameters():
        if p.requires_grad:
            total += float(p.detach().double().abs().sum()) + float(p.detach().double().sum())
    return total


class _MicroBatches(torch.utils.data.IterableDataset):
    """The fused-stable trainer's micro-batches k = 0, 1, 2, ... (each already `batch_size` rows, padded, with
    the prompt masked in the labels), for a DataLoader with batch_size=1 and `_first_item` as its collator."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        k = 0
        while True:  # BatchOrder goes on into new epochs; the Trainer stops at max_steps
            b = self.batches.batch(k)
            yield {"input_ids": b.input_ids, "attention_mask": b.attention_mask, "labels": b.labels}
            k += 1


def _first_item(items: list[dict]) -> dict:
    return items[0]


def hf_training_arguments(setup, out_dir: str, logging_steps: int | None = None):
    """TrainingArguments for the same job as the fused-stable run `setup` (see the module doc)."""
    from transformers import TrainingArguments

    from fused_stable.train.config.resolve import warmup_steps

    cfg, runtime, trainer = setup.cfg, setup.runtime, setup.trainer
    total = trainer.total_steps
    on_cpu = runtime.device.type == "cpu"
    return TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=1,  # one item = one fused-stable micro-batch of cfg.batch_size rows
        gradient_accumulation_steps=cfg.grad_accum,
        max_steps=total,
        learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay,
        lr_scheduler_type=HF_SCHEDULERS[cfg.scheduler],
        warmup_steps=warmup_steps(cfg, total),  # what setup_run gives FusedAdamW's schedule
        max_grad_norm=cfg.max_grad_norm or 0.0,
        optim="adamw_torch_fused",
        bf16=runtime.precision == "bf16",
        fp16=runtime.precision == "fp16",
        logging_strategy="steps",
        logging_steps=logging_steps or total,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=not on_cpu,
        use_cpu=on_cpu,
        seed=cfg.seed,
        # gradient checkpointing: left off here; the model already has it when the run asks for it
        # (fused_stable's apply_tuner), so both trainers recompute the same activations
        # the iterable dataset is read in this process as it is; accelerate must not re-batch it
        accelerator_config={"dispatch_batches": False},
    )


def hf_trainer(setup, out_dir: str, logging_steps: int | None = None, callbacks=()):
    """A transformers.Trainer that trains `setup.model` on `setup.trainer.batches` (see the module doc)."""
    from transformers import Trainer

    return Trainer(
        model=setup.model,
        args=hf_training_arguments(setup, out_dir, logging_steps),
        train_dataset=_MicroBatches(setup.trainer.batches),
        data_collator=_first_item,
        callbacks=list(callbacks),
    )


def hf_losses(hf) -> list[float]:
    """The per-interval mean losses the HF Trainer logged (its log_history)."""
    return [float(row["loss"]) for row in hf.state.log_history if "loss" in row]


# ------------------------------------------------------------------------------------------------ timing
@dataclass
class _Mark:
    kind: str  # "opt_start" (the optimizer phase begins) | "post" (the optimizer step has been issued)
    token: object  # a recorded torch.cuda.Event, or a perf_counter() value


class StepClock:
    """Timestamps of step boundaries without a host sync: CUDA events (read after one synchronize at the end)
    or, on CPU, where every op is done when it returns, perf_counter()."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[_Mark] = []

    def mark(self, kind: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(_Mark(kind, event))
        else:
            self.marks.append(_Mark(kind, time.perf_counter()))

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def steps(self) -> list[tuple[object, object]]:
        """(optimizer phase start, step end) per optimizer step, in order."""
        if self.cuda:
            torch.cuda.synchronize()
        out, start = [], None
        for m in self.marks:
            if m.kind == "opt_start":
                start = m.token  # the latest one before the step: the window's last micro-batch
            elif m.kind == "post":
                out.append((start if start is not None else m.token, m.token))
                start = None
        return out

    def summary(self, tokens_per_step: list[int], warmup: int) -> dict:
        """Throughput over the steps after `warmup` (>= 1: the first step allocates state and compiles):
        tokens/s from the first timed step's start (the end of step `warmup`) to the last step's end; median
        step time; the optimizer phase's median time and its share of the timed steps' total time."""
        steps = self.steps()
        if warmup < 1 or len(steps) <= warmup:
            raise ValueError(f"need more than {warmup} steps to time after a warm-up of {warmup}, got {len(steps)}")
        timed = range(warmup, len(steps))
        step_ms = [self._ms(steps[i - 1][1], steps[i][1]) for i in timed]
        opt_ms = [self._ms(steps[i][0], steps[i][1]) for i in timed]
        total_ms = self._ms(steps[warmup - 1][1], steps[-1][1])
        tokens = sum(tokens_per_step[i] for i in timed)
        return {
            "timed_steps": len(step_ms),
            "tokens_per_s": tokens / (total_ms / 1e3),
            "step_ms": statistics.median(step_ms),
            "step_ms_min": min(step_ms),
            "step_ms_max": max(step_ms),
            "optimizer_ms": statistics.median(opt_ms),
            "optimizer_share": sum(opt_ms) / sum(step_ms),
            "tokens_per_step": statistics.median(tokens_per_step[i] for i in timed),
        }


def clock_fused(setup, clock: StepClock) -> None:
    """Mark the fused-stable trainer's optimizer phase: FusedAdamW.step (norm, clip, inf/NaN skip, AdamW and
    the schedule in one fused step; under fp16 the GradScaler calls it). The loop calls `opt.step()`, so an
    instance attribute wraps it without registering an optimizer hook (a hook would change the step's path)."""
    opt = setup.trainer.optimizer
    real_step = opt.step

    def step(*args, **kwargs):
        clock.mark("opt_start")
        result = real_step(*args, **kwargs)
        clock.mark("post")
        return result

    opt.step = step


def clock_hf(hf, clock: StepClock) -> None:
    """Mark the HF Trainer's optimizer phase: from the end of the window's last micro-batch (`training_step`
    returns after its backward) through its loss bookkeeping, `clip_grad_norm_` and `AdamW(fused).step()`
    (the `on_optimizer_step` callback)."""
    from transformers import TrainerCallback

    real_training_step = hf.training_step

    def training_step(*args, **kwargs):
        loss = real_training_step(*args, **kwargs)
        clock.mark("opt_start")  # only the last micro-batch's mark before a step counts
        return loss

    class _OptimizerStepEnd(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            clock.mark("post")

    hf.training_step = training_step
    hf.add_callback(_OptimizerStepEnd())


# ------------------------------------------------------------------------------------------------ memory
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemoryWatch:
    """`with MemoryWatch(device) as mem:` ... then `mem.result()`: on CUDA the peak of
    `torch.cuda.max_memory_allocated` inside the block (peak stats reset at entry, after freeing what earlier
    blocks left); on CPU the peak resident set size sampled every 10 ms, minus the size at entry."""

    def __init__(self, device: torch.device, interval_s: float = 0.01):
        self.cuda = device.type == "cuda"
        self.interval_s = interval_s
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> MemoryWatch:
        if self.cuda:
            gc.collect()  # what earlier blocks left behind; on CPU a collection costs ~1 s and frees no RSS
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self.peak = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.peak = torch.cuda.max_memory_allocated()
            self.peak_reserved = torch.cuda.max_memory_reserved()
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss_bytes())

    def result(self) -> dict:
        if self.cuda:
            return {
                "memory": "cuda max_memory_allocated",
                "peak_mib": self.peak / 2**20,
                "at_start_mib": self.base / 2**20,
                "peak_reserved_mib": self.peak_reserved / 2**20,
            }
        return {"memory": "peak RSS growth (sampled)", "peak_mib": (self.peak - self.base) / 2**20}


def free_device_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back, so the next run's peak starts from what is really held."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ------------------------------------------------------------------------------------------------ results
def versions(names=("transformers", "peft", "bitsandbytes", "accelerate")) -> dict:
    """Installed versions of the libraries both trainers run on ("not installed" for a missing one)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def table_header(columns: list[str]) -> list[str]:
    """The two header lines of a markdown table."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def write_results(result: dict, markdown_text: str, out_dir, name: str):
    """NAME.json (strict JSON) and NAME.md in out_dir, each replaced whole (a reader never sees half a file)."""
    from pathlib import Path

    from fused_stable import strict_json

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / f"{name}.json", out_dir / f"{name}.md"
    for path, text in zip(paths, (strict_json.dumps(result, indent=1) + "\n", markdown_text)):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return paths
