"""Loading a base model and its tokenizer: the embedded pretrained SmolLM2-135M-Instruct, the tiny scratch Llama
(`tiny`), a local Hugging Face directory or GGUF file (see `sources`), with optional 4-/8-bit bitsandbytes
quantisation of the frozen base. Its adapters are `adapters`'; what a run saved (its adapter or model, loaded
back for chat and export) is read by `train.saved.final_model`.

Nothing here reaches a model hub: `tiny` is built from a LlamaConfig, everything else is read from local
folders with `local_files_only=True`.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from fused_stable.errors import UserError
from fused_stable.train.config.keys import TrainConfig
from fused_stable.train.model.sources import TINY, ModelSource, loadable_folder
from fused_stable.train.model.tiny import build_byte_tokenizer, build_tiny_model


def load_tokenizer(source: ModelSource, log=None):
    """The base model's tokenizer (with its chat template), or the byte tokenizer for `tiny`."""
    if source.kind == TINY:
        return build_byte_tokenizer()
    folder = loadable_folder(source, log)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"no usable tokenizer in {source.reference!r} ({str(exc).splitlines()[0]})") from None
    return fill_special_tokens(tokenizer)


def fill_special_tokens(tokenizer):
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of attention and loss anyway
    if tokenizer.bos_token_id is None:
        tokenizer.bos_token = tokenizer.eos_token
    return tokenizer


def quantization_config(quant_bits: int | None, compute_dtype: torch.dtype) -> BitsAndBytesConfig | None:
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


# bitsandbytes' CPU 4-bit inference path (0.50: `Linear4bit.forward` calls `_convert_weight_packed_for_cpu` in eval
# mode, without gradients, on a CPU with AVX512-BF16; the layer's `support_avx512bf16_for_cpu` says whether it may)
# repacks a weight in blocks of 32 output rows and its absmax per row of `blocksize` inputs, and asserts on any
# other shape ("N must be divisible by block_n"). Its generic path (dequantise, matmul) takes every shape. The
# packed layout is for inference only: its CPU kernel has no autograd formula, and a layer packed by an evaluation
# stays packed when training resumes, so a model that trains never takes it.
PACKED_CPU_PATH = "support_avx512bf16_for_cpu"
PACKED_CPU_BLOCK_N = 32


def packed_cpu_path_takes(out_features: int, in_features: int, blocksize: int) -> bool:
    """Whether bitsandbytes' packed CPU 4-bit path can repack a weight of this shape (see PACKED_CPU_PATH)."""
    return out_features % PACKED_CPU_BLOCK_N == 0 and in_features % blocksize == 0 and in_features % 2 == 0


def use_generic_4bit_path(model, *, training: bool, log=None) -> list[str]:
    """Keep bitsandbytes' packed CPU path away from the 4-bit layers it cannot take (every layer when the model
    trains): they run through its generic path, in 4-bit as before. Returns the names of the layers whose shape
    it cannot take, named in one line through `log` when the packed path is there to be missed. Nothing changes
    where bitsandbytes has no packed path (another release, no AVX512-BF16, a GPU)."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return []
    odd = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear4bit) or not getattr(module, PACKED_CPU_PATH, False):
            continue
        state = module.weight.quant_state
        blocksize = state.blocksize if state is not None else 64
        fits = packed_cpu_path_takes(module.out_features, module.in_features, blocksize)
        if not fits:
            odd.append(f"{name} ({module.in_features} -> {module.out_features})")
        if training or not fits:
            setattr(module, PACKED_CPU_PATH, False)
    if odd and log is not None and not training:
        log(
            f"note: bitsandbytes' fast CPU 4-bit path needs output sizes that are multiples of {PACKED_CPU_BLOCK_N} "
            f"and input sizes that are multiples of 64; {len(odd)} layer(s) run through its generic 4-bit path "
            f"(same weights, slower): {_named_briefly(odd)}"
        )
    return odd


def _named_briefly(names: list[str], shown: int = 4) -> str:
    """Layer names with the block number folded (`model.layers.*.mlp.down_proj (200 -> 128)`), a few of them."""
    folded = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in names))
    more = f" and {len(folded) - shown} more" if len(folded) > shown else ""
    return ", ".join(folded[:shown]) + more


def load_base_model(
    cfg: TrainConfig, source: ModelSource, tokenizer, device: torch.device, compute_dtype: torch.dtype, log=None
):
    """The base model on `device`: fp32 for full fine-tuning (autocast does the low-precision math), the
    compute dtype for a frozen base under LoRA, or bitsandbytes-quantised when quant_bits is set."""
    base_dtype = torch.float32 if cfg.tuner == "full" else compute_dtype
    quant = quantization_config(cfg.quant_bits, compute_dtype)
    return load_base(source, tokenizer, device, base_dtype, quant, log, training=True)


def load_base(source: ModelSource, tokenizer, device, dtype, quant, log=None, *, training: bool = False):
    """The base model, bitsandbytes-quantised with `quant`; `training`: it will train (adapters on a 4-bit base
    never take bitsandbytes' inference-only packed CPU path, see PACKED_CPU_PATH)."""
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
    if quant is None:
        return model.to(device)
    use_generic_4bit_path(model, training=training, log=log)
    return model


def load_pretrained(source: ModelSource, dtype: torch.dtype = torch.float32, device="cpu", log=None):
    """(model, tokenizer) of a base model for inference, in eval mode."""
    tokenizer = load_tokenizer(source, log)
    model = load_base(source, tokenizer, torch.device(device), dtype, None, log)
    return model.eval(), tokenizer
