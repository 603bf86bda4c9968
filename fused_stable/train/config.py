"""The trainer's configuration: one dataclass, filled from defaults < YAML file < command-line flags.

Every key is a field of `TrainConfig` with its default and a help line (`fused-stable sft --help` prints
them all). Unknown keys are refused with the closest known key suggested; values are checked before
anything is written, so a bad input never leaves a half-created run behind.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field

import yaml

from fused_stable.train.errors import UserError


def _key(default, help_: str, group: str):
    return field(default=default, metadata={"help": help_, "group": group})


@dataclass
class TrainConfig:
    # what to train
    model: str = _key("smollm2-135m", "smollm2-135m (pretrained) | tiny (scratch) | HF dir | .gguf file", "model")
    dataset: str = _key("identity", "identity (built-in) | arithmetic (for tiny) | .json/.jsonl file", "model")
    identity_name: str = _key("Aster", "dataset=identity: the name the model learns", "model")
    identity_author: str = _key("Fused Labs", "dataset=identity: who made the model", "model")
    general_examples: int = _key(50, "dataset=identity: general examples mixed in", "model")
    arithmetic_examples: int = _key(12800, "dataset=arithmetic: examples generated", "model")
    output_dir: str = _key("runs/sft", "where metrics, curves, checkpoints and the adapter/model go", "model")
    tuner: str = _key("lora", "lora | dora | full", "model")
    quant_bits: typing.Optional[int] = _key(None, "4 (QLoRA: NF4 + double quantisation), 8, or none: quantise the frozen base weights", "model")
    lora_r: int = _key(8, "LoRA rank", "model")
    lora_alpha: float = _key(16, "LoRA alpha (the update is scaled by alpha / r)", "model")
    lora_dropout: float = _key(0.0, "dropout on the LoRA input", "model")
    target_modules: str = _key("all-linear", "comma-separated module names to adapt, or all-linear", "model")
    loraplus_lr_ratio: typing.Optional[float] = _key(None, "LoRA+: the B matrices get lr x ratio (e.g. 16); none = plain LoRA", "model")
    gradient_checkpointing: bool = _key(False, "recompute activations in backward to save memory", "model")
    # optimisation
    lr: float = _key(1e-3, "peak learning rate", "optim")
    weight_decay: float = _key(0.01, "decoupled weight decay (AdamW)", "optim")
    max_grad_norm: typing.Optional[float] = _key(1.0, "global L2 norm clip, applied inside FusedAdamW's step; none or 0 = no clipping", "optim")
    clip: str = _key("fixed", "fixed (max_grad_norm only) | zscore (also clip grad-norm spikes to mean + 2.5 std of the running norm statistics, ZClip-style)", "optim")
    warmup_ratio: float = _key(0.1, "fraction of the optimizer steps spent warming the lr up linearly", "optim")
    scheduler: str = _key("cosine", "cosine | linear | constant (after warm-up)", "optim")
    precision: str = _key("auto", "bf16 | fp16 (dynamic loss scaling) | fp32 | auto (bf16 on a GPU that has it, else fp32)", "optim")
    batch_size: int = _key(4, "sequences per micro-batch", "optim")
    grad_accum: int = _key(1, "micro-batches per optimizer step", "optim")
    max_steps: typing.Optional[int] = _key(None, "optimizer steps to run; none = derive from epochs", "optim")
    epochs: float = _key(1.0, "passes over the data set (used when max_steps is none)", "optim")
    max_length: int = _key(512, "truncate tokenised examples to this many tokens", "optim")
    seed: int = _key(42, "seed for model init, data order and dropout", "optim")
    # bookkeeping
    logging_steps: int = _key(10, "read metrics from the device every N optimizer steps", "run")
    save_steps: int = _key(100, "write a checkpoint every N optimizer steps (0 = only at the end)", "run")
    save_total_limit: int = _key(3, "keep the newest N checkpoints, removing older ones (0 = keep all)", "run")
    tensorboard: bool = _key(True, "also write TensorBoard event files to output_dir/tensorboard (needs the tensorboard package)", "run")
    device: str = _key("auto", "auto | cpu | cuda | cuda:N", "run")
    threads: int = _key(0, "CPU threads; 0 = OMP_NUM_THREADS or 1 per core", "run")
    evaluation: str = _key("auto", "eval.json before/after: auto (identity) | on | off", "run")
    resume: typing.Optional[str] = _key(None, "'latest' or a checkpoint directory to continue from", "run")
    overwrite: bool = _key(False, "replace the run already in output_dir", "run")
    # stability guard (fused_stable.guard): checked at logging steps from device-side counters
    guard: str = _key("warn", "what to do on an alert: warn (record it) | skip (the optimizer also skips grad-norm spikes) | stop (checkpoint, exit code 3) | rollback (restore the last good checkpoint, lower the lr, skip the data window)", "guard")
    guard_grad_z: float = _key(6.0, "alert when the grad norm's z-score (against its running statistics) exceeds this...", "guard")
    guard_grad_ratio: float = _key(5.0, "...and the norm is at least this many times its running mean (0 = z-score alone)", "guard")
    guard_skip_z: float = _key(20.0, "guard=skip|rollback: the optimizer skips steps whose grad-norm z-score exceeds this", "guard")
    guard_loss_z: float = _key(6.0, "alert when a step's loss z-score (against its running statistics) exceeds this", "guard")
    guard_loss_rise: float = _key(1.5, "alert when a logging interval's median loss exceeds this x the best so far (0 = off)", "guard")
    guard_nonfinite_storm: int = _key(3, "non-finite-gradient steps in one logging interval that escalate to the policy (fewer are skipped and recorded)", "guard")
    guard_lr_factor: float = _key(0.5, "guard=rollback: multiply the lr by this on each rollback for a spike", "guard")
    guard_max_rollbacks: int = _key(3, "guard=rollback: give up (stop, exit code 3) when this many rollbacks did not help", "guard")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
CHOICES = {
    "tuner": ("lora", "dora", "full"),
    "scheduler": ("cosine", "linear", "constant"),
    "precision": ("auto", "bf16", "fp16", "fp32"),
    "clip": ("fixed", "zscore"),
    "guard": ("warn", "skip", "stop", "rollback"),
    "evaluation": ("auto", "on", "off"),
}
# keys that describe how to launch this invocation, not the run itself: not compared or stored as the run
LAUNCH_KEYS = ("resume", "overwrite")


# ------------------------------------------------------------------------------------------ value parsing
def _unknown_key(name: str, where: str) -> UserError:
    close = difflib.get_close_matches(name, FIELDS, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else "; see `fused-stable sft --help`"
    return UserError(f"unknown key {name!r} in {where}{hint}")


def _coerce(name: str, value, where: str):
    """Turn a YAML value or a flag string into the field's type, or say clearly why not."""
    hint = typing.get_type_hints(TrainConfig)[name]
    optional = typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint)
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    if isinstance(value, str) and value.strip().lower() in ("none", "null", "~", ""):
        if optional:
            return None
        raise UserError(f"{name} in {where} cannot be none")
    if value is None:
        if optional:
            return None
        raise UserError(f"{name} in {where} cannot be none")
    bad = UserError(f"{name} in {where} must be {base.__name__}, got {value!r}")
    if base is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "yes", "1", "on"):
            return True
        if text in ("false", "no", "0", "off"):
            return False
        raise bad
    if base is int:
        if isinstance(value, bool):
            raise bad
        try:
            number = float(value) if isinstance(value, str) else value
        except ValueError:
            raise bad from None
        if not isinstance(number, (int, float)) or number != int(number):
            raise bad
        return int(number)
    if base is float:
        if isinstance(value, bool):
            raise bad
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad from None
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise bad
    return str(value)


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"config file {path!r} not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise UserError(f"{where}: invalid YAML ({getattr(exc, 'problem', None) or exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: the config must be a mapping of key: value")
    return data


def parse_flags(argv: list[str]) -> tuple[str | None, dict[str, str | bool]]:
    """`--key value`, `--key=value`, `--flag` (booleans); dashes in keys may be written as underscores."""
    config_path, flags = None, {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or token == "--":
            raise UserError(f"unexpected argument {token!r}; options are --key value (see `fused-stable sft --help`)")
        name, eq, value = token[2:].partition("=")
        name = name.replace("-", "_")
        if name != "config" and name not in FIELDS:
            raise _unknown_key(name, "the command line")
        is_bool = name in FIELDS and typing.get_type_hints(TrainConfig)[name] is bool
        if not eq:
            if is_bool and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
                value = True
            elif i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                raise UserError(f"--{name} needs a value")
        if name == "config":
            config_path = value
        else:
            flags[name] = value
        i += 1
    return config_path, flags


def resolve_config(argv: list[str], base: dict | None = None) -> tuple[TrainConfig, set[str]]:
    """defaults (or `base`, a saved run's config) < YAML < flags. Returns the config and the keys set explicitly."""
    config_path, flags = parse_flags(argv)
    values = dict(base or {})
    explicit: set[str] = set()
    if config_path is not None:
        for name, value in _read_yaml(config_path).items():
            if name not in FIELDS:
                raise _unknown_key(str(name), config_path)
            values[name] = _coerce(name, value, config_path)
            explicit.add(name)
    for name, value in flags.items():
        values[name] = _coerce(name, value, f"--{name}")
        explicit.add(name)
    cfg = TrainConfig(**values)
    validate(cfg)
    return cfg, explicit


def validate(cfg: TrainConfig) -> None:
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise UserError(f"{name} must be one of {' | '.join(allowed)}, got {getattr(cfg, name)!r}")
    if cfg.quant_bits not in (None, 4, 8):
        raise UserError(f"quant_bits must be 4, 8 or none, got {cfg.quant_bits!r}")
    if cfg.quant_bits is not None and cfg.tuner == "full":
        raise UserError(f"quant_bits={cfg.quant_bits} needs tuner lora or dora: quantised base weights cannot be trained with tuner=full")
    if cfg.loraplus_lr_ratio is not None and cfg.tuner == "full":
        raise UserError("loraplus_lr_ratio needs tuner lora or dora (it sets the lr of the LoRA B matrices)")
    positive = {"lr": cfg.lr, "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum, "lora_r": cfg.lora_r,
                "lora_alpha": cfg.lora_alpha, "epochs": cfg.epochs, "logging_steps": cfg.logging_steps,
                "max_length": cfg.max_length, "arithmetic_examples": cfg.arithmetic_examples}
    if cfg.max_steps is not None:
        positive["max_steps"] = cfg.max_steps
    if cfg.loraplus_lr_ratio is not None:
        positive["loraplus_lr_ratio"] = cfg.loraplus_lr_ratio
    for name, value in positive.items():
        if not value > 0:
            raise UserError(f"{name} must be positive, got {value}")
    non_negative = {"weight_decay": cfg.weight_decay, "save_steps": cfg.save_steps,
                    "save_total_limit": cfg.save_total_limit, "threads": cfg.threads,
                    "general_examples": cfg.general_examples}
    if cfg.max_grad_norm is not None:
        non_negative["max_grad_norm"] = cfg.max_grad_norm
    for name, value in non_negative.items():
        if value < 0:
            raise UserError(f"{name} must not be negative, got {value}")
    if not 0.0 <= cfg.warmup_ratio < 1.0:
        raise UserError(f"warmup_ratio must be in [0, 1), got {cfg.warmup_ratio}")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise UserError(f"lora_dropout must be in [0, 1), got {cfg.lora_dropout}")
    if cfg.max_length < 8:
        raise UserError(f"max_length must be at least 8, got {cfg.max_length}")
    if not [m for m in cfg.target_modules.split(",") if m.strip()]:
        raise UserError("target_modules must name at least one module, or be all-linear")
    if cfg.device != "auto" and not (cfg.device == "cpu" or cfg.device.startswith("cuda")):
        raise UserError(f"device must be auto, cpu, cuda or cuda:N, got {cfg.device!r}")
    try:
        guard_config(cfg)
    except ValueError as exc:
        raise UserError(str(exc).replace("guard ", "guard_", 1) if "policy" not in str(exc) else str(exc)) from None


def guard_config(cfg: TrainConfig):
    """The stability guard's settings from the guard_* keys (ValueError on a bad value)."""
    from fused_stable.guard import GuardConfig

    return GuardConfig(
        policy=cfg.guard, grad_z=cfg.guard_grad_z, grad_ratio=cfg.guard_grad_ratio, skip_z=cfg.guard_skip_z,
        loss_z=cfg.guard_loss_z, loss_rise=cfg.guard_loss_rise, nonfinite_storm=cfg.guard_nonfinite_storm,
        lr_factor=cfg.guard_lr_factor, max_rollbacks=cfg.guard_max_rollbacks,
    )  # fmt: skip


def run_dict(cfg: TrainConfig) -> dict:
    """The config as stored in run.yaml and checkpoints: what defines the run, without launch-only keys."""
    return {k: v for k, v in cfg.to_dict().items() if k not in LAUNCH_KEYS}


def dump_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(run_dict(cfg), sort_keys=False)


def help_text() -> str:
    lines = [
        "usage: fused-stable sft [--config run.yaml] [--key value ...]",
        "",
        "Supervised fine-tuning (LoRA / QLoRA / DoRA / LoRA+ / full) on FusedAdamW, fully offline.",
        "With no arguments it fine-tunes the embedded SmolLM2-135M-Instruct on the built-in identity",
        "task into runs/sft and evaluates it before and after (eval.json).",
        "Keys come from defaults < the YAML file given by --config < flags (--key value or --key=value).",
        "",
    ]
    titles = {"model": "model and data:", "optim": "optimisation:", "run": "run:", "guard": "stability guard (docs/guard.md):"}
    for group, title in titles.items():
        lines.append(title)
        for f in dataclasses.fields(TrainConfig):
            if f.metadata["group"] != group:
                continue
            default = "none" if f.default is None else str(f.default).lower() if isinstance(f.default, bool) else f.default
            lines.append(f"  --{f.name:<24} {f.metadata['help']} (default: {default})")
        lines.append("")
    lines.append("Outputs in output_dir: metrics.jsonl, alerts.jsonl, curves.png, eval.json, run.yaml,")
    lines.append("tensorboard/, checkpoints/step-N/, adapter/ (or model/).")
    lines.append("Then: fused-stable chat --adapter output_dir, fused-stable export --adapter output_dir.")
    lines.append("Exit codes: 0 done, 2 bad input, 3 stopped by the guard (look at alerts.jsonl, then --resume latest).")
    return "\n".join(lines)
