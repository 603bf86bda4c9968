"""Model side of the trainer: the base model (the embedded pretrained SmolLM2-135M-Instruct, the tiny scratch
Llama, a local Hugging Face directory or GGUF file; see `sources`), optional 4-/8-bit bitsandbytes
quantisation of the frozen base, peft LoRA/DoRA adapters, LoRA+ param groups, saving, and loading a trained
adapter or model back for chat and export.

Nothing here reaches a model hub: `tiny` is built from a LlamaConfig, everything else is read from local
folders with `local_files_only=True`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

from fused_stable.errors import UserError
from fused_stable.train.config import TrainConfig
from fused_stable.train.sources import TINY, ModelSource, loadable_folder, resolve_model
from fused_stable.train.tokenizer import build_byte_tokenizer

TINY_INIT_SEED = 0  # the tiny base is the same for every run, so an adapter trained on it stays usable


def tiny_llama_config(vocab_size: int) -> LlamaConfig:
    """A 0.87M-parameter Llama: small enough to train in minutes on 2 CPU cores.

    initializer_range 0.1 (not the usual 0.02): with a random, frozen lm_head of std 0.02 and hidden size
    128 the largest logit an adapter could reach is about 2.6 nats, so LoRA could barely lower the loss.
    """
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


def build_tiny_model(tokenizer=None) -> LlamaForCausalLM:
    """The embedded base model: always the same weights (seeded independently of the run's seed)."""
    tokenizer = tokenizer or build_byte_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_INIT_SEED)
        return LlamaForCausalLM(tiny_llama_config(len(tokenizer)))


def load_tokenizer(source: ModelSource, log=None):
    """The base model's tokenizer (with its chat template), or the byte tokenizer for `tiny`."""
    if source.kind == TINY:
        return build_byte_tokenizer()
    folder = loadable_folder(source, log)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"no usable tokenizer in {source.reference!r} ({str(exc).splitlines()[0]})") from None
    return _fill_special_tokens(tokenizer)


def _fill_special_tokens(tokenizer):
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of attention and loss anyway
    if tokenizer.bos_token_id is None:
        tokenizer.bos_token = tokenizer.eos_token
    return tokenizer


def _quantization_config(quant_bits: int | None, compute_dtype: torch.dtype) -> BitsAndBytesConfig | None:
    if quant_bits == 4:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    if quant_bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def load_base_model(
    cfg: TrainConfig, source: ModelSource, tokenizer, device: torch.device, compute_dtype: torch.dtype, log=None
):
    """The base model on `device`: fp32 for full fine-tuning (autocast does the low-precision math), the
    compute dtype for a frozen base under LoRA, or bitsandbytes-quantised when quant_bits is set."""
    base_dtype = torch.float32 if cfg.tuner == "full" else compute_dtype
    return _load_base(source, tokenizer, device, base_dtype, _quantization_config(cfg.quant_bits, compute_dtype), log)


def _load_base(source: ModelSource, tokenizer, device, dtype, quant, log=None):
    if source.kind == TINY and quant is None:
        return build_tiny_model(tokenizer).to(device=device, dtype=dtype)
    scratch = None
    if source.kind == TINY:
        # bitsandbytes quantises while loading: give it the tiny model as a local directory to load
        scratch = tempfile.mkdtemp(prefix="fused_stable_tiny_")
        tiny = build_tiny_model(tokenizer)
        # written by hand, not with save_pretrained: under torchrun transformers writes only on rank 0, and
        # every rank loads its own scratch copy
        tiny.config.save_pretrained(scratch)
        save_file(tiny.state_dict(), os.path.join(scratch, "model.safetensors"), metadata={"format": "pt"})
        folder = scratch
    else:
        folder = loadable_folder(source, log)
    try:
        kwargs = dict(local_files_only=True, dtype=dtype)
        if quant is not None:
            kwargs["quantization_config"] = quant
            kwargs["device_map"] = {"": device}
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load the model from {source.reference!r}: {str(exc).splitlines()[0]}") from None
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return model if quant is not None else model.to(device)


def load_pretrained(source: ModelSource, dtype: torch.dtype = torch.float32, device="cpu", log=None):
    """(model, tokenizer) of a base model for inference, in eval mode."""
    tokenizer = load_tokenizer(source, log)
    model = _load_base(source, tokenizer, torch.device(device), dtype, None, log)
    return model.eval(), tokenizer


def apply_tuner(model, cfg: TrainConfig):
    """Freeze the base and add peft LoRA/DoRA adapters (fp32), or leave every weight trainable (tuner=full)."""
    if cfg.gradient_checkpointing:
        # non-reentrant checkpointing needs no requires_grad trick on the inputs of a frozen embedding
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if cfg.tuner == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if cfg.quant_bits is not None:
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=cfg.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    targets = cfg.target_modules.strip()
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules="all-linear"
        if targets == "all-linear"
        else [t.strip() for t in targets.split(",") if t.strip()],
        use_dora=cfg.tuner == "dora",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as exc:
        raise UserError(f"target_modules={cfg.target_modules!r}: {str(exc).splitlines()[0]}") from None


