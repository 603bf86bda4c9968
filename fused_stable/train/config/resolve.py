"""The trainer's configuration: a `TrainConfig` (its keys are in `keys`) filled from defaults < YAML file <
command-line flags, and checked.

Unknown keys are refused with the closest known key suggested; values are coerced to the key's type, every
number is checked finite and inside its key's range, and the rules between keys (quantisation needs an adapter,
resume excludes overwrite, ...) are checked before anything is written, so a bad input never leaves a
half-created run behind. The result is stored as run.yaml and in every checkpoint (`run_dict`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing

import yaml

from fused_stable.argcheck import check_device, parse_number, suggestion
from fused_stable.errors import UserError
from fused_stable.train.config import foreign_configs
from fused_stable.train.config.keys import (
    ALIASES,
    CHOICES,
    COUNT,
    EVAL_EVERY_LOGS,
    FIELDS,
    LAUNCH_KEYS,
    TrainConfig,
    switch_value,
)
from fused_stable.train.data import mixing


def same_state_value(name: str, saved, now) -> bool:
    """Whether a STATE_KEYS value is unchanged, spelling aside (module order, a path written differently)."""
    if name == "target_modules" and isinstance(saved, str) and isinstance(now, str):
        return {m.strip() for m in saved.split(",") if m.strip()} == {m.strip() for m in now.split(",") if m.strip()}
    if name == "model" and isinstance(saved, str) and isinstance(now, str) and os.path.isdir(now):
        return os.path.realpath(saved) == os.path.realpath(now)
    return saved == now


# ------------------------------------------------------------------------------------------ value parsing
def _unknown_key(name: str, where: str) -> UserError:
    # an anchor's key misspelt gets that key suggested (it is accepted), ours get ours
    close = suggestion(name, [*FIELDS, *foreign_configs.KEYS], ALIASES)
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
    if isinstance(value, str) and value.strip().lower() == "none" and "none" in CHOICES.get(name, ()):
        return "none"  # a choice named none (report_to), not a missing value
    if name in TEXT_KEYS and isinstance(value, str) and not value.strip():
        raise UserError(f"{name} in {where} is empty: give the text, or leave {name} out (none)")
    if value is None or isinstance(value, str) and value.strip().lower() in ("none", "null", "~", ""):
        if optional:
            return None
        raise UserError(f"{name} in {where} cannot be none")
    if base is bool:
        switch = switch_value(value)
        if switch is None:
            raise UserError(f"{name} in {where} must be true or false, got {value!r}")
        return switch
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
    if isinstance(value, bool) and {"on", "off"} <= set(CHOICES.get(name, ())):
        return "on" if value else "off"  # YAML 1.1 reads an unquoted on/off as true/false
    if isinstance(value, bool):
        raise UserError(
            f"{name} in {where} must be a string, got {value!r} (YAML reads unquoted yes/no/on/off/true/false as a "
            f"boolean: quote the value, e.g. {name}: '{str(value).lower()}')"
        )
    if name == "target_modules" and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)  # a YAML list of module names (ms-swift writes them so)
    if name in LIST_KEYS:  # several datasets (mixing.py): a YAML list is the comma list
        return _list_value(name, value, where)
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


# free text where an empty value is a mistake, not none (`--system ''` would silently train without one)
TEXT_KEYS = ("system",)
# several datasets (mixing.py): keys that take a YAML list or several values, and what each item must be
LIST_KEYS = {
    "dataset": ((str,), "a dataset name or path"),
    "eval_dataset": ((str,), "a dataset name or path"),
    "interleave_probs": ((int, float, str), "a number"),
}


def _is_item(name: str, value) -> bool:
    """interleave_probs' items are numbers, also inside a comma string ("0.3,0.7")."""
    if name != "interleave_probs" or not isinstance(value, str):
        return True
    try:
        return all(math.isfinite(float(p)) for p in value.split(",") if p.strip())
    except ValueError:
        return False


