"""Configs written for LLaMA-Factory or ms-swift, run as they are: their key names mapped onto `fused-stable
sft`'s, their values converted (`lora_target: all` is `target_modules: all-linear`, `finetuning_type: lora` is
`tuner: lora`, ...), and LLaMA-Factory's `dataset` names looked up in `dataset_dir/dataset_info.json`.

A key this trainer cannot honour is refused (all of them in one line, each with why), never silently dropped;
a key that has no effect here (worker counts, caches) is accepted and said so in the mapping, which the run
prints once. A LLaMA-Factory config (one with a key only LLaMA-Factory uses) also gets LLaMA-Factory's and the
HF Trainer's defaults for the training keys it leaves out (`ANCHOR_DEFAULTS`), so it trains as it would there.
How the keys are then read and checked is `config`'s job; the table is documented in docs/trainer.md,
"Coming from LLaMA-Factory / ms-swift".
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from fused_stable.errors import UserError
from fused_stable.integrations import optim_names
from fused_stable.train.config.keys import switch_value
from fused_stable.train.run.optimizers import RULES

RULE_NAMES = tuple(RULES)  # our `optim` values

LLAMA_FACTORY = "LLaMA-Factory"
MS_SWIFT = "ms-swift"
BOTH = (LLAMA_FACTORY, MS_SWIFT)
# the embedded model under its public (Hugging Face) names
PUBLIC_MODEL_NAMES = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m",
}
_BY_PUBLIC_NAME = {name.lower(): alias for name, alias in PUBLIC_MODEL_NAMES.items()}


def public_name(alias: str) -> str | None:
    """The embedded model `alias`'s public (Hugging Face) name, or None."""
    return next((name for name, known in PUBLIC_MODEL_NAMES.items() if known == alias), None)


# LLaMA-Factory's `template` names that are the embedded SmolLM2's own ChatML chat template
SMOLLM2_TEMPLATES = ("smollm", "smollm2", "chatml")


class Refused(Exception):
    """A value this trainer cannot honour; the message says why."""


def _same(value):
    return value


def _choice(mapping: dict, what: str):
    def convert(value):
        key = str(value).strip().lower()
        if key not in mapping:
            raise Refused(f"{what} {value!r} is not supported here (supported: {', '.join(mapping)})")
        return mapping[key]

    return convert


def _must_be(expected, why: str):
    def convert(value):
        if isinstance(expected, bool):  # a switch (in BOOL_KEYS: a boolean already, checked by `translate`)
            if switch_value(value) is not expected:
                raise Refused(why)
        elif value != expected and str(value).strip().lower() != str(expected).lower():
            raise Refused(why)
        return None

    return convert


def _modules(value):
    """lora_target / target_modules: `all` (LLaMA-Factory), `all-linear`, a comma list or a YAML list."""
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    text = str(value).strip()
    return "all-linear" if text in ("all", "all-linear") else text


def _true(value) -> bool:
    return switch_value(value) is True


def _if_true(result):
    def convert(value):
        return result if _true(value) else None

    return convert


def _identity_name(value):
    # ms-swift's --model_name / --model_author take [Chinese name, English name]; the identity task is English
    if isinstance(value, (list, tuple)):
        if not value:
            raise Refused("an empty list")
        return str(value[-1])
    return value


def public_model(value):
    """A model's public name (`HuggingFaceTB/SmolLM2-135M-Instruct`) as the embedded model it is, unless a local
    folder has that name."""
    text = str(value).strip()
    return text if os.path.isdir(os.path.expanduser(text)) else _BY_PUBLIC_NAME.get(text.lower(), text)


def swift_dataset(value):
    """ms-swift's --dataset (several values joined with commas, each maybe `#N`): swift/self-cognition is the
    built-in identity task (filled with --model_name / --model_author), its `#N` kept (train/data/mixing.py)."""
    from fused_stable.train.data import mixing

    return mixing.rename(value, lambda name: "identity" if name in mixing.SELF_COGNITION else name)


