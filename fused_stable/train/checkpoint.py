"""Atomic, resumable checkpoints: `output_dir/checkpoints/step-N/`.

A checkpoint is written into a temporary directory, every file fsynced, renamed into place, and only then
marked complete (a `COMPLETE` file, fsynced with its directory). A run killed at any point leaves either
no `step-N` or one without the marker, which `latest_checkpoint` ignores, so the previous one stays the
latest. The functions take the live objects, so a rollback can call them in-process.

Contents: trainable weights (safetensors), optimizer (its state_dict carries the device-side schedule and
counters), loss scaler, RNG states (python, numpy, torch CPU and CUDA), data position and the config.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import time

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file

from fused_stable.train.errors import UserError

COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _torch_save(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints as (step, path), oldest first."""
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint in output_dir, or None."""
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def save_checkpoint(output_dir: str, step: int, *, model_state: dict[str, torch.Tensor], optimizer,
                    scaler=None, trainer_state: dict, config: dict, keep: int = 0,
                    optimizer_state: dict | None = None, rng: dict | None = None) -> str:
    """Write checkpoints/step-<step>/ atomically and return its path; keep only the newest `keep` (0 = all).
    `optimizer_state` / `rng`: already gathered (torchrun: full FSDP2 state, every rank's RNG); by default
    `optimizer.state_dict()` and this process's RNG states."""
    root = os.path.join(output_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step-{step}")
    tmp = os.path.join(root, f".tmp-step-{step}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
        save_file(tensors, os.path.join(tmp, "weights.safetensors"))
        _fsync_path(os.path.join(tmp, "weights.safetensors"))
        _torch_save(optimizer.state_dict() if optimizer_state is None else optimizer_state,
                    os.path.join(tmp, "optimizer.pt"))
        if scaler is not None:
            _torch_save(scaler.state_dict(), os.path.join(tmp, "scaler.pt"))
        _torch_save(rng_state() if rng is None else rng, os.path.join(tmp, "rng.pt"))
        _write_bytes(os.path.join(tmp, "trainer_state.json"),
                     json.dumps({**trainer_state, "step": step}, indent=2).encode())
        _write_bytes(os.path.join(tmp, "config.yaml"), yaml.safe_dump(config, sort_keys=False).encode())
        _fsync_path(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # a checkpoint of the same step (a rollback replaying it) is replaced: move it aside first so that the
    # rename below is atomic; older complete checkpoints stay valid throughout
    stale = None
    if os.path.exists(final):
        stale = os.path.join(root, f".old-step-{step}-{os.getpid()}")
        os.rename(final, stale)
    os.rename(tmp, final)
    _fsync_path(root)
    _write_bytes(os.path.join(final, COMPLETE_MARKER), f"{time.time()}\n".encode())
    _fsync_path(final)
    if stale:
        shutil.rmtree(stale, ignore_errors=True)
    if keep > 0:
        for _, old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str, *, model=None, optimizer=None, scaler=None, restore_rng: bool = True) -> dict:
    """Restore what was saved into the given live objects; returns the trainer state (step, data position...)."""
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        raise UserError(f"{path!r} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    if model is not None:
        from fused_stable.train.model import load_trainable_state

        load_trainable_state(model, load_file(os.path.join(path, "weights.safetensors")))
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True))
    scaler_path = os.path.join(path, "scaler.pt")
    if scaler is not None and os.path.isfile(scaler_path):
        scaler.load_state_dict(torch.load(scaler_path, weights_only=True))
    if restore_rng:
        # python's and numpy's states hold plain tuples/arrays: not loadable with weights_only
        set_rng_state(torch.load(os.path.join(path, "rng.pt"), weights_only=False))
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


def checkpoint_config(path: str) -> dict:
    with open(os.path.join(path, "config.yaml")) as f:
        return yaml.safe_load(f)


def resolve_resume(output_dir: str, resume: str) -> str:
    """'latest' -> the newest complete checkpoint in output_dir; otherwise a checkpoint directory."""
    if resume == "latest":
        path = latest_checkpoint(output_dir)
        if path is None:
            raise UserError(f"resume=latest: no complete checkpoint in {os.path.join(output_dir, 'checkpoints')!r}")
        return path
    if not os.path.isdir(resume):
        raise UserError(f"resume: checkpoint directory {resume!r} not found")
    if not os.path.isfile(os.path.join(resume, COMPLETE_MARKER)):
        raise UserError(f"resume: {resume!r} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    return resume