def _list_value(name: str, value, where: str) -> str:
    """A list key's YAML value (a string, or a list of items of its kind) as the comma list the trainer reads."""
    kinds, item = LIST_KEYS[name]
    items = value if isinstance(value, list) else [value]
    if items and all(isinstance(v, kinds) and not isinstance(v, bool) and _is_item(name, v) for v in items):
        return ",".join(str(v) for v in items)
    raise UserError(
        f"{name} in {where} must be {item} or a list of them (as a YAML list or a comma list), got {value!r}"
    )


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
        if name != "config" and name not in FIELDS and not foreign_configs.known(name):
            raise _unknown_key(name, "the command line")
        is_bool = (
            name in foreign_configs.BOOL_KEYS or name in FIELDS and typing.get_type_hints(TrainConfig)[name] is bool
        )
        if not eq:
            next_is_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            if is_bool and not next_is_value:
                value = True
            elif next_is_value:
                i += 1
                value = argv[i]
                # several datasets (mixing.py): ms-swift's `--dataset a.json b.json` is the comma list a.json,b.json
                while name in LIST_KEYS and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    i += 1
                    value = f"{value},{argv[i]}"
            else:
                raise UserError(f"--{name} needs a value")
        if name == "config":
            config_path = value
        else:
            flags[name] = value
        i += 1
    return config_path, flags


def _split(source: dict, where: str) -> tuple[dict, dict]:
    """(our keys, anchor keys) of one source (the YAML file or the flags); any other name is refused."""
    ours, theirs = {}, {}
    for name, value in source.items():
        name = str(name)
        if name in FIELDS and not foreign_configs.their_spelling(name, value):
            ours[name] = value
        elif foreign_configs.known(name):
            theirs[name] = value
        else:
            raise _unknown_key(name, where)
    return ours, theirs


def resolve_config(argv: list[str], base: dict | None = None, log=None) -> tuple[TrainConfig, set[str]]:
    """defaults (or `base`, a saved run's config) < YAML < flags. Returns the config and the keys set explicitly.

    LLaMA-Factory and ms-swift keys in either are mapped onto ours (`foreign_configs`), and the mapping is printed once
    through `log`; a LLaMA-Factory config's missing training keys take LLaMA-Factory's defaults (below the YAML)."""
    config_path, flags = parse_flags(argv)
    values = {}
    for name, value in (base or {}).items():
        if name not in FIELDS:
            raise UserError(f"unknown key {name!r} in the saved config (written by another version of fused-stable?)")
        values[name] = _coerce(name, value, "the saved config")
    sources = []  # (where, our keys, anchor keys)
    if config_path is not None:
        sources.append((config_path, *_split(_read_yaml(config_path), config_path)))
    sources.append(("the command line", *_split(flags, "the command line")))
    anchor = foreign_configs.anchor_of({name for _, _, theirs in sources for name in theirs})
    lines: list[str] = []
    if anchor in foreign_configs.ANCHOR_DEFAULTS and base is None:
        values.update(foreign_configs.ANCHOR_DEFAULTS[anchor])
    explicit: set[str] = set()
    raw_anchor: dict = {}
    for where, ours, theirs in sources:
        mapped = foreign_configs.translate(theirs, where)
        both = sorted(set(mapped.values) & set(ours))
        if both:
            raise UserError(f"{where} sets {', '.join(both)} twice: by its own name and by another trainer's name")
        lines += mapped.lines
        raw_anchor.update(theirs)
        if values.get("precision") in mapped.precisions_off:  # `--bf16 false` over the file's `bf16: true`
            lines.append(f"{values['precision']}: false over the earlier true -> precision: fp32")
            values["precision"] = "fp32"
            explicit.add("precision")
        label = where if where == config_path else None
        for name, value in {**mapped.values, **ours}.items():
            if anchor is not None and name == "max_steps" and value in (-1, "-1"):
                value = None  # the HF Trainer's "no limit"
            if anchor is not None and name in ours and name in ("model", "dataset"):
                value = _anchor_value(anchor, name, value, where, lines)
            values[name] = _coerce(name, value, label or f"--{name}")
            explicit.add(name)
    if anchor == foreign_configs.LLAMA_FACTORY and "lora_alpha" not in explicit and "lora_r" in values:
        values["lora_alpha"] = 2 * values["lora_r"]  # LLaMA-Factory: lora_alpha defaults to 2 x lora_rank
    if anchor == foreign_configs.LLAMA_FACTORY:
        for key in ("dataset", "eval_dataset"):  # both are names in dataset_info.json, loaded alike (mixing.py)
            given = values.get(key, FIELDS[key].default)
            if given is not None:
                values[key], line = _llamafactory_dataset(given, raw_anchor, key)
                lines += [line] if line else []
    if anchor == foreign_configs.LLAMA_FACTORY and raw_anchor.get("template") is not None:
        _check_template(str(raw_anchor["template"]), values.get("model", FIELDS["model"].default))
    cfg = TrainConfig(**values)
    validate(cfg)
    if lines and log is not None:
        defaults = ", ".join(
            f"{k}: {getattr(cfg, k)}" for k in foreign_configs.ANCHOR_DEFAULTS.get(anchor, {}) if k not in explicit
        )
        log(
            f"{anchor or 'anchor'} keys read as fused-stable sft's:\n  "
            + "\n  ".join(lines)
            + (f"\n  {anchor}'s defaults for the keys not given: {defaults}" if defaults else "")
        )
    return cfg, explicit