def _dtype(value):
    return _choice({"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "fp32"}, "dtype")(
        value
    )


def _report_to(value):
    """The HF Trainer's report_to (a name or a list of names) as our one logger."""
    names = [str(v).strip().lower() for v in (value if isinstance(value, (list, tuple)) else [value])]
    names = [n for n in names if n not in ("none", "")] or ["none"]
    if len(names) > 1 or names[0] not in ("tensorboard", "wandb", "none"):
        raise Refused("one of tensorboard, wandb or none")
    return names[0]


def _eval_strategy(value):
    """The HF Trainer's eval_strategy: `no` turns the evaluations during training off (eval_steps 0); `steps` is
    what this trainer does (nothing to set); `epoch` has no counterpart."""
    text = str(value).strip().lower()
    if value is False or text == "no":  # YAML reads an unquoted `no` as false
        return 0
    if text == "steps":
        return None
    raise Refused("evaluations run every eval_steps optimizer steps: use eval_strategy: steps (or no)")


def _optim(value):
    """The HF Trainer's `optim`: an AdamW or Lion name as our rule and the state precision it stands for
    (integrations/optim_names.py, two of our keys); any other name is refused, naming the supported values."""
    why = optim_names.NOT_MAPPED.get(str(value).strip().lower())
    if why is not None:
        raise Refused(f"no fused rule for it: {why}")
    try:
        entry = optim_names.lookup(value)
    except ValueError:
        supported = ", ".join(optim_names.OPTIMS)
        raise Refused(
            f"no fused rule for it; supported optim values: {' | '.join(RULE_NAMES)}, or the HF Trainer's {supported}"
        ) from None
    return {"optim": entry.rule, "state_precision": entry.state_precision}


# ms-swift's --optimizer (swift/plugin/optimizer.py `optimizers_map`): `muon` is Moonlight's Muon over every
# trainable param of 2 or more dimensions whose name has neither the embedding's nor the head's key, LoRA factors
# included, AdamW over the rest; `default` is the HF Trainer's optimizer, which swift's own `optim` names
SWIFT_OPTIMIZERS = {"muon": {"optim": "muon", "muon_lora": True}, "default": None}


def _swift_optimizer(value):
    name = str(value).strip().lower()
    if name not in SWIFT_OPTIMIZERS:
        raise Refused(f"not supported here (supported: {', '.join(SWIFT_OPTIMIZERS)})")
    return SWIFT_OPTIMIZERS[name]


def their_spelling(name: str, value) -> bool:
    """Whether a key spelt as ours is another trainer's: `optim` is ours with a rule's name (adamw, lion, muon),
    the HF Trainer's with any other (adamw_torch, lion_8bit, adafactor...)."""
    return name == "optim" and str(value).strip().lower() not in RULE_NAMES


@dataclass(frozen=True)
class AnchorKey:
    anchors: tuple[str, ...]  # the trainers that use this name
    ours: str | None  # the key it sets (None: checked, then nothing to set; "*": convert names the keys)
    # value -> our value (None: nothing to set; with ours "*" a dict of our keys); Refused when it cannot be honoured
    convert: Callable = _same
    note: str = ""  # printed in the mapping for a key with no effect here
    explain: Callable | None = None  # value -> what the mapped value means here, printed beside it


# every anchor key this trainer reads; keys spelled as ours (lora_alpha, output_dir, seed, ...) need no entry
KEYS: dict[str, AnchorKey] = {
    "model_name_or_path": AnchorKey((LLAMA_FACTORY,), "model", public_model),
    "stage": AnchorKey(
        (LLAMA_FACTORY,),
        None,
        _must_be("sft", "only stage: sft (supervised fine-tuning) runs here"),
        note="supervised fine-tuning, what sft runs",
    ),
    "do_train": AnchorKey(
        (LLAMA_FACTORY,), None, _must_be(True, "do_train: false trains nothing"), note="sft always trains"
    ),
    "finetuning_type": AnchorKey((LLAMA_FACTORY,), "tuner", _choice({"lora": "lora", "full": "full"}, "finetuning")),
    "train_type": AnchorKey((MS_SWIFT,), "tuner", _choice({"lora": "lora", "full": "full"}, "train_type")),
    # swift's current name for train_type (both are read: swift renamed it, its older scripts keep train_type)
    "tuner_type": AnchorKey((MS_SWIFT,), "tuner", _choice({"lora": "lora", "full": "full"}, "tuner_type")),
    "use_dora": AnchorKey(BOTH, "tuner", _if_true("dora")),
    "lora_rank": AnchorKey(BOTH, "lora_r"),
    "lora_target": AnchorKey((LLAMA_FACTORY,), "target_modules", _modules),
    "quantization_bit": AnchorKey((LLAMA_FACTORY,), "quant_bits"),
    "quantization_method": AnchorKey(
        (LLAMA_FACTORY,), None, _must_be("bnb", "only bitsandbytes (bnb) quantisation runs here")
    ),
    "double_quantization": AnchorKey(
        (LLAMA_FACTORY,), None, _must_be(True, "4-bit quantisation here is always NF4 with double quantisation")
    ),
    "quant_method": AnchorKey((MS_SWIFT,), None, _must_be("bnb", "only bitsandbytes (bnb) quantisation runs here")),
    "bnb_4bit_quant_type": AnchorKey((MS_SWIFT,), None, _must_be("nf4", "4-bit quantisation here is NF4")),
    # the 4-bit layers compute in the run's precision: swift's compute dtype sets it (a different torch_dtype or
    # bf16 / fp16 key beside it is refused as two values for one key)
    "bnb_4bit_compute_dtype": AnchorKey(
        (MS_SWIFT,), "precision", _dtype, note="the 4-bit layers compute in the run's precision"
    ),
    "bnb_4bit_use_double_quant": AnchorKey(
        (MS_SWIFT,), None, _must_be(True, "4-bit quantisation here is always NF4 with double quantisation")
    ),
    # the rule and its state: two of our keys (optim, state_precision)
    "optim": AnchorKey(BOTH, "*", _optim, explain=optim_names.describe),
    # ms-swift's Muon: its LoRA factors on Muon too (muon_lora), as swift splits them
    "optimizer": AnchorKey(
        (MS_SWIFT,), "*", _swift_optimizer, note="swift's default optimizer: the rule optim names (adamw)"
    ),
    # LLaMA-Factory's Muon switch: Muon in place of the AdamW `optim` names (its AdamW part takes the 1-D params)
    "use_muon": AnchorKey((LLAMA_FACTORY,), "optim", _if_true("muon"), note="off, optim as given"),
    "dataset_dir": AnchorKey((LLAMA_FACTORY,), None, note="where dataset_info.json names the datasets"),
    "template": AnchorKey((LLAMA_FACTORY,), None, note="the model's own chat template formats every example"),
    "cutoff_len": AnchorKey((LLAMA_FACTORY,), "max_length"),
    # the template's default system message, for the examples without one: ms-swift's --system, spelt as ours
    "default_system": AnchorKey((LLAMA_FACTORY,), "system"),
    "learning_rate": AnchorKey(BOTH, "lr"),
    "num_train_epochs": AnchorKey(BOTH, "epochs"),
    "per_device_train_batch_size": AnchorKey(BOTH, "batch_size"),
    "gradient_accumulation_steps": AnchorKey(BOTH, "grad_accum"),
    "lr_scheduler_type": AnchorKey(
        BOTH,
        "scheduler",
        _choice(
            {"cosine": "cosine", "linear": "linear", "constant_with_warmup": "constant", "constant": "constant"},
            "lr_scheduler_type",
        ),
    ),
    "bf16": AnchorKey(BOTH, "precision", _if_true("bf16")),
    "fp16": AnchorKey(BOTH, "precision", _if_true("fp16")),
    "torch_dtype": AnchorKey((MS_SWIFT,), "precision", _dtype),
    "overwrite_output_dir": AnchorKey((LLAMA_FACTORY,), "overwrite"),
    "report_to": AnchorKey(BOTH, "report_to", _report_to),
    "resume_from_checkpoint": AnchorKey(BOTH, "resume"),
    # val_size and eval_steps are spelt as ours, with the same meaning (a fraction or a count held out; every N
    # optimizer steps); the evaluation strategy is ours, steps
    "eval_strategy": AnchorKey(BOTH, "eval_steps", _eval_strategy, note="evaluations every eval_steps steps"),
    "split_dataset_ratio": AnchorKey((MS_SWIFT,), "val_size"),
    "per_device_eval_batch_size": AnchorKey(
        BOTH, None, note="no effect: the held-out losses are measured in batches of batch_size"
    ),
    "model_name": AnchorKey((MS_SWIFT,), "identity_name", _identity_name),
    "model_author": AnchorKey((MS_SWIFT,), "identity_author", _identity_name),
    "plot_loss": AnchorKey((LLAMA_FACTORY,), None, note="curves.png is always drawn"),
    "preprocessing_num_workers": AnchorKey((LLAMA_FACTORY,), None, note="no effect: tokenisation is in-process"),
    "dataloader_num_workers": AnchorKey(BOTH, None, note="no effect: batches are built in-process"),
    "dataset_num_proc": AnchorKey((MS_SWIFT,), None, note="no effect: tokenisation is in-process"),
    "overwrite_cache": AnchorKey((LLAMA_FACTORY,), None, note="no effect: no tokenised-data cache here"),
    "ddp_timeout": AnchorKey((LLAMA_FACTORY,), None, note="no effect: torchrun's default timeout is used"),
    "trust_remote_code": AnchorKey(BOTH, None, note="no effect: no remote code is ever run"),
    "save_only_model": AnchorKey(BOTH, None, note="checkpoints also keep the optimizer state, for --resume"),
}
# anchor keys that are known but cannot be honoured here, with why (refused, all in one line)
REFUSED = {
    "flash_attn": "the attention implementation is the model's default",
    "attn_impl": "the attention implementation is the model's default",
    "train_on_prompt": "only assistant turns are trained",
    "mask_history": "every assistant turn is trained",
    "freeze_trainable_layers": "finetuning_type: freeze is not supported",
    "use_rslora": "rank-stabilised LoRA is not supported",
    "pissa_init": "PiSSA initialisation is not supported",
    "additional_target": "extra trained modules are not supported",
    "lora_modules_to_save": "extra trained modules are not supported",
    "modules_to_save": "extra trained modules are not supported",
    "lr_scheduler_kwargs": "the schedules take no extra arguments",
    "warmup_ratio_min": "not supported",
    "rope_scaling": "the model's position encoding is used as it is",
    "streaming": "datasets are read whole",
    "use_unsloth": "not supported",
    "enable_liger_kernel": "not supported",
    "booster": "not supported",
}
# LLaMA-Factory's defaults (its FinetuningArguments / DataArguments, and the HF TrainingArguments it extends,
# checked against the installed transformers by tests/train/test_anchors.py) where ours differ, for the training
# keys a LLaMA-Factory config leaves out. lora_alpha's (2 x lora_rank) is applied by `config`.
ANCHOR_DEFAULTS = {
    LLAMA_FACTORY: {
        "lr": 5e-5,
        "weight_decay": 0.0,
        "epochs": 3.0,
        "batch_size": 8,
        "scheduler": "linear",
        "warmup_ratio": 0.0,
        "max_length": 2048,
        "target_modules": "all-linear",
    },
}
# the other trainers' switches: a flag alone is true, and a value must be a boolean (`translate` refuses any other)
BOOL_KEYS = frozenset(
    {
        "do_train",
        "use_dora",
        "double_quantization",
        "bnb_4bit_use_double_quant",
        "save_only_model",
        "bf16",
        "fp16",
        "overwrite_output_dir",
        "plot_loss",
        "overwrite_cache",
        "trust_remote_code",
        "use_muon",
    }
)


def known(name: str) -> bool:
    return name in KEYS or name in REFUSED


def anchor_of(names) -> str | None:
    """Which trainer a set of key names was written for: LLaMA-Factory or ms-swift (a key only it uses), or None."""
    only = {KEYS[n].anchors[0] for n in names if n in KEYS and len(KEYS[n].anchors) == 1}
    if len(only) > 1:
        lf = sorted(n for n in names if n in KEYS and KEYS[n].anchors == (LLAMA_FACTORY,))
        swift = sorted(n for n in names if n in KEYS and KEYS[n].anchors == (MS_SWIFT,))
        raise UserError(
            f"the keys mix LLaMA-Factory's ({', '.join(lf)}) and ms-swift's ({', '.join(swift)}): write one trainer's"
        )
    return only.pop() if only else None


@dataclass
class Mapped:
    values: dict  # our key -> value (still to be coerced and checked by config)
    lines: list  # "anchor_key: value -> our_key: value", for the mapping the run prints
    # the precisions this source turns off (`bf16: false`): a flag's false undoes the YAML file's true
    precisions_off: tuple = ()


# bf16 / fp16 false set nothing (the run's default precision stays), but over an earlier source's true they undo
# it: LLaMA-Factory with neither key trains in fp32
PRECISION_KEYS = {"bf16": "bf16", "fp16": "fp16"}


# LLaMA-Factory's switches, read after the other keys: each may replace one earlier value of its key, as it does
# there (use_dora: true turns finetuning_type lora into dora; use_muon: true builds Muon whatever AdamW optim says)
SWITCHES = {"use_dora": ("tuner", "lora"), "use_muon": ("optim", "adamw")}


def translate(raw: dict, where: str) -> Mapped:
    """Anchor keys (name -> value, as written) as ours. Keys that cannot be honoured are one UserError listing
    them all with why; two anchor keys that set the same key of ours differently are refused too."""
    not_switches = [n for n in raw if n in BOOL_KEYS and raw[n] is not None and switch_value(raw[n]) is None]
    if not_switches:
        name = not_switches[0]
        raise UserError(f"{name} in {where} must be true or false, got {raw[name]!r}")
    # a refused key at its "off" value asks for nothing this trainer lacks (`--use_rslora false` too)
    off = [name for name in raw if name in REFUSED and (raw[name] is None or switch_value(raw[name]) is False)]
    refused = [f"{name} ({REFUSED[name]})" for name in raw if name in REFUSED and name not in off]
    values: dict = {}
    sources: dict = {}
    lines: list = [f"{name}: {raw[name]} -> off, nothing to map" for name in off]
    for name in sorted((n for n in raw if n in KEYS), key=lambda n: n in SWITCHES):
        key, value = KEYS[name], raw[name]
        try:
            ours = key.convert(value)
        except Refused as exc:
            refused.append(f"{name}: {value} ({exc})")
            continue
        if key.ours is None or ours is None:
            lines.append(f"{name}: {value} -> {key.note or 'nothing to set'}")
            continue
        if name == "use_dora" and values.get("tuner") == "full":
            refused.append("use_dora: true (DoRA needs finetuning_type: lora)")
            continue
        settings = ours if key.ours == "*" else {key.ours: ours}
        clash = [
            k for k, v in settings.items() if k in values and values[k] != v and SWITCHES.get(name) != (k, values[k])
        ]
        if clash:
            refused.append(f"{name}: {value} (contradicts {sources[clash[0]]})")
            continue
        for ours_key, ours_value in settings.items():
            values[ours_key], sources[ours_key] = ours_value, f"{name}: {value}"
        explained = f" ({key.explain(value)})" if key.explain else ""
        lines.append(f"{name}: {value} -> {', '.join(f'{k}: {v}' for k, v in settings.items())}{explained}")
    if refused:
        raise UserError(f"{where}: keys fused-stable sft cannot honour: {'; '.join(refused)}")
    off = tuple(PRECISION_KEYS[n] for n in raw if n in PRECISION_KEYS and raw[n] is not None and not _true(raw[n]))
    return Mapped(values, lines, off)


# ---------------------------------------------------------------------------------------------- dataset_info.json
# LLaMA-Factory's default column and tag names (data/parser.py's DatasetAttr): a dataset_info.json entry that
# renames them names fields this trainer's row formats do not read, so it is refused rather than half-read
DEFAULT_COLUMNS = {
    "alpaca": {
        "prompt": "instruction",
        "query": "input",
        "response": "output",
        "history": "history",
        "system": "system",
    },
    "sharegpt": {"messages": "conversations", "system": "system"},
}
DEFAULT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "system_tag": "system",
}


