"""What a run saved, and loading it back: the final adapter (or full model) that `fused-stable sft` writes into
its output_dir (`save_final`), found from a run folder or an adapter folder and checked without loading any
weights (`inspect_saved`), then loaded on its base, quantised as in training, for chat, export and evaluation
(`load_trained`). Base models themselves are loaded by `model`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from fused_stable.errors import UserError
from fused_stable.train.config.foreign_configs import public_model
from fused_stable.train.config.keys import TrainConfig
from fused_stable.train.model.load import fill_special_tokens, load_base, load_pretrained, quantization_config
from fused_stable.train.model.sources import ModelSource, resolve_model

TRAINED_WITH = "fused_stable.json"  # next to adapter_config.json: how the base was loaded while training


def save_final(model, tokenizer, cfg: TrainConfig, output_dir: str, state_dict=None, source: ModelSource = None) -> str:
    """peft `save_pretrained` of the adapter (or the whole model for tuner=full), with the tokenizer.
    `state_dict`: the full tensors to save instead of the model's own (gathered from FSDP2 shards).

    An adapter records its base as other Hugging Face tools can resolve it (`base_model_name_or_path`: the
    embedded model's public name, HuggingFaceTB/SmolLM2-135M-Instruct, or an absolute path; never a cache
    folder), and fused_stable.json records where this project found it (`base_model`: what `--model` accepts
    again, the alias, 'tiny' or the path; `base_model_file`: the GGUF it was read from) and how it was loaded
    (quant_bits, precision), so chat and export rebuild the model the adapter was trained against; for an
    adapter and a full model alike it records the run's system message (`system`, none without --system),
    which chat uses."""
    source = source or resolve_model(cfg.model)
    target = os.path.join(output_dir, "model" if cfg.tuner == "full" else "adapter")
    extra = {"state_dict": state_dict} if state_dict is not None else {}
    if cfg.tuner != "full":
        for peft_config in model.peft_config.values():
            peft_config.base_model_name_or_path = recorded_base(source)
        # the vocabulary is never resized here, so there are no embedding layers to save; peft's "auto" looks the
        # base up on the Hub to find out, and warns offline ("Could not find a config file")
        extra["save_embedding_layers"] = False
    with deepspeed_left_alone():  # a run without DeepSpeed never imports it
        model.save_pretrained(target, **extra)
    tokenizer.save_pretrained(target)
    with open(os.path.join(target, TRAINED_WITH), "w") as f:
        json.dump(
            {
                "base_model": source.reference,
                "base_model_file": source.path,
                "tuner": cfg.tuner,
                "quant_bits": cfg.quant_bits,
                "precision": cfg.precision,
                "system": cfg.system,  # the run's --system: chat's system message unless it is given its own
            },
            f,
            indent=1,
        )
        f.write("\n")
    return target


@contextlib.contextmanager
def deepspeed_left_alone():
    """Hugging Face's `save_pretrained` first unwraps the model with accelerate's `extract_model_from_parallel`,
    which imports deepspeed whenever it is installed, only to ask whether the model is a `DeepSpeedEngine`. A model
    cannot be one while deepspeed has never been imported, and the import is not free: it prints "Setting
    accelerator to CPU" on every full-model save, and under torchrun rank 0 importing it at the final save came
    with the runs whose rank 1 aborted at exit ("terminate called without an active exception", issue 52). Inside
    this context accelerate sees deepspeed as absent, unless a DeepSpeed run has imported it already."""
    if "deepspeed" in sys.modules:
        yield
        return
    from accelerate.utils import other

    installed = other.is_deepspeed_available
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = installed


def recorded_base(source: ModelSource) -> str:
    """What an adapter names as its base: the embedded model's public name, else what --model accepts."""
    from fused_stable.train.config.foreign_configs import public_name

    return (public_name(source.reference) if source.kind == "embedded" else None) or source.reference


@dataclass
class Trained:
    """A model loaded for inference (chat, export, evaluation)."""

    model: torch.nn.Module
    tokenizer: object
    base: ModelSource
    adapter_dir: str | None = None
    quant_bits: int | None = None


