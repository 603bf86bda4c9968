"""The trainer's configuration: one dataclass, filled from defaults < YAML file < command-line flags.

Every key is a field of `TrainConfig` with its default and a help line (`fused-stable sft --help` prints
them all). Unknown keys are refused with the closest known key suggested; values are checked before
anything is written, so a bad input never leaves a half-created run behind.
"""

from __future__ import annotations

import dataclasses
import os
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field

import yaml

from fused_stable.argcheck import HELP_WIDTH, check_range, parse_number, suggestion
from fused_stable.errors import UserError


@dataclass(frozen=True)
class Range:
    """Where a numeric key's value makes sense (checked by `validate`, with every other number finite)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def problem(self, value) -> str | None:
        return check_range(value, self.low, self.high, low_open=self.low_open, high_open=self.high_open)


MAX_COUNT = 10**9  # a bound on counts (steps, examples...) that no real run reaches and no typo passes
POSITIVE_COUNT = Range(1, MAX_COUNT)
COUNT = Range(0, MAX_COUNT)  # what an int key without its own range must satisfy


def _key(default, help_: str, group: str, check: Range | None = None):
    return field(default=default, metadata={"help": help_, "group": group, "check": check})


@dataclass
class TrainConfig:
    # what to train
    model: str = _key("smollm2-135m", "smollm2-135m (pretrained) | tiny (scratch) | HF dir | .gguf file", "model")
    dataset: str = _key("identity", "identity (built-in) | arithmetic (for tiny) | .json/.jsonl file", "model")
    identity_name: str = _key("Aster", "dataset=identity: the name the model learns", "model")
    identity_author: str = _key("Fused Labs", "dataset=identity: who made the model", "model")
    general_examples: int = _key(50, "dataset=identity: general examples mixed in", "model", Range(0, 10**6))
    arithmetic_examples: int = _key(12800, "dataset=arithmetic: examples generated", "model", Range(1, 10**7))
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
    lr: float = _key(1e-3, "peak learning rate", "optim", Range(0, 1, low_open=True))
    weight_decay: float = _key(0.01, "decoupled weight decay (AdamW)", "optim", Range(0))
    max_grad_norm: float | None = _key(
        1.0, "global L2 norm clip, applied inside FusedAdamW's step; none or 0 = no clipping", "optim", Range(0)
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
    scheduler: str = _key("cosine", "cosine | linear | constant (after warm-up)", "optim")
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
    # bookkeeping
    logging_steps: int = _key(10, "read metrics from the device every N optimizer steps", "run", POSITIVE_COUNT)
    save_steps: int = _key(100, "write a checkpoint every N optimizer steps (0 = only at the end)", "run")
    save_total_limit: int = _key(3, "keep the newest N checkpoints, removing older ones (0 = keep all)", "run")
    tensorboard: bool = _key(True, "also write TensorBoard event files to output_dir/tensorboard", "run")
    device: str = _key("auto", "auto | cpu | cuda | cuda:N", "run")
    threads: int = _key(0, "CPU threads; 0 = OMP_NUM_THREADS or 1 per core", "run", Range(0, 4096))
    evaluation: str = _key("auto", "eval.json before/after: auto (identity) | on | off", "run")
    resume: str | None = _key(None, "'latest' or a checkpoint directory to continue from", "run")
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
    guard_max_rollbacks: int = _key(
        3, "guard=rollback: give up (stop, exit code 3) when this many rollbacks did not help", "guard"
    )

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
# keys a checkpoint fixes: the shapes or meaning of its saved weights (model, tuner, quantisation, adapter
# rank, scale and targets, LoRA+ groups), and the hyper-parameters its optimizer state carries and restores
# (lr, with any guard rollback cut, and weight_decay: a new value would be silently ignored). A resume that
# changes one is refused; the checkpoint's saved config is the reference.
STATE_KEYS = (
    "model",
    "tuner",
    "quant_bits",
    "lora_r",
    "lora_alpha",
    "target_modules",
    "loraplus_lr_ratio",
    "lr",
    "weight_decay",
)


def same_state_value(name: str, saved, now) -> bool:
    """Whether a STATE_KEYS value is unchanged, spelling aside (module order, a path written differently)."""
    if name == "target_modules" and isinstance(saved, str) and isinstance(now, str):
        return {m.strip() for m in saved.split(",") if m.strip()} == {m.strip() for m in now.split(",") if m.strip()}
    if name == "model" and isinstance(saved, str) and isinstance(now, str) and os.path.isdir(now):
        return os.path.realpath(saved) == os.path.realpath(now)
    return saved == now


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
    "save_every": "save_steps",
    "load_in_4bit": "quant_bits",
    "load_in_8bit": "quant_bits",
    "bits": "quant_bits",
    "bf16": "precision",
    "fp16": "precision",
    "use_dora": "tuner",
    "gradient_checkpoint": "gradient_checkpointing",
}


# ------------------------------------------------------------------------------------------ value parsing
def _unknown_key(name: str, where: str) -> UserError:
    close = suggestion(name, FIELDS, ALIASES)
    if where == "the command line":
        hint = f"; did you mean --{close}?" if close else "; see `fused-stable sft --help`"
        return UserError(f"unknown option --{name}{hint}")
    hint = f"; did you mean {close!r}?" if close else "; see `fused-stable sft --help` for the keys"
    return UserError(f"unknown key {name!r} in {where}{hint}")


def _coerce(name: str, value, where: str):
    """Turn a YAML value or a flag string into the field's type, or say clearly why not."""
    hint = typing.get_type_hints(TrainConfig)[name]
    # `int | None` (types.UnionType) and `typing.Optional[int]` (typing.Union) both mean optional
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    if value is None or isinstance(value, str) and value.strip().lower() in ("none", "null", "~", ""):
        if optional:
            return None
        raise UserError(f"{name} in {where} cannot be none")
    if base is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if isinstance(value, (str, int)) and text in ("true", "yes", "1", "on"):
            return True
        if isinstance(value, (str, int)) and text in ("false", "no", "0", "off"):
            return False
        raise UserError(f"{name} in {where} must be true or false, got {value!r}")
    if base in (int, float):
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise UserError(f"{name} in {where} must be {base.__name__}, got {value!r}")
        try:
            return parse_number(value, integer=base is int)
        except ValueError as exc:
            problem = str(exc)
            if problem.startswith("expected a number"):
                raise UserError(f"{name} in {where} must be {base.__name__}, got {value!r}") from None
            if problem.startswith("must be a whole"):
                raise UserError(f"{name} in {where} must be int (a whole number), got {value!r}") from None
            raise UserError(f"{name} in {where} {problem}") from None
    if not isinstance(value, str):  # a YAML number, list or mapping where a name or path belongs
        raise UserError(f"{name} in {where} must be a string, got {value!r}")
    return value