def dataset_names(dataset_dir: str) -> list[str]:
    """The names dataset_dir/dataset_info.json defines ([] when there is none)."""
    info = os.path.join(dataset_dir, "dataset_info.json")
    if not os.path.isfile(info):
        return []
    try:
        return sorted(_read_info(info))
    except UserError:
        return []


def _read_info(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(info, dict):
        raise UserError(f"{path}: must be an object of dataset name -> entry")
    return info


def resolve_dataset(name: str, dataset_dir: str) -> str:
    """LLaMA-Factory's `dataset: name` as the file dataset_dir/dataset_info.json gives for it."""
    info_path = os.path.join(dataset_dir, "dataset_info.json")
    if not os.path.isfile(info_path):
        raise UserError(
            f"dataset {name!r}: {info_path} not found (LLaMA-Factory's dataset names are looked up there; "
            "set dataset_dir, or give the dataset as a .json/.jsonl path)"
        )
    info = _read_info(info_path)
    if name not in info:
        raise UserError(f"dataset {name!r} is not in {info_path} (it names: {', '.join(sorted(info)) or 'none'})")
    entry = info[name]
    where = f"{info_path}: {name!r}"
    if not isinstance(entry, dict) or "file_name" not in entry:
        hub = [k for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name") if k in entry]
        why = f"it is fetched from {hub[0]} and runs here offline" if hub else "it has no file_name"
        raise UserError(f"{where} cannot be used: {why}; download it and give its file_name")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in DEFAULT_COLUMNS:
        raise UserError(f"{where}: formatting {formatting!r} is not supported (alpaca or sharegpt)")
    if entry.get("ranking"):
        raise UserError(f"{where}: ranking (preference) data is for DPO, not sft")
    problems = [
        f"columns.{column}: {value!r}"
        for column, value in (entry.get("columns") or {}).items()
        if DEFAULT_COLUMNS[formatting].get(column) != value
    ]
    problems += [
        f"tags.{tag}: {value!r}" for tag, value in (entry.get("tags") or {}).items() if DEFAULT_TAGS.get(tag) != value
    ]
    if problems:
        raise UserError(
            f"{where}: renamed fields are not read here ({', '.join(problems)}): rename them in the file to "
            f"LLaMA-Factory's defaults ({formatting})"
        )
    path = os.path.join(dataset_dir, entry["file_name"])
    if os.path.isdir(path):
        raise UserError(f"{where}: file_name {entry['file_name']!r} is a directory; give one .json/.jsonl file")
    return path
