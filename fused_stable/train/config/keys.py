"""The trainer's keys: every key of `fused-stable sft` is a field of `TrainConfig`, with its default, a help
line, its group in `--help` and, for a number, the `Range` it must lie in; beside it the choices of the keys
that take a name (`CHOICES`), the names other tools use for our keys (`ALIASES`, suggested, never accepted;
LLaMA-Factory's and ms-swift's own keys are mapped by `foreign_configs`),
the keys a checkpoint fixes (`STATE_KEYS`) and the help text they make (`help_text`).

A new key is one field here; how keys are read (defaults < YAML < flags) and checked against each other is
`config`'s job.
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass, field

from fused_stable.argcheck import HELP_WIDTH, check_range
from fused_stable.train.run.optimizers import RULES


@dataclass(frozen=True)
class Range:
    """Where a numeric key's value makes sense (checked by `validate`, with every other number finite)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def problem(self, value) -> str | None:
        return check_range(value, self.low, self.high, low_open=self.low_open, high_open=self.high_open)


# eval_steps when none is given: every EVAL_EVERY_LOGS logging intervals. On the default run (27 steps, logging
# every 10) that is one evaluation during training, at step 20; one evaluation costs 0.6-2 training steps
# there (measured under load, docs/trainer.md "Evaluation during training"), so evaluating costs ~2-7% of training
EVAL_EVERY_LOGS = 2
MAX_COUNT = 10**9  # a bound on counts (steps, examples...) that no real run reaches and no typo passes
POSITIVE_COUNT = Range(1, MAX_COUNT)
COUNT = Range(0, MAX_COUNT)  # what an int key without its own range must satisfy


def _key(default, help_: str, group: str, check: Range | None = None):
    return field(default=default, metadata={"help": help_, "group": group, "check": check})


