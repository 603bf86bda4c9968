"""`fused-stable export --adapter DIR --output_dir DIR`: merge a LoRA / DoRA adapter into its base weights and
write a plain Hugging Face folder (safetensors weights, config, generation config, tokenizer with its chat
template) that `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` load without peft.

A QLoRA adapter (trained on a 4- or 8-bit base) is merged into the dequantised base, i.e. the weights it
was trained against, not the original full-precision ones; the export says so. Weights are written in fp32.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from fused_stable.train.errors import UserError  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fused-stable export", description=__doc__.split("\n\n")[0])
    p.add_argument("--adapter", required=True, help="an adapter folder, or a run folder holding adapter/")
    p.add_argument("--output_dir", "--output-dir", required=True, help="where the merged model goes")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output_dir")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = one per physical core")
    return p


def _dequantised_base(source, tokenizer, quant_bits: int, log):
    """The fp32 base with every quantised weight replaced by its dequantised value."""
    import torch
    from peft.utils.integrations import dequantize_bnb_weight

    from fused_stable.train.model import _load_base, _quantization_config

    base = _load_base(source, tokenizer, torch.device("cpu"), torch.float32, None, log)
    quantised = _load_base(source, tokenizer, torch.device("cpu"), torch.float32,
                           _quantization_config(quant_bits, torch.float32), log)
    modules = dict(base.named_modules())
    replaced = 0
    with torch.no_grad():
        for name, module in quantised.named_modules():
            weight = getattr(module, "weight", None)
            if weight is None or type(weight).__name__ not in ("Params4bit", "Int8Params"):
                continue
            value = dequantize_bnb_weight(weight, state=getattr(module, "state", None))
            modules[name].weight.copy_(value.to(torch.float32).reshape(modules[name].weight.shape))
            replaced += 1
    if not replaced:
        raise UserError("the adapter says its base was quantised, but no quantised layer was found")
    return base


def export(adapter: str, output_dir: str, *, overwrite: bool = False, log=print) -> dict:
    """Merge and write; returns {"output_dir", "base", "quant_bits", "merged_into"}."""
    import json

    import torch
    from peft import PeftModel

    from fused_stable.train.model import TRAINED_WITH, _fill_special_tokens, _load_base, find_saved
    from fused_stable.train.sources import resolve_model

    kind, folder = find_saved(adapter)
    if kind != "adapter":
        raise UserError(f"{folder} is a full model already (tuner=full): nothing to merge, load it directly")
    if os.path.exists(output_dir) and os.listdir(output_dir) and not overwrite:
        raise UserError(f"output_dir {output_dir!r} is not empty; pass --overwrite to replace it")
    with open(os.path.join(folder, "adapter_config.json")) as f:
        base_ref = json.load(f).get("base_model_name_or_path")
    if not base_ref:
        raise UserError(f"{folder}/adapter_config.json names no base model (base_model_name_or_path)")
    trained_with = {}
    if os.path.isfile(os.path.join(folder, TRAINED_WITH)):
        with open(os.path.join(folder, TRAINED_WITH)) as f:
            trained_with = json.load(f)
    quant_bits = trained_with.get("quant_bits")
    source = resolve_model(base_ref)
    from transformers import AutoTokenizer

    tokenizer = _fill_special_tokens(AutoTokenizer.from_pretrained(folder, local_files_only=True))
    if quant_bits:
        base = _dequantised_base(source, tokenizer, quant_bits, log)
        merged_into = f"the dequantised {quant_bits}-bit base (the weights this QLoRA adapter was trained against)"
    else:
        base = _load_base(source, tokenizer, torch.device("cpu"), torch.float32, None, log)
        merged_into = "the base weights"
    merged = PeftModel.from_pretrained(base, folder, is_trainable=False).merge_and_unload()
    merged.config.use_cache = True
    merged.config.name_or_path = ""
    # written next to the target, then renamed: an interrupted export leaves no half-written model behind
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".tmp-export-", dir=parent)
    try:
        merged.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        if os.path.exists(output_dir):
            shutil.rmtree(output_dir)
        os.rename(scratch, output_dir)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return {"output_dir": output_dir, "base": source.reference, "quant_bits": quant_bits, "merged_into": merged_into}


def main(argv: list[str]) -> int:
    from fused_stable.train.cli import _quiet_third_party_noise
    from fused_stable.train.runtime import set_threads

    _quiet_third_party_noise()
    args = _parser().parse_args(argv)
    try:
        set_threads(args.threads)
        result = export(args.adapter, args.output_dir, overwrite=args.overwrite,
                        log=lambda text: print(text, flush=True))
    except UserError as exc:
        print(f"fused-stable export: error: {exc}", file=sys.stderr)
        return 2
    print(f"fused-stable export: merged {args.adapter} into {result['merged_into']} of {result['base']}; "
          f"wrote {result['output_dir']} (fp32 safetensors, config, tokenizer)", flush=True)
    return 0
