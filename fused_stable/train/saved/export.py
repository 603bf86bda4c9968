"""`fused-stable export --adapter DIR --output_dir DIR`: merge a LoRA / DoRA adapter into its base weights and
write a plain Hugging Face folder (safetensors weights, config, generation config, tokenizer with its chat
template) that `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` load without peft.

A QLoRA adapter (trained on a 4- or 8-bit base) is merged into the dequantised base, i.e. the weights it
was trained against, not the original full-precision ones; the export says so. Weights are written in fp32.

The target must be new or empty; the export writes `run_manifest.json` naming its files, and `--overwrite`
replaces only a previous export (a folder holding anything else is refused, never emptied). Everything is
checked before the base model is loaded: a bad option, adapter or target is one line and exit code 2.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from fused_stable.argcheck import parse_command
from fused_stable.cli import offline_environment
from fused_stable.errors import UserError
from fused_stable.train.run.outputs import EXPORT


def build_parser():
    from fused_stable.argcheck import OneLineParser, number

    p = OneLineParser(
        prog="fused-stable export",
        description=__doc__.split("\n\n")[0],
        aliases={"--out": "--output-dir", "--output": "--output-dir", "--model": "--adapter"},
    )
    p.add_argument("--adapter", required=True, help="an adapter folder, or a run folder holding adapter/")
    p.add_argument("--output-dir", required=True, help="where the merged model goes (a new or empty folder)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace a previous export in --output-dir (only the files it wrote)"
    )
    p.add_argument(
        "--threads",
        type=number(0, 4096, integer=True),
        default=0,
        help="torch CPU threads; 0 = one per physical core (default: 0)",
    )
    return p


def _dequantised_base(source, tokenizer, quant_bits: int, log):
    """The fp32 base with every quantised weight replaced by its dequantised value."""
    import torch
    from peft.utils.integrations import dequantize_bnb_weight

    from fused_stable.train.model.load import load_base, quantization_config

    base = load_base(source, tokenizer, torch.device("cpu"), torch.float32, None, log)
    quantised = load_base(
        source, tokenizer, torch.device("cpu"), torch.float32, quantization_config(quant_bits, torch.float32), log
    )
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


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def _modes_from_umask(folder: str) -> None:
    """The modes open() and mkdir would have given: mkdtemp makes the folder 0700 and safetensors writes its
    files 0600, so other users could not read the model whatever the umask says."""
    mask = _umask()
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def export(adapter: str, output_dir: str, *, overwrite: bool = False, log=print) -> dict:
    """Merge and write; returns {"output_dir", "base", "quant_bits", "merged_into"}. Everything is checked
    before the base is loaded; the folder is written next to the target and renamed into place, so a failed
    or interrupted export leaves the target as it was."""
    import torch

    from fused_stable.train.model.load import load_base
    from fused_stable.train.run import outputs
    from fused_stable.train.saved.final_model import (
        deepspeed_left_alone,
        inspect_saved,
        load_adapter,
        load_saved_tokenizer,
    )

    if not adapter.strip():
        raise UserError("--adapter is empty: give an adapter folder or a run folder")
    saved = inspect_saved(adapter)
    if saved.kind != "adapter":
        raise UserError(f"{saved.folder} is a full model already (tuner=full): nothing to merge, load it directly")
    outputs.check_output_dir(output_dir, overwrite=overwrite, command=EXPORT, option="--output_dir")
    tokenizer = load_saved_tokenizer(saved.folder)
    if saved.quant_bits:
        base = _dequantised_base(saved.base, tokenizer, saved.quant_bits, log)
        merged_into = (
            f"the dequantised {saved.quant_bits}-bit base (the weights this QLoRA adapter was trained against)"
        )
    else:
        base = load_base(saved.base, tokenizer, torch.device("cpu"), torch.float32, None, log)
        merged_into = "the base weights"
    merged = load_adapter(base, saved.folder).merge_and_unload()
    merged.config.use_cache = True
    merged.config.name_or_path = ""
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".tmp-export-", dir=parent)
    try:
        with deepspeed_left_alone():
            merged.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        outputs.claim(scratch, sorted(os.listdir(scratch)), command=EXPORT)  # what a later --overwrite removes
        previous = None
        if os.path.isdir(output_dir):  # a previous export, nothing else (checked above): swapped out, then removed
            previous = tempfile.mkdtemp(prefix=".old-export-", dir=parent)
            os.rename(output_dir, os.path.join(previous, "export"))
        _modes_from_umask(scratch)
        os.rename(scratch, output_dir)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if previous is not None:
        shutil.rmtree(previous)
    return {
        "output_dir": output_dir,
        "base": saved.base.reference,
        "quant_bits": saved.quant_bits,
        "merged_into": merged_into,
    }


def main(argv: list[str]) -> int:
    """`fused-stable export`; a bad option, adapter or target is one line on stderr and exit code 2, with
    nothing written."""
    offline_environment()
    args, code = parse_command(build_parser(), argv, "export")
    if args is None:
        return code
    from fused_stable.train.run.runtime import quiet_third_party_noise, set_threads

    quiet_third_party_noise()
    try:
        set_threads(args.threads)
        result = export(
            args.adapter, args.output_dir, overwrite=args.overwrite, log=lambda text: print(text, flush=True)
        )
    except UserError as exc:
        print(f"fused-stable export: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fused-stable export: interrupted; {args.output_dir} was left as it was", file=sys.stderr)
        return 130
    print(
        f"fused-stable export: merged {args.adapter} into {result['merged_into']} of {result['base']}; "
        f"wrote {result['output_dir']} (fp32 safetensors, config, tokenizer)",
        flush=True,
    )
    return 0