@dataclass
class TrainConfig:
    # what to train
    model: str = _key("smollm2-135m", "smollm2-135m (pretrained) | tiny (scratch) | HF dir | .gguf file", "model")
    dataset: str = _key(
        "identity",
        "identity (built-in) | arithmetic (for tiny) | .json/.jsonl file; several: a,b (name#N samples N)",
        "model",
    )
    identity_name: str = _key("Aster", "dataset=identity: the name the model learns", "model")
    identity_author: str = _key("Fused Labs", "dataset=identity: who made the model", "model")
    general_examples: int = _key(50, "dataset=identity: general examples mixed in", "model", Range(0, 10**6))
    arithmetic_examples: int = _key(12800, "dataset=arithmetic: examples generated", "model", Range(1, 10**7))
    # several datasets (issues 39-40, train/data/mixing.py): dataset is a comma list, name#N samples N
    max_samples: int | None = _key(
        None, "the first N examples of each dataset (before the held-out split); none = all", "model", POSITIVE_COUNT
    )
    mix_strategy: str = _key(
        "concat", "several datasets: concat | interleave_under | interleave_over (as LLaMA-Factory)", "model"
    )
    interleave_probs: str | None = _key(
        None, "interleave_*: one probability per dataset, comma-separated; none = round-robin", "model"
    )
    # ms-swift's --system, LLaMA-Factory's default_system (issue 40): the prompt train, held-out and chat share
    system: str | None = _key(
        None,
        "the system message of every example (training and held-out) that has none of its own; stored with the "
        "run, so chat uses it; none = the chat template's own",
        "model",
    )
    eval_dataset: str | None = _key(
        None,
        "held-out data for eval_loss instead of val_size: a dataset or a,b (loaded and mixed as dataset is)",
        "model",
    )
    output_dir: str = _key("runs/sft", "where metrics, curves, checkpoints and the adapter/model go", "model")
    tuner: str = _key("lora", "lora | dora | full", "model")
    quant_bits: int | None = _key(
        None, "4 (QLoRA: NF4 + double quantisation), 8, or none: quantise the frozen base weights", "model"
    )
    lora_r: int = _key(8, "LoRA rank", "model", Range(1, 65536))
    lora_alpha: float = _key(
        16, "LoRA alpha (the update is scaled by alpha / r)", "model", Range(0, 1e6, low_open=True)
    )
    lora_dropout: float = _key(0.0, "dropout on the LoRA input", "model", Range(0, 1, high_open=True))
    target_modules: str = _key("all-linear", "comma-separated module names to adapt, or all-linear", "model")
    loraplus_lr_ratio: float | None = _key(
        None, "LoRA+: the B matrices get lr x ratio (e.g. 16); none = plain LoRA", "model", Range(0, 1e6, low_open=True)
    )
    gradient_checkpointing: bool = _key(False, "recompute activations in backward to save memory", "model")
    # optimisation
    optim: str = _key(
        "adamw",
        "the update rule: adamw (FusedAdamW) | lion (FusedLion, lion-pytorch's Lion) | muon (FusedMuon: Muon for the "
        "hidden 2-D weights and MoE expert stacks, AdamW for the rest, as muon_param_groups splits them; a LoRA "
        "run's factors stay on AdamW unless muon_lora); the HF Trainer's names (adamw_torch, lion_8bit, ...) are "
        "read too",
        "optim",
    )
    muon_lora: bool = _key(
        False,
        "optim muon: the LoRA factors (A: r x in, B: out x r) on Muon too, as ms-swift splits them; false = on "
        "AdamW, as LLaMA-Factory's use_muon",
        "optim",
    )
    lr: float = _key(
        1e-3,
        "peak learning rate (the same default for every rule: a sweep found 1e-3 best for lion too, docs/trainer.md)",
        "optim",
        Range(0, 1, low_open=True),
    )
    weight_decay: float = _key(
        0.01, "decoupled weight decay (lion: the Lion paper takes 3-10x AdamW's)", "optim", Range(0)
    )
    max_grad_norm: float | None = _key(
        1.0, "global L2 norm clip, applied inside the fused step; none or 0 = no clipping", "optim", Range(0)
    )
    clip: str = _key(
        "fixed",
        "fixed (max_grad_norm only) | zscore (also clip grad-norm spikes to mean + 2.5 std of the running norm "
        "statistics, ZClip-style)",
        "optim",
    )
    warmup_ratio: float = _key(
        0.1, "fraction of the optimizer steps spent warming the lr up linearly", "optim", Range(0, 1, high_open=True)
    )
    warmup_steps: int | None = _key(
        None,
        "optimizer steps of warm-up, overriding warmup_ratio when above 0; none or 0 = ceil(warmup_ratio x steps), "
        "as the HF Trainer rounds it",
        "optim",
        COUNT,
    )
    scheduler: str = _key("cosine", "cosine | linear | constant (after warm-up)", "optim")
    state_precision: str = _key(
        "fp32",
        "fp32 | bf16 | 8bit: how the optimizer's state (AdamW's moments, Lion's momentum, Muon's momentum) is "
        "stored (8bit: blockwise codes with fp32 scales, tensors under 4096 elements kept fp32; Muon's 8-bit "
        "momentum not under FSDP2 or ZeRO 1-2), dequantised and requantised inside the fused step",
        "optim",
    )
    precision: str = _key(
        "auto", "bf16 | fp16 (dynamic loss scaling) | fp32 | auto (bf16 on a GPU that has it, else fp32)", "optim"
    )
    batch_size: int = _key(4, "sequences per micro-batch", "optim", Range(1, 65536))
    grad_accum: int = _key(1, "micro-batches per optimizer step", "optim", Range(1, 65536))
    max_steps: int | None = _key(None, "optimizer steps to run; none = derive from epochs", "optim", POSITIVE_COUNT)
    epochs: float = _key(
        1.0, "passes over the data set (used when max_steps is none)", "optim", Range(0, 10000, low_open=True)
    )
    max_length: int = _key(512, "truncate tokenised examples to this many tokens", "optim", Range(8, 2**20))
    seed: int = _key(42, "seed for model init, data order and dropout", "optim", Range(0, 2**32 - 1))
    # packing (train/data/packing.py; LLaMA-Factory's keys, spelt as theirs)
    packing: bool = _key(
        False,
        "pack several examples per row up to max_length (no padding inside a row; position ids restart at each "
        "example; no label crosses an example); attention still sees the row's earlier examples",
        "optim",
    )
    neat_packing: bool = _key(
        False, "packing with attention confined to each example (a block-diagonal mask; implies packing)", "optim"
    )
    # bookkeeping
    logging_steps: int = _key(10, "read metrics from the device every N optimizer steps", "run", POSITIVE_COUNT)
    save_steps: int = _key(100, "write a checkpoint every N optimizer steps (0 = only at the end)", "run")
    save_total_limit: int = _key(3, "keep the newest N checkpoints, removing older ones (0 = keep all)", "run")
    tensorboard: bool = _key(True, "also write TensorBoard event files to output_dir/tensorboard", "run")
    report_to: str = _key(
        "tensorboard",
        "tensorboard (output_dir/tensorboard, unless --tensorboard false) | wandb (output_dir/wandb; offline unless "
        "WANDB_MODE says otherwise; pip install 'fused-stable[wandb]') | none",
        "run",
    )
    device: str = _key("auto", "auto | cpu | cuda | cuda:N", "run")
    threads: int = _key(0, "CPU threads; 0 = OMP_NUM_THREADS or 1 per core", "run", Range(0, 4096))
    evaluation: str = _key("auto", "eval.json before/after: auto (identity) | on | off", "run")
    val_size: float = _key(
        0.0,
        "examples held out of the data set for eval_loss: a fraction < 1 or a count (0 = none; "
        "dataset=identity holds out its own set)",
        "run",
        Range(0, MAX_COUNT),
    )
    eval_steps: int | None = _key(
        None,
        "measure eval_loss and retention_loss every N optimizer steps (and before the first); none = "
        f"{EVAL_EVERY_LOGS} x logging_steps; 0 = no evaluation during training",
        "run",
        COUNT,
    )
    retention_probe: str = _key(
        "auto",
        "retention_loss: before training the base model answers general prompts shipped with the package, "
        "during training the loss on those answers is measured: auto (on for a pretrained model, off for tiny) "
        "| on | off",
        "run",
    )
    resume: str | None = _key(None, "'latest' or a checkpoint directory to continue from", "run")
    # DeepSpeed (train/run/deepspeed_run.py): the loop runs through a DeepSpeed engine, FusedAdamW attached to it
    deepspeed: str | None = _key(
        None,
        "a DeepSpeed JSON config: train through its engine (ZeRO 0-3; launch with torchrun or the deepspeed "
        'launcher); "auto" or absent batch keys and bf16 come from batch_size, grad_accum and precision; no '
        "optimizer, scheduler or fp16 section, gradient_clipping 0 (the clip is max_grad_norm)",
        "deepspeed",
    )
    zero_stage: int | None = _key(
        None,
        "0 | 1 | 2 | 3: train through a DeepSpeed ZeRO engine built from the trainer's keys",
        "deepspeed",
        Range(0, 3),
    )
    offload_optimizer: str = _key(
        "none",
        "zero_stage 1-3: none | cpu (ZeRO-Offload: the fused optimizer steps the fp32 master on the CPU)",
        "deepspeed",
    )
    overwrite: bool = _key(False, "replace the run already in output_dir", "run")
    # stability guard (fused_stable.guard): checked at logging steps from device-side counters
    guard: str = _key(
        "warn",
        "what to do on an alert: warn (record it) | skip (the optimizer also skips grad-norm spikes) | stop "
        "(checkpoint, exit code 3) | rollback (restore the last good checkpoint, lower the lr, skip the data window)",
        "guard",
    )
    guard_grad_z: float = _key(
        6.0,
        "alert when the grad norm's z-score (against its running statistics) exceeds this...",
        "guard",
        Range(0, low_open=True),
    )
    guard_grad_ratio: float = _key(
        5.0, "...and the norm is at least this many times its running mean (0 = z-score alone)", "guard"
    )
    guard_skip_z: float = _key(
        6.0,
        "guard=skip|rollback: the optimizer skips steps whose grad-norm z-score exceeds this...",
        "guard",
        Range(0, low_open=True),
    )
    guard_skip_ratio: float = _key(
        5.0, "...and whose norm is at least this many times its running mean (0 = z-score alone)", "guard"
    )
    guard_loss_z: float = _key(
        6.0,
        "alert when a step's loss z-score (against its running statistics) exceeds this",
        "guard",
        Range(0, low_open=True),
    )
    guard_loss_rise: float = _key(
        1.5,
        "alert when a logging interval's median loss (or its last 3's) exceeds this x the best so far (0 = off)",
        "guard",
    )
    guard_eval_rise: float = _key(
        1.3,
        "alert when eval_loss or retention_loss exceeds this x its best so far (0 = off)",
        "guard",
    )
    guard_nonfinite_storm: int = _key(
        3,
        "non-finite-gradient steps in one logging interval that escalate to the policy "
        "(fewer are skipped and recorded)",
        "guard",
        POSITIVE_COUNT,
    )
    guard_lr_factor: float = _key(
        0.5, "guard=rollback: multiply the lr by this on each rollback for a spike", "guard", Range(0, 1, low_open=True)
    )
    guard_eval_lr_factor: float = _key(
        0.25,
        "guard=rollback: multiply the lr by this on a rollback that an evaluation's rise (eval_loss, retention_loss) "
        "asked for",
        "guard",
        Range(0, 1, low_open=True),
    )
    guard_max_rollbacks: int = _key(
        3, "guard=rollback: give up (stop, exit code 3) when this many rollbacks did not help", "guard"
    )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# the words a boolean key (ours, or a switch of another trainer's) takes from a flag or a YAML string; YAML 1.1