def _anchor_value(anchor: str, name: str, value, where: str, lines: list):
    """A key spelt as ours (`model`, `dataset`) but written for another trainer: its value in that trainer's terms."""
    try:
        if name == "model":
            ours = foreign_configs.public_model(value)
        else:
            ours = foreign_configs.swift_dataset(value) if anchor == foreign_configs.MS_SWIFT else value
    except foreign_configs.Refused as exc:
        raise UserError(f"{where}: {name}: {exc}") from None
    if ours != value:
        lines.append(f"{name}: {value} -> {name}: {ours}")
    return ours


def _llamafactory_dataset(dataset: str, raw: dict, key: str = "dataset") -> tuple[str, str | None]:
    """LLaMA-Factory's `dataset`, a comma list (mixing.py), each item (its `#N` kept) resolved by
    `_llamafactory_one`; the lines of the mapping joined."""
    lines = []

    def resolved(name: str) -> str:
        path, line = _llamafactory_one(name, raw, key)
        lines.extend([line] if line else [])
        return path

    return mixing.rename(dataset, resolved), "; ".join(lines) or None


def _llamafactory_one(dataset: str, raw: dict, key: str = "dataset") -> tuple[str, str | None]:
    """One LLaMA-Factory dataset (a name in dataset_dir/dataset_info.json, dataset_dir defaulting to `data`)
    as a file path; a path, or a built-in name without an entry, stays as it is."""
    dataset_dir = str(raw.get("dataset_dir") or "data")
    if os.path.isfile(dataset) or dataset.lower().endswith((".json", ".jsonl")):
        return dataset, None
    if dataset in foreign_configs.dataset_names(dataset_dir) or dataset not in ("identity", "arithmetic"):
        path = foreign_configs.resolve_dataset(dataset, dataset_dir)
        return path, f"{key}: {dataset} -> {key}: {path} ({os.path.join(dataset_dir, 'dataset_info.json')})"
    return dataset, f"{key}: {dataset} -> the built-in {dataset} task (no {dataset_dir}/dataset_info.json entry)"


def _check_template(template: str, model: str) -> None:
    """LLaMA-Factory's `template` is honoured when it is the model's own chat template, the one used here."""
    if model == "smollm2-135m" and template.lower() not in foreign_configs.SMOLLM2_TEMPLATES:
        raise UserError(
            f"template: {template} cannot be honoured: {model} is formatted with its own ChatML chat template "
            f"(LLaMA-Factory's {' / '.join(foreign_configs.SMOLLM2_TEMPLATES)}); remove the key or use one of those"
        )


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