@dataclass
class ParamGroups:
    groups: list[dict]  # for the optimizer
    names: list[str]  # one per param, in the optimizer's order (for per-tensor grad norms)


def param_groups(model, cfg: TrainConfig) -> ParamGroups:
    """AdamW groups: weight decay on matrices only (not on norms, biases or DoRA magnitudes), and under
    LoRA+ the B matrices at lr x loraplus_lr_ratio (Hayou et al. 2024)."""
    decay, no_decay, lora_b = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if cfg.loraplus_lr_ratio is not None and ("lora_B" in name or "lora_embedding_B" in name):
            lora_b.append((name, p))
        elif p.ndim < 2 or "lora_magnitude_vector" in name:
            no_decay.append((name, p))
        else:
            decay.append((name, p))
    groups, names = [], []
    for members, extra in (
        (decay, {"weight_decay": cfg.weight_decay}),
        (no_decay, {"weight_decay": 0.0}),
        (lora_b, {"weight_decay": cfg.weight_decay, "lr": cfg.lr * (cfg.loraplus_lr_ratio or 1.0)}),
    ):
        if members:
            groups.append({"params": [p for _, p in members], **extra})
            names += [n for n, _ in members]
    if not groups:
        raise UserError("nothing to train: no parameter requires a gradient (check target_modules)")
    return ParamGroups(groups, names)


def trainable_state(model) -> dict[str, torch.Tensor]:
    """What a checkpoint must hold of the model: the trainable tensors (the adapters, or all weights)."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in state]
    unknown = [n for n in state if n not in params]
    if missing or unknown:
        raise UserError(
            f"the checkpoint does not match this model ({len(missing)} trainable tensors missing, "
            f"{len(unknown)} unknown, e.g. {(missing + unknown)[0]!r}): resume with the run's own config"
        )
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


# ---------------------------------------------------------------------------------------------- saved runs
TRAINED_WITH = "fused_stable.json"  # next to adapter_config.json: how the base was loaded while training


def save_final(model, tokenizer, cfg: TrainConfig, output_dir: str, state_dict=None, source: ModelSource = None) -> str:
    """peft `save_pretrained` of the adapter (or the whole model for tuner=full), with the tokenizer.
    `state_dict`: the full tensors to save instead of the model's own (gathered from FSDP2 shards).

    An adapter records its base as something `--model` accepts again (the alias, 'tiny' or an absolute path;
    never a cache folder), and fused_stable.json says how that base was loaded (quant_bits, precision), so
    chat and export rebuild the model the adapter was trained against."""
    source = source or resolve_model(cfg.model)
    target = os.path.join(output_dir, "model" if cfg.tuner == "full" else "adapter")
    if cfg.tuner != "full":
        for peft_config in model.peft_config.values():
            peft_config.base_model_name_or_path = source.reference
    model.save_pretrained(target, **({"state_dict": state_dict} if state_dict is not None else {}))
    tokenizer.save_pretrained(target)
    if cfg.tuner != "full":
        with open(os.path.join(target, TRAINED_WITH), "w") as f:
            json.dump(
                {
                    "base_model": source.reference,
                    "tuner": cfg.tuner,
                    "quant_bits": cfg.quant_bits,
                    "precision": cfg.precision,
                },
                f,
                indent=1,
            )
            f.write("\n")
    return target


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
    if kind == "model":
        _read_json(os.path.join(folder, "config.json"))
        return Saved(kind, folder, resolve_model(folder))
    config = _read_json(os.path.join(folder, "adapter_config.json"))
    base_ref = config.get("base_model_name_or_path")
    if not base_ref or not isinstance(base_ref, str):
        raise UserError(f"{folder}/adapter_config.json names no base model (base_model_name_or_path)")
    trained_with = (
        _read_json(os.path.join(folder, TRAINED_WITH)) if os.path.isfile(os.path.join(folder, TRAINED_WITH)) else {}
    )
    quant_bits = trained_with.get("quant_bits")
    if quant_bits not in (None, 4, 8):
        raise UserError(f"{folder}/{TRAINED_WITH} is damaged (quant_bits {quant_bits!r})")
    weights = [name for name in ADAPTER_WEIGHTS if os.path.isfile(os.path.join(folder, name))]
    if not weights:
        raise UserError(f"{folder} has adapter_config.json but no adapter weights ({ADAPTER_WEIGHTS[0]})")
    if weights[0].endswith(".safetensors"):
        _check_safetensors(os.path.join(folder, weights[0]))
    try:
        source = resolve_model(base_ref)
    except UserError as exc:
        raise UserError(f"the base of {folder}: {exc}") from None
    return Saved(kind, folder, source, quant_bits, str(trained_with.get("precision", "fp32")))


def load_saved_tokenizer(folder: str):
    try:
        return _fill_special_tokens(AutoTokenizer.from_pretrained(folder, local_files_only=True))
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
        quant = _quantization_config(saved.quant_bits, compute)
    base = _load_base(saved.base, tokenizer, torch.device(device), torch.float32, quant, log)
    model = load_adapter(base, saved.folder)
    return Trained(model.eval(), tokenizer, saved.base, saved.folder, saved.quant_bits)
