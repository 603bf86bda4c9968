"""The set-up form's meaning, without gradio: which sft keys each field sets, the tuner choices, the ready-made
presets, and the "safe defaults" table with what each value guards against.

The form's fields come first and the YAML box's keys over them (the box is for every other key, and wins
where it names a field's key too); a field left at the sft default is not written, so the command line shown
is the shortest one that gives the same run.
"""

from __future__ import annotations

import typing

from fused_stable.train.config.keys import CHOICES, FIELDS, TrainConfig

# tuner label -> the sft keys it sets (others at their defaults)
TUNERS = {
    "LoRA": {"tuner": "lora", "quant_bits": None, "loraplus_lr_ratio": None},
    "QLoRA": {"tuner": "lora", "quant_bits": 4, "loraplus_lr_ratio": None},
    "DoRA": {"tuner": "dora", "quant_bits": None, "loraplus_lr_ratio": None},
    "LoRA+": {"tuner": "lora", "quant_bits": None, "loraplus_lr_ratio": 16.0},
    "full": {"tuner": "full", "quant_bits": None, "loraplus_lr_ratio": None},
}

# the choices of the form's optimizer drop-downs, as sft takes them: the update rule and its state precision
OPTIMIZER_CHOICES = {key: CHOICES[key] for key in ("optim", "state_precision")}
# the form's fields that are sft keys as they are, in the order the form shows them
FIELD_KEYS = (
    "model",
    "dataset",
    "precision",
    "guard",
    "optim",
    "state_precision",
    "batch_size",
    "grad_accum",
    "max_steps",
    "epochs",
    "lr",
    "lora_r",
    "lora_alpha",
    "max_grad_norm",
    "warmup_ratio",
    "scheduler",
    "weight_decay",
)

# The recipe the seeds recommend: value, and what it guards against (shown in the page when pressed).
SAFE_DEFAULTS = {
    "max_grad_norm": (
        1.0,
        "one bad batch moving the weights far: the update is scaled down whenever the global gradient norm "
        "passes 1.0 (the dashed line on the grad-norm plot)",
    ),
    "warmup_ratio": (
        0.1,
        "the first steps, when Adam's moment estimates are still noise and a full learning rate overshoots: "
        "the lr climbs linearly over the first 10% of the steps (5-10% is the usual range)",
    ),
    "scheduler": (
        "cosine",
        "a high lr late in training that keeps the loss oscillating: after warm-up the lr decays smoothly to 0",
    ),
    "weight_decay": (
        0.01,
        "AdamW's decoupled weight decay on matrices only: weights drifting large without a penalty that "
        "would distort Adam's per-weight step sizes (for the default rule, adamw; lion takes 3-10x more)",
    ),
    "lora_r": (
        16,
        "a rank too low to learn the task or so high that a small data set is memorised (8-64 is the usual range)",
    ),
    "lora_alpha": (32, "an adapter update whose size depends on the rank: alpha = 2 x rank keeps its scale"),
    "precision": (
        "auto",
        "fp16 overflow and wasted memory: mixed precision (AMP) in bf16 where the GPU has it, which needs no "
        "loss scaling; fp32 on a CPU, where emulated bf16 is slower",
    ),
}

PRESETS = {
    "default run (SmolLM2-135M, identity task)": ({}, ""),
    "tiny demo (seconds on a CPU)": (
        {"model": "tiny", "dataset": "arithmetic", "max_steps": 50},
        "arithmetic_examples: 256\nmax_length: 96\nlogging_steps: 1\nsave_steps: 25\ntensorboard: false\n",
    ),
}


_INT_KEYS = {k for k, hint in typing.get_type_hints(TrainConfig).items() if int in (hint, *typing.get_args(hint))}


def default(key: str):
    return FIELDS[key].default


def safe_defaults_table() -> str:
    """Markdown: each safe default, its value and what it guards against."""
    lines = ["| key | value | guards against |", "|---|---|---|"]
    lines += [f"| `{key}` | `{value}` | {why} |" for key, (value, why) in SAFE_DEFAULTS.items()]
    return "\n".join(lines)


def _is_default(key: str, value) -> bool:
    if value is None or value == "":
        return default(key) is None
    try:
        return type(default(key))(value) == default(key) if default(key) is not None else False
    except (TypeError, ValueError):
        return False


def form_keys(fields: dict, tuner: str, run_name: str) -> dict:
    """The run's sft keys from the form's fields: those that differ from the sft default, the tuner's keys
    and the run folder."""
    keys: dict = {}
    for key in FIELD_KEYS:
        value = fields.get(key)
        if key == "max_steps" and value in (0, None, ""):
            continue  # none: derived from epochs
        if key == "dataset" and isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)  # several datasets, mixed (train/data/mixing.py)
        if isinstance(value, float) and value.is_integer() and key in _INT_KEYS:
            value = int(value)  # a number field gives 20.0 for 20
        if not _is_default(key, value):
            keys[key] = value
    for key, value in TUNERS.get(tuner, TUNERS["LoRA"]).items():
        if value != default(key):
            keys[key] = value
    if run_name and run_name.strip():
        keys["output_dir"] = run_name.strip()
    return keys


def run_keys(fields: dict, tuner: str, run_name: str, extra_yaml: str) -> dict:
    """The form's keys, then the YAML box's over them; UserError for a box that is not a YAML mapping."""
    from fused_stable.webui.controller import parse_keys

    return {**form_keys(fields, tuner, run_name), **parse_keys(extra_yaml)}