# tuner names other tools use for a quantised base: ours is the tuner plus quant_bits
QUANTISED_TUNERS = {
    "qlora": "QLoRA is --tuner lora --quant_bits 4",
    "qdora": "QDoRA is --tuner dora --quant_bits 4",
}
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def validate(cfg: TrainConfig) -> None:
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            hint = QUANTISED_TUNERS.get(getattr(cfg, name)) if name == "tuner" else None
            hint = f"; {hint}" if hint else ""
            raise UserError(f"{name} must be one of {' | '.join(allowed)}, got {getattr(cfg, name)!r}{hint}")
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
    if cfg.muon_lora and cfg.optim != "muon":
        raise UserError(
            f"muon_lora puts the LoRA factors on Muon: it needs optim muon, not {cfg.optim} (drop muon_lora, or "
            "add optim muon)"
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
    if cfg.system is not None and not cfg.system.strip():
        raise UserError("system cannot be empty: give the text, or leave it out (none)")
    if cfg.val_size >= 1 and cfg.val_size != int(cfg.val_size):
        raise UserError(f"val_size must be a fraction below 1 or a whole count of examples, got {cfg.val_size:g}")
    if cfg.interleave_probs not in (None, "") and cfg.mix_strategy == "concat":
        raise UserError(
            f"interleave_probs {cfg.interleave_probs} applies to mix_strategy interleave_under or interleave_over; "
            "concat takes every example of each dataset once (LLaMA-Factory refuses it too): set mix_strategy, or "
            "leave interleave_probs out"
        )
    mixing.parse_probs(cfg.interleave_probs, len(mixing.parse(cfg.dataset)))  # several datasets (mixing.py)
    _check_eval_dataset(cfg)
    if cfg.val_size and mixing.is_identity_only(cfg.dataset):
        raise UserError(
            "val_size does not apply to dataset=identity: the task holds out its own set (the identity "
            "paraphrases of its evaluation) for eval_loss"
        )
    check_device(cfg.device)
    from fused_stable.train.run import deepspeed_run, optimizers

    deepspeed_run.check_keys(cfg)  # the DeepSpeed keys and file, before the model loads
    optimizers.check_available(cfg, deepspeed=deepspeed_run.wanted(cfg))  # the rule with the run's keys and engine
    try:
        guard_config(cfg)
    except ValueError as exc:
        raise UserError(str(exc).replace("guard ", "guard_", 1) if "policy" not in str(exc) else str(exc)) from None


def _check_eval_dataset(cfg: TrainConfig) -> None:
    """eval_dataset (LLaMA-Factory's): the held-out set instead of val_size (LLaMA-Factory refuses both too),
    mixed as the training datasets are, so interleave_probs must fit it as well when it names several."""
    if cfg.eval_dataset is None:
        return
    if not mixing.split_list(cfg.eval_dataset):
        raise UserError("eval_dataset cannot be empty (leave it out, or name the held-out datasets)")
    if cfg.val_size:
        raise UserError(
            f"eval_dataset and val_size={cfg.val_size:g} both choose the held-out set: give one of them "
            "(as LLaMA-Factory, which refuses both)"
        )
    count = len(mixing.parse(cfg.eval_dataset))
    if count > 1 and cfg.mix_strategy != "concat" and cfg.interleave_probs:
        try:
            mixing.parse_probs(cfg.interleave_probs, count)
        except UserError as exc:
            raise UserError(f"eval_dataset {cfg.eval_dataset!r} is mixed as dataset is: {exc}") from None


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
        eval_lr_factor=cfg.guard_eval_lr_factor,
        max_rollbacks=cfg.guard_max_rollbacks,
    )


def eval_steps(cfg: TrainConfig) -> int:
    """The evaluation interval: `eval_steps`, or EVAL_EVERY_LOGS logging intervals when it is none."""
    return cfg.eval_steps if cfg.eval_steps is not None else EVAL_EVERY_LOGS * cfg.logging_steps


def retention_probe(cfg: TrainConfig) -> bool:
    """Whether the run measures retention_loss: `auto` means a pretrained model (anything but the scratch tiny
    Llama, whose own answers say nothing worth keeping)."""
    return cfg.retention_probe == "on" or (cfg.retention_probe == "auto" and cfg.model != "tiny")


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    """Warm-up steps as the HF Trainer counts them (transformers 5.24 `TrainingArguments.get_warmup_steps`:
    `int(warmup_steps) if warmup_steps >= 1 else math.ceil(num_training_steps * warmup_steps)`; 4.x, which
    LLaMA-Factory 0.9 runs: `warmup_steps if warmup_steps > 0 else math.ceil(num_training_steps * warmup_ratio)`):
    a ratio is rounded up, so 0.1 of 27 steps is 3.

    Capped at total_steps - 1 (`warmup_asked` is the uncapped count): a warm-up's first step is at lr 0, as the HF
    Trainer's is, so a warm-up as long as the run would end it below its peak lr, and `--max_steps 1` would train
    its only step at lr 0 (the HF Trainer does exactly that: ceil(0.1 x 1) = 1 warm-up step)."""
    return min(warmup_asked(cfg, total_steps), max(total_steps - 1, 0))


def warmup_asked(cfg: TrainConfig, total_steps: int) -> int:
    """The warm-up the keys ask for, before `warmup_steps` caps it below the run's length."""
    if cfg.warmup_steps:
        return cfg.warmup_steps
    return math.ceil(cfg.warmup_ratio * total_steps)


def run_dict(cfg: TrainConfig) -> dict:
    """The config as stored in run.yaml and checkpoints: what defines the run, without launch-only keys."""
    return {k: v for k, v in cfg.to_dict().items() if k not in LAUNCH_KEYS}


def dump_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(run_dict(cfg), sort_keys=False)