def _read_yaml(path: str) -> dict:
    if os.path.isdir(path):
        raise UserError(f"config file {path!r} is a directory; give a YAML file")
    if not os.path.isfile(path):
        raise UserError(f"config file {path!r} not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not a text file ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"config file {path!r} cannot be read ({exc.strerror})") from None
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
    """`--key value`, `--key=value`, `--flag` (booleans); `--key_name` and `--key-name` are the same key."""
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
            next_is_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            if is_bool and not next_is_value:
                value = True
            elif next_is_value:
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
    values = {}
    for name, value in (base or {}).items():
        if name not in FIELDS:
            raise UserError(f"unknown key {name!r} in the saved config (written by another version of fused-stable?)")
        values[name] = _coerce(name, value, "the saved config")
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


def _check_numbers(cfg: TrainConfig) -> None:
    """Every number finite (the parser already refuses nan/inf; this also covers configs built in code), and
    inside its key's `Range`; an int key without one must be a count in [0, MAX_COUNT]."""
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg, f.name)
        if value is None or isinstance(value, (bool, str)):
            continue
        try:
            parse_number(value, integer=int in (hints[f.name], *typing.get_args(hints[f.name])))
        except ValueError as exc:
            raise UserError(f"{f.name} {exc}") from None
        check = f.metadata.get("check") or (COUNT if isinstance(value, int) else None)
        problem = check.problem(value) if check else None
        if problem:
            raise UserError(f"{f.name} {problem}, got {value}")