def find_saved(path: str) -> tuple[str, str]:
    """('adapter' | 'model', folder) for an adapter folder, a saved full model, or a run folder holding one."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise UserError(f"{path!r} not found: give an adapter folder or a run folder (output_dir of fused-stable sft)")
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return "adapter", path
    for kind in ("adapter", "model"):
        if os.path.isfile(os.path.join(path, kind, "adapter_config.json" if kind == "adapter" else "config.json")):
            return kind, os.path.join(path, kind)
    if os.path.isfile(os.path.join(path, "config.json")):
        return "model", path
    raise UserError(f"{path!r} holds no adapter (adapter_config.json) and no run folder with adapter/ or model/")


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass
class Saved:
    """A checked adapter or saved full model (see `inspect_saved`): what `load_trained` and export load."""

    kind: str  # adapter | model
    folder: str
    base: ModelSource  # the adapter's base (for a full model: the folder itself)
    quant_bits: int | None = None
    precision: str = "fp32"
    system: str | None = None  # the run's --system (fused_stable.json): chat's default system message


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is damaged ({str(exc).splitlines()[0]})") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} is damaged (not a JSON object)")
    return value


def _check_safetensors(path: str) -> None:
    """The header and the size of a safetensors file (a truncated or garbled file fails here, cheaply)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"{path} is damaged ({str(exc).splitlines()[0]})") from None


def inspect_saved(path: str) -> Saved:
    """Find and check an adapter (or a saved full model, or a run folder holding one) without loading any
    weights: its config files parse, its weights file is present and whole, its base model resolves. Every
    problem is one UserError naming the file."""
    kind, folder = find_saved(path)
    trained_with = (
        _read_json(os.path.join(folder, TRAINED_WITH)) if os.path.isfile(os.path.join(folder, TRAINED_WITH)) else {}
    )
    system = trained_with.get("system")
    if system is not None and not isinstance(system, str):
        raise UserError(f"{folder}/{TRAINED_WITH} is damaged (system {system!r} is not text)")
    if kind == "model":
        _read_json(os.path.join(folder, "config.json"))
        return Saved(kind, folder, resolve_model(folder), system=system)
    config = _read_json(os.path.join(folder, "adapter_config.json"))
    base_ref = config.get("base_model_name_or_path")
    if not base_ref or not isinstance(base_ref, str):
        raise UserError(f"{folder}/adapter_config.json names no base model (base_model_name_or_path)")
    quant_bits = trained_with.get("quant_bits")
    if quant_bits not in (None, 4, 8):
        raise UserError(f"{folder}/{TRAINED_WITH} is damaged (quant_bits {quant_bits!r})")
    weights = [name for name in ADAPTER_WEIGHTS if os.path.isfile(os.path.join(folder, name))]
    if not weights:
        raise UserError(f"{folder} has adapter_config.json but no adapter weights ({ADAPTER_WEIGHTS[0]})")
    if weights[0].endswith(".safetensors"):
        _check_safetensors(os.path.join(folder, weights[0]))
    try:
        source = resolve_model(public_model(base_ref))  # the embedded model's public name is the embedded model
    except UserError as exc:
        raise UserError(f"the base of {folder}: {exc}") from None
    return Saved(kind, folder, source, quant_bits, str(trained_with.get("precision", "fp32")), system)


def load_saved_tokenizer(folder: str):
    try:
        return fill_special_tokens(AutoTokenizer.from_pretrained(folder, local_files_only=True))
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"cannot load the tokenizer in {folder}: {str(exc).splitlines()[0]}") from None


def load_adapter(base, folder: str):
    """peft's adapter on `base`, for inference; a file peft cannot read is one UserError."""
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(base, folder, is_trainable=False)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise UserError(f"cannot load the adapter in {folder}: {str(exc).splitlines()[0]}") from None


def load_trained(path: str, device="cpu", log=None, saved: Saved | None = None) -> Trained:
    """An adapter on its base (quantised as in training for a QLoRA adapter), or a saved full model."""
    saved = saved or inspect_saved(path)
    if saved.kind == "model":
        return Trained(*load_pretrained(saved.base, device=device, log=log), saved.base)
    tokenizer = load_saved_tokenizer(saved.folder)
    quant = None
    if saved.quant_bits is not None:
        # the adapter learned against the quantised base: rebuild it (compute in fp32 unless trained in bf16)
        compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(saved.precision, torch.float32)
        quant = quantization_config(saved.quant_bits, compute)
    base = load_base(saved.base, tokenizer, torch.device(device), torch.float32, quant, log)
    model = load_adapter(base, saved.folder)
    return Trained(model.eval(), tokenizer, saved.base, saved.folder, saved.quant_bits)
