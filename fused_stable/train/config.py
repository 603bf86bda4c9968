"""The trainer's configuration: a `TrainConfig` (its keys are in `keys`) filled from defaults < YAML file <
command-line flags, and checked.

Unknown keys are refused with the closest known key suggested; values are coerced to the key's type, every
number is checked finite and inside its key's range, and the rules between keys (quantisation needs an adapter,
resume excludes overwrite, ...) are checked before anything is written, so a bad input never leaves a
half-created run behind. The result is stored as run.yaml and in every checkpoint (`run_dict`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing

import yaml

from fused_stable.argcheck import check_device, parse_number, suggestion
from fused_stable.errors import UserError
from fused_stable.train.keys import ALIASES, CHOICES, COUNT, EVAL_EVERY_LOGS, FIELDS, LAUNCH_KEYS, TrainConfig


def same_state_value(name: str, saved, now) -> bool:
    """Whether a STATE_KEYS value is unchanged, spelling aside (module order, a path written differently)."""
    if name == "target_modules" and isinstance(saved, str) and isinstance(now, str):
        return {m.strip() for m in saved.split(",") if m.strip()} == {m.strip() for m in now.split(",") if m.strip()}
    if name == "model" and isinstance(saved, str) and isinstance(now, str) and os.path.isdir(now):
        return os.path.realpath(saved) == os.path.realpath(now)
    return saved == now


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


_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


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
    if cfg.val_size >= 1 and cfg.val_size != int(cfg.val_size):
        raise UserError(f"val_size must be a fraction below 1 or a whole count of examples, got {cfg.val_size:g}")
    if cfg.val_size and cfg.dataset == "identity":
        raise UserError(
            "val_size does not apply to dataset=identity: the task holds out its own set (the identity "
            "paraphrases of its evaluation) for eval_loss"
        )
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
        eval_rise=cfg.guard_eval_rise,
        nonfinite_storm=cfg.guard_nonfinite_storm,
        lr_factor=cfg.guard_lr_factor,
        max_rollbacks=cfg.guard_max_rollbacks,
    )


def eval_steps(cfg: TrainConfig) -> int:
    """The evaluation interval: `eval_steps`, or EVAL_EVERY_LOGS logging intervals when it is none."""
    return cfg.eval_steps if cfg.eval_steps is not None else EVAL_EVERY_LOGS * cfg.logging_steps


def retention_probe(cfg: TrainConfig) -> bool:
    """Whether the run measures retention_loss: `auto` means a pretrained model (anything but the scratch tiny
    Llama, whose own answers say nothing worth keeping)."""
    return cfg.retention_probe == "on" or (cfg.retention_probe == "auto" and cfg.model != "tiny")


def run_dict(cfg: TrainConfig) -> dict:
    """The config as stored in run.yaml and checkpoints: what defines the run, without launch-only keys."""
    return {k: v for k, v in cfg.to_dict().items() if k not in LAUNCH_KEYS}


def dump_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(run_dict(cfg), sort_keys=False)
