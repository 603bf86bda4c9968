"""The trainer's DeepSpeed config against transformers' as the oracle: the same run built through
`HfTrainerDeepSpeedConfig` (from `TrainingArguments`: `trainer_config_process`, then `trainer_config_finalize`
with the model) and through `fused-stable sft`'s filling (train/run/deepspeed_run.py), on examples/ds_zero2.json,
examples/ds_zero3_offload.json and LLaMA-Factory's ZeRO-3 config; every key the trainer fills is compared.

Differences kept, each with its reason (docs/trainer.md, DeepSpeed):
- `gradient_clipping`: transformers fills `max_grad_norm`; the trainer's clip is FusedAdamW's, so the engine's is
  0 (the oracle runs with max_grad_norm=0, where the two agree).
- a batch key the file leaves out: transformers leaves it out (DeepSpeed derives it), the trainer writes the value
  DeepSpeed would derive (the same number, checked below against DeepSpeed's rule).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("deepspeed")

from fused_stable.errors import UserError  # noqa: E402
from fused_stable.train.config.resolve import resolve_config  # noqa: E402
from fused_stable.train.run import deepspeed_run  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# LLaMA-Factory's examples/deepspeed/ds_z3_config.json (hiyouga/LLaMA-Factory), as its users pass it
LLAMA_FACTORY_Z3 = json.loads((Path(__file__).parent / "llamafactory_ds_z3_config.json").read_text())
LLAMA_FACTORY_Z3_AS_Z2 = copy.deepcopy(LLAMA_FACTORY_Z3)
LLAMA_FACTORY_Z3_AS_Z2["zero_optimization"]["stage"] = 2  # the ZeRO-3-only keys at a lower stage
FILLED = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
    "bf16.enabled",
    "fp16.enabled",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)
MISSING = object()


def _config(name):
    if isinstance(name, dict):
        return copy.deepcopy(name)
    return json.loads((EXAMPLES / name).read_text())


def _get(config: dict, key: str):
    for part in key.split("."):
        if not isinstance(config, dict) or part not in config:
            return MISSING
        config = config[part]
    return config


def _model(**config):
    return SimpleNamespace(config=SimpleNamespace(**config))


def _transformers(raw: dict, *, batch_size: int, grad_accum: int, bf16: bool, model, tmp_path) -> dict:
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum,
        max_grad_norm=0.0,
        bf16=bf16,
        use_cpu=True,
        report_to=[],
    )
    oracle = HfTrainerDeepSpeedConfig(copy.deepcopy(raw))
    oracle.trainer_config_process(args)
    oracle.trainer_config_finalize(args, model, num_training_steps=10)
    return oracle.config


def _ours(raw: dict, *, batch_size: int, grad_accum: int, precision: str, model, tmp_path) -> dict:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    cfg, _ = resolve_config(
        ["--deepspeed", str(path), "--batch_size", str(batch_size), "--grad_accum", str(grad_accum)]
    )
    hidden = deepspeed_run._hidden_size(raw, model, cfg)
    return deepspeed_run._fill(deepspeed_run._base_config(cfg), cfg, world_size=1, precision=precision, hidden=hidden)


CASES = {
    "ds_zero2-bf16": ("ds_zero2.json", 4, 1, "bf16"),
    "ds_zero3_offload-fp32": ("ds_zero3_offload.json", 4, 1, "fp32"),
    "llamafactory_z3-bf16": (LLAMA_FACTORY_Z3, 2, 3, "bf16"),
    "llamafactory_z3-fp32": (LLAMA_FACTORY_Z3, 2, 3, "fp32"),
    "llamafactory_z3_as_z2-bf16": (LLAMA_FACTORY_Z3_AS_Z2, 2, 3, "bf16"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    "model",
    [_model(hidden_size=64), _model(hidden_sizes=[32, 96, 48]), _model(text_config=SimpleNamespace(hidden_size=80))],
    ids=["hidden_size", "hidden_sizes", "text_config"],
)
def test_every_key_the_trainer_fills_is_what_transformers_fills(case, model, tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
    name, batch_size, grad_accum, precision = CASES[case]
    raw = _config(name)
    theirs = _transformers(
        raw, batch_size=batch_size, grad_accum=grad_accum, bf16=precision == "bf16", model=model, tmp_path=tmp_path
    )
    ours = _ours(raw, batch_size=batch_size, grad_accum=grad_accum, precision=precision, model=model, tmp_path=tmp_path)
    compared = 0
    for key in FILLED:
        expected, got = _get(theirs, key), _get(ours, key)
        if expected is MISSING and key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            # left out of the file: DeepSpeed derives it (train_batch_size = micro x accumulation x ranks)
            derived = {"train_batch_size": batch_size * grad_accum, "train_micro_batch_size_per_gpu": batch_size}
            assert got == derived[key], (key, got)
            continue
        if expected is MISSING and key == "gradient_accumulation_steps":
            assert got == grad_accum, (key, got)
            continue
        assert got == expected, f"{case}: {key}: ours {got!r}, transformers {expected!r}"
        compared += 1
    assert compared >= 4, compared  # the comparison is not empty
    # what transformers leaves "auto" (the ZeRO-3-only keys below ZeRO-3) stays "auto" here too
    if (
        _get(raw, "zero_optimization.stage") != 3
        and _get(raw, "zero_optimization.stage3_prefetch_bucket_size") == "auto"
    ):
        assert _get(ours, "zero_optimization.stage3_prefetch_bucket_size") == "auto"


def test_a_model_without_a_hidden_size_is_a_clear_error_as_in_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
    model = _model(vocab_size=10)
    with pytest.raises(ValueError, match="neither `hidden_size` nor `hidden_sizes`"):
        _transformers(LLAMA_FACTORY_Z3, batch_size=2, grad_accum=1, bf16=False, model=model, tmp_path=tmp_path)
    with pytest.raises(UserError, match="neither hidden_size nor hidden_sizes.*zero_optimization.reduce_bucket_size"):
        _ours(LLAMA_FACTORY_Z3, batch_size=2, grad_accum=1, precision="fp32", model=model, tmp_path=tmp_path)
    # no "auto" bucket size: nothing to fill, no hidden size needed (transformers does not ask either)
    _ours(_config("ds_zero2.json"), batch_size=4, grad_accum=1, precision="bf16", model=model, tmp_path=tmp_path)