# already reads unquoted yes/no/on/off/true/false as booleans. Anything else is refused naming the key and the
# value: `use_muon: yes please` read as off would train AdamW without a word
SWITCH_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def switch_value(value) -> bool | None:
    """A boolean key's value as a bool, or None when it is not one (a bool, 0 / 1, or one of SWITCH_WORDS)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (str, int)):
        return SWITCH_WORDS.get(str(value).strip().lower())
    return None


CHOICES = {
    "tuner": ("lora", "dora", "full"),
    "optim": tuple(RULES),  # the update rules the trainer builds (train/run/optimizers.py)
    "scheduler": ("cosine", "linear", "constant"),
    "precision": ("auto", "bf16", "fp16", "fp32"),
    "state_precision": ("fp32", "bf16", "8bit"),
    "clip": ("fixed", "zscore"),
    "guard": ("warn", "skip", "stop", "rollback"),
    "evaluation": ("auto", "on", "off"),
    "retention_probe": ("auto", "on", "off"),
    "report_to": ("tensorboard", "wandb", "none"),
    "offload_optimizer": ("none", "cpu"),
    "mix_strategy": ("concat", "interleave_under", "interleave_over"),  # several datasets (mixing.py)
}
# keys that describe how to launch this invocation, not the run itself: not compared or stored as the run
LAUNCH_KEYS = ("resume", "overwrite")
# keys a checkpoint fixes: the shapes or meaning of its saved weights (model, tuner, quantisation, adapter
# rank, scale and targets, LoRA+ groups), and the hyper-parameters its optimizer state carries and restores
# (the rule whose state it is, its groups: muon_lora moves the LoRA factors between Muon's and AdamW's, lr with
# any guard rollback cut, and weight_decay: a new value would be silently ignored). A resume that changes one is
# refused; the checkpoint's saved config is the reference.
STATE_KEYS = (
    "model",
    "tuner",
    "quant_bits",
    "lora_r",
    "lora_alpha",
    "target_modules",
    "loraplus_lr_ratio",
    "optim",
    "muon_lora",
    "lr",
    "weight_decay",
)


# names other tools use for our keys: suggested, never accepted silently (a YAML from another tool should
# fail loudly rather than half-apply)
ALIASES = {
    "learning_rate": "lr",
    "lr_scheduler_type": "scheduler",
    "lr_scheduler": "scheduler",
    "per_device_train_batch_size": "batch_size",
    "train_batch_size": "batch_size",
    "micro_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "gradient_accumulation": "grad_accum",
    "num_train_epochs": "epochs",
    "num_epochs": "epochs",
    "warmup": "warmup_ratio",
    "num_warmup_steps": "warmup_steps",
    "max_seq_length": "max_length",
    "max_seq_len": "max_length",
    "cutoff_len": "max_length",
    "seq_len": "max_length",
    "model_name_or_path": "model",
    "base_model": "model",
    "data_path": "dataset",
    "train_file": "dataset",
    "data": "dataset",
    "output": "output_dir",
    "out": "output_dir",
    "resume_from_checkpoint": "resume",
    "lora_rank": "lora_r",
    "rank": "lora_r",
    "r": "lora_r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "target_modules_list": "target_modules",
    "wd": "weight_decay",
    "clip_grad_norm": "max_grad_norm",
    "grad_clip": "max_grad_norm",
    "gradient_clipping": "max_grad_norm",
    "num_steps": "max_steps",
    "max_iters": "max_steps",
    "log_steps": "logging_steps",
    "log_every": "logging_steps",
    "eval_every": "eval_steps",
    "evaluation_steps": "eval_steps",
    "eval_interval": "eval_steps",
    "validation_split": "val_size",
    "val_set_size": "val_size",
    "eval_size": "val_size",
    "val_dataset": "eval_dataset",
    "save_every": "save_steps",
    "load_in_4bit": "quant_bits",
    "load_in_8bit": "quant_bits",
    "bits": "quant_bits",
    "bf16": "precision",
    "fp16": "precision",
    "optim_bits": "state_precision",
    "optimizer": "optim",
    "optimizer_state_precision": "state_precision",
    "use_dora": "tuner",
    "gradient_checkpoint": "gradient_checkpointing",
}


def help_text() -> str:
    """Every key with its help and default, wrapped to fit HELP_WIDTH columns."""

    def para(text: str, indent: str = "") -> list[str]:
        return textwrap.wrap(
            text, HELP_WIDTH, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        ) or [""]

    lines = [
        "usage: fused-stable sft [--config run.yaml] [--key value ...]",
        "",
        *para(
            "Supervised fine-tuning (LoRA / QLoRA / DoRA / LoRA+ / full) on "
            f"{', '.join(rule.title for rule in RULES.values())} (--optim), fully offline. "
            "With no arguments it fine-tunes the embedded SmolLM2-135M-Instruct on the built-in identity task "
            "into runs/sft and evaluates it before and after (eval.json)."
        ),
        *para(
            "Keys come from defaults < the YAML file given by --config < flags (--key value or --key=value; "
            "--key_name and --key-name are the same key)."
        ),
        "",
    ]
    titles = {
        "model": "model and data:",
        "optim": "optimisation:",
        "run": "run:",
        "guard": "stability guard (docs/guard.md):",
        "deepspeed": "DeepSpeed ZeRO (docs/trainer.md, DeepSpeed):",
    }
    column = 28  # where the help text starts: "  --" + the longest key + a space
    for group, title in titles.items():
        lines.append(title)
        for f in dataclasses.fields(TrainConfig):
            if f.metadata["group"] != group:
                continue
            default = (
                "none" if f.default is None else str(f.default).lower() if isinstance(f.default, bool) else f.default
            )
            # a no-break space keeps "(default: value)" on one line
            text = f"{f.metadata['help']} (default:\u00a0{default})"
            lines += [
                line.replace("\u00a0", " ")
                for line in textwrap.wrap(
                    text,
                    HELP_WIDTH,
                    initial_indent=f"  --{f.name} ".ljust(column),
                    subsequent_indent=" " * column,
                    break_on_hyphens=False,
                )
            ]  # "all-linear" stays whole
        lines.append("")
    lines += para(
        "Outputs in output_dir: run_manifest.json (what --overwrite may remove), run.yaml, metrics.jsonl "
        "(eval_loss, retention_loss on evaluated steps), alerts.jsonl, curves.png, eval.json, tensorboard/, "
        "checkpoints/step-N/, adapter/ (or model/)."
    )
    lines += para(
        "Then: fused-stable chat --adapter output_dir, fused-stable export --adapter output_dir --output_dir DIR."
    )
    lines += para(
        "Ctrl-C (SIGINT) or SIGTERM: the current step finishes, a checkpoint is saved and the command to "
        "continue is printed; a second Ctrl-C abandons that save."
    )
    lines += para(
        "Exit codes: 0 done, 2 bad input (nothing written), 3 stopped by the guard (look at alerts.jsonl, "
        "then --resume latest), 130 / 143 interrupted by SIGINT / SIGTERM."
    )
    return "\n".join(lines)