_DEVICE = re.compile(r"auto|cpu|cuda(?::(\d+))?")
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def check_device(device: str) -> None:
    """auto, cpu, cuda or cuda:N, and the CUDA device must exist on this machine."""
    match = _DEVICE.fullmatch(device)
    if not match:
        raise UserError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"device={device} but this machine has no CUDA device (use device=cpu or auto)")
        if match.group(1) is not None and int(match.group(1)) >= count:
            raise UserError(f"device={device} but this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}")


def validate(cfg: TrainConfig) -> None:
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise UserError(f"{name} must be one of {' | '.join(allowed)}, got {getattr(cfg, name)!r}")
    if cfg.quant_bits not in (None, 4, 8):
        raise UserError(f"quant_bits must be 4, 8 or none, got {cfg.quant_bits!r}")
    _check_numbers(cfg)
    if cfg.resume is not None and cfg.overwrite:
        raise UserError(
            "resume and overwrite exclude each other: --resume continues the run in output_dir, --overwrite replaces it"
        )
    if cfg.quant_bits is not None and cfg.tuner == "full":
        raise UserError(
            f"quant_bits={cfg.quant_bits} needs tuner lora or dora: "
            "quantised base weights cannot be trained with tuner=full"
        )
    if cfg.loraplus_lr_ratio is not None and cfg.tuner == "full":
        raise UserError("loraplus_lr_ratio needs tuner lora or dora (it sets the lr of the LoRA B matrices)")
    if cfg.loraplus_lr_ratio is not None and cfg.lr * cfg.loraplus_lr_ratio > 1:
        raise UserError(
            f"lr x loraplus_lr_ratio (the B matrices' lr) must be at most 1, got {cfg.lr * cfg.loraplus_lr_ratio:g}"
        )
    if cfg.lr * cfg.weight_decay >= 1:
        raise UserError(
            f"lr x weight_decay must be below 1 (each step multiplies the weights by 1 - lr x weight_decay), "
            f"got {cfg.lr * cfg.weight_decay:g}"
        )
    modules = [m.strip() for m in cfg.target_modules.split(",") if m.strip()]
    if not modules:
        raise UserError("target_modules must name at least one module, or be all-linear")
    bad = [m for m in modules if m != "all-linear" and not _MODULE_NAME.fullmatch(m)]
    if bad:
        raise UserError(
            f"target_modules: {bad[0]!r} is not a module name (comma-separated names like q_proj,v_proj, or all-linear)"
        )
    for name in ("model", "dataset", "output_dir", "identity_name", "identity_author"):
        if not getattr(cfg, name).strip():
            raise UserError(f"{name} cannot be empty")
    check_device(cfg.device)
    try:
        guard_config(cfg)
    except ValueError as exc:
        raise UserError(str(exc).replace("guard ", "guard_", 1) if "policy" not in str(exc) else str(exc)) from None


def guard_config(cfg: TrainConfig):
    """The stability guard's settings from the guard_* keys (ValueError on a bad value)."""
    from fused_stable.guard import GuardConfig

    return GuardConfig(
        policy=cfg.guard,
        grad_z=cfg.guard_grad_z,
        grad_ratio=cfg.guard_grad_ratio,
        skip_z=cfg.guard_skip_z,
        skip_ratio=cfg.guard_skip_ratio,
        loss_z=cfg.guard_loss_z,
        loss_rise=cfg.guard_loss_rise,
        nonfinite_storm=cfg.guard_nonfinite_storm,
        lr_factor=cfg.guard_lr_factor,
        max_rollbacks=cfg.guard_max_rollbacks,
    )


def run_dict(cfg: TrainConfig) -> dict:
    """The config as stored in run.yaml and checkpoints: what defines the run, without launch-only keys."""
    return {k: v for k, v in cfg.to_dict().items() if k not in LAUNCH_KEYS}


def dump_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(run_dict(cfg), sort_keys=False)


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
            "Supervised fine-tuning (LoRA / QLoRA / DoRA / LoRA+ / full) on FusedAdamW, fully offline. "
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
        "Outputs in output_dir: run_manifest.json (what --overwrite may remove), run.yaml, metrics.jsonl, "
        "alerts.jsonl, curves.png, eval.json, tensorboard/, checkpoints/step-N/, adapter/ (or model/)."
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
