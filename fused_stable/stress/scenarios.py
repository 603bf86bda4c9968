"""The stress suite's settings and failure scenarios: `StressConfig` (the tiny suite's defaults, and
`REAL_MODEL_DEFAULTS` for a pretrained model), and each `Scenario`'s fault, keyed by the data position
(micro-batch index) so that both recipes meet it at the same batch and a rolled-back run does not meet it
again: a too-high lr, a poisoned batch, an fp16 overflow storm, a NaN loss, a shift of the data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fused_stable.guard import GuardConfig


@dataclass
class StressConfig:
    model: str = "tiny"  # tiny (the embedded scratch Llama, full fine-tuning) or any sft --model (LoRA)
    optim: str = "adamw"  # the update rule of both recipes: adamw | lion | muon (sft's --optim; runs.RULES)
    state_precision: str = "fp32"  # the guarded recipe's optimizer state: fp32 | bf16 | 8bit (sft's key)
    steps: int = 120  # optimizer steps per run (one micro-batch each)
    batch_size: int = 8
    max_length: int = 96  # TINY_MIN_LENGTH on the tiny model
    lr: float = 1e-3  # a sane peak lr for fine-tuning the pre-trained tiny model
    pretrain_steps: int = 200  # the base: the embedded tiny Llama first trained on the task (shared by every run)
    pretrain_lr: float = 3e-3
    warmup_steps: int = 10
    log_every: int = 5  # the guard reads the device every log_every steps
    snapshot_every: int = 20  # the guarded recipe keeps a rollback snapshot taken at a clean check this often
    max_rollbacks: int = 5
    zscore_warmup: int = 25  # steps of grad norms the guarded optimizer collects before it can call one a spike
    lr_multiplier: float = 50.0  # lr_too_high: the peak lr this many times too high
    poison_weight: float = 1e4  # poisoned_batch: the loss weight of the corrupt batch
    seed: int = 0
    threads: int = 1
    examples: int = 2000  # tiny: built-in examples; a pretrained model: general examples mixed into its task
    eval_rise: float = GuardConfig.eval_rise  # the guarded recipe's rise factor for eval/retention loss


TINY_MIN_LENGTH = 96  # the tiny model's built-in prompts are this long

# the real-model suite's setup (`--model` other than tiny): LoRA on the identity task of `fused-stable sft`, sized to
# fit about 15 minutes on 2 CPU cores (12 runs and their evaluations; measured on this project's machine: a step of
# 2 x 64 tokens ~1.5 s, an evaluation ~25 s); the faults sit in the middle, after the guarded optimizer's norm
# statistics have warmed up
REAL_MODEL_DEFAULTS = dict(
    steps=24,
    batch_size=2,
    max_length=64,
    lr=1e-3,
    pretrain_steps=0,
    warmup_steps=3,
    log_every=5,
    snapshot_every=5,
    max_rollbacks=3,
    zscore_warmup=8,
    lr_multiplier=30.0,
    poison_weight=1e3,
    examples=50,
)


def is_real(cfg: StressConfig) -> bool:
    return cfg.model != "tiny"


@dataclass
class Scenario:
    name: str
    description: str
    lr_multiplier: float = 1.0
    fp16: bool = False
    # data-position keyed faults
    poison_at: int | None = None  # this micro-batch has garbage labels and a x poison_weight loss
    poison_weight: float = 1e4
    nan_at: int | None = None  # this micro-batch's loss becomes NaN
    storm: tuple[int, int] | None = None  # [start, end): losses x 2**storm_exponent before scaling (fp16 overflow)
    storm_exponent: int = 40
    shift_at: int | None = None  # from this micro-batch on, batches come from the shifted task

    @property
    def ends_on_other_data(self) -> bool:
        """Its final loss is measured on other data than the clean run's: not comparable with it."""
        return self.shift_at is not None

    def batches(self, items: list, shifted_items: list, tokenizer, cfg: StressConfig) -> Callable[[int], object]:
        """Micro-batch k of a run of this scenario (the same for both recipes): from the shifted task from
        `shift_at` on, and with random labels at `poison_at`."""
        from fused_stable.train.data import instructions

        pad = tokenizer.pad_token_id
        normal = instructions.BatchOrder(items, cfg.batch_size, cfg.seed, pad)
        shifted = instructions.BatchOrder(shifted_items, cfg.batch_size, cfg.seed, pad)
        vocab = len(tokenizer)

        def batch(k: int):
            b = (shifted if self.shift_at is not None and k >= self.shift_at else normal).batch(k)
            if self.poison_at == k:
                gen = torch.Generator().manual_seed(cfg.seed + k)
                random_labels = torch.randint(3, vocab, b.labels.shape, generator=gen)
                b.labels = torch.where(b.attention_mask.bool(), random_labels, b.labels)
                b.num_label_tokens = int((b.labels[:, 1:] != instructions.IGNORE_INDEX).sum())
            return b

        return batch

    def train_loss(self, loss: torch.Tensor, k: int) -> torch.Tensor:
        """The loss a run backpropagates at micro-batch k: `loss` with this scenario's fault, if it has one there."""
        if self.poison_at == k:
            loss = loss * self.poison_weight
        if self.nan_at == k:
            loss = loss * math.nan
        if self.storm is not None and self.storm[0] <= k < self.storm[1]:
            loss = loss * 2.0**self.storm_exponent
        return loss


def scenarios(cfg: StressConfig) -> dict[str, Scenario]:
    mid = cfg.steps // 2
    storm = max(1, min(10, mid // 3))  # micro-batches on each side of the middle
    return {
        s.name: s
        for s in [
            Scenario("clean", "no fault: the reference for 'diverged'"),
            Scenario("lr_too_high", f"peak lr {cfg.lr_multiplier:g}x too high", lr_multiplier=cfg.lr_multiplier),
            Scenario(
                "poisoned_batch",
                f"micro-batch {mid}: random labels, loss weight x{cfg.poison_weight:g} (a huge gradient)",
                poison_at=mid,
                poison_weight=cfg.poison_weight,
            ),
            Scenario(
                "fp16_overflow_storm",
                f"fp16 grads + GradScaler; micro-batches {mid - storm}..{mid + storm - 1} overflow fp16 (loss x2^40)",
                fp16=True,
                storm=(mid - storm, mid + storm),
            ),
            Scenario("nan_injection", f"micro-batch {mid}: loss is NaN", nan_at=mid),
            Scenario(
                "distribution_shift", f"from micro-batch {mid}: a different prompt format, all upper case", shift_at=mid
            ),
        ]
    }


def shift_example(example):
    """The shifted task: the same questions in a terse prompt format ("Q: ..."), everything upper case."""
    from fused_stable.train.data.rows import Example

    return Example(
        [{**m, "content": (("Q: " if m["role"] == "user" else "") + m["content"]).upper()} for m in example.messages]
    )
