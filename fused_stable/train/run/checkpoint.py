"""Atomic, verified, resumable checkpoints: `output_dir/checkpoints/step-N/`.

A checkpoint is written into a temporary directory, every file fsynced, renamed into place, and only then
marked complete: the `COMPLETE` marker (fsynced with its directory) records each file's size and SHA-256.
A run killed at any point leaves either no `step-N` or one without the marker, which `latest_checkpoint`
ignores, so the previous one stays the latest; the rename and the marker are written with SIGINT/SIGTERM
held back, so an interrupt cannot cut the commit in half. `verify_checkpoint` checks every file against the
marker before a resume or a rollback loads it: `resume latest` passes over damaged checkpoints (and says
so), an explicit checkpoint that is damaged is one line naming the file. The functions take the live
objects, so a rollback can call them in-process.

Contents: trainable weights (safetensors), optimizer (its state_dict carries the device-side schedule and
counters), loss scaler, RNG states (python, numpy, torch CPU and CUDA), data position and the config. Under
DeepSpeed (`deepspeed_run`) the engine's files, in `deepspeed/`, hold the weights and the optimizer.

A save that cannot write (a full disk or quota, a file-size limit) raises `SaveFailed`, an OSError naming the
checkpoint, after removing everything it wrote: the earlier checkpoints stay as they were. What a process killed
mid-save leaves (a hidden temporary directory, a replaced checkpoint moved aside) is never loaded, and the next
run in the folder clears it (`clear_leftovers`, under the folder's lock).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import time

import numpy as np
import torch
import yaml
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from fused_stable import strict_json
from fused_stable.errors import UserError

COMPLETE_MARKER = "COMPLETE"
MARKER_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_HASH_CHUNK = 4 << 20


class DamagedCheckpoint(UserError):
    """A checkpoint whose marker is missing or broken, or a file that differs from what the marker recorded."""


class SaveFailed(OSError):
    """Writing a checkpoint failed (errno and strerror of the write that failed); nothing of it is left."""

    def __init__(self, checkpoint: str, exc: OSError):
        super().__init__(exc.errno, exc.strerror or str(exc))
        self.checkpoint = checkpoint


def _save_stage(stage: str, step: int) -> None:
    """Where a save of `step` has got to: "tmp" (its temporary directory exists), each file's name once that file
    is written, "renamed" (in place, before its COMPLETE marker), "complete" (marked, before pruning), "pruning"
    (an old checkpoint renamed away, not yet deleted). Does nothing: the fault tests replace it to kill the
    process at each of these points (tests/train/fault_script.py), deterministically and without sleeps."""


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


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_HASH_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: str) -> list[str]:
    """Every file under `folder` (an engine's files lie in a subfolder), as paths relative to it, sorted."""
    found = []
    for parent, dirs, names in os.walk(folder):
        dirs.sort()
        found += [os.path.relpath(os.path.join(parent, name), folder) for name in names]
    return sorted(found)


def _file_records(folder: str) -> dict[str, dict]:
    return {
        name: {"bytes": os.path.getsize(os.path.join(folder, name)), "sha256": _sha256(os.path.join(folder, name))}
        for name in _files(folder)
    }


def verify_checkpoint(path: str) -> dict:
    """Check every file against the COMPLETE marker; return the marker, or raise DamagedCheckpoint naming
    the first damaged file (missing, wrong size, wrong checksum) or the marker itself."""
    marker = os.path.join(path, COMPLETE_MARKER)
    if not os.path.isfile(marker):
        raise DamagedCheckpoint(f"{path} is incomplete (no {COMPLETE_MARKER} marker: its save never finished)")
    try:
        with open(marker, encoding="utf-8") as f:
            record = json.load(f)
        files = record["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("no file records")
    except (OSError, ValueError, KeyError, TypeError):
        raise DamagedCheckpoint(f"{marker} is damaged (not the file list this version writes)") from None
    for name, want in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise DamagedCheckpoint(f"{file} is missing")
        size = os.path.getsize(file)
        if size != want.get("bytes"):
            raise DamagedCheckpoint(f"{file} is damaged ({size} bytes, the checkpoint recorded {want.get('bytes')})")
        if _sha256(file) != want.get("sha256"):
            raise DamagedCheckpoint(f"{file} is damaged (its SHA-256 differs from the one recorded)")
    return record


def list_checkpoints(output_dir: str, include_incomplete: bool = False) -> list[tuple[int, str]]:
    """Checkpoints as (step, path), oldest first: those with a COMPLETE marker (all `step-N` with
    `include_incomplete`). The marker's presence only; `verify_checkpoint` checks the contents."""
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if (
            match
            and os.path.isdir(path)
            and (include_incomplete or os.path.isfile(os.path.join(path, COMPLETE_MARKER)))
        ):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint in output_dir, or None."""
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def latest_verified_checkpoint(output_dir: str) -> tuple[str | None, list[str]]:
    """(the newest checkpoint that verifies, or None; why each newer one was passed over, one line each)."""
    passed_over = []
    for _, path in reversed(list_checkpoints(output_dir, include_incomplete=True)):
        try:
            verify_checkpoint(path)
            return path, passed_over
        except DamagedCheckpoint as exc:
            passed_over.append(str(exc))
    return None, passed_over


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM wait until the block is done (the commit of a checkpoint must not be cut in two);
    a signal that arrived meanwhile is delivered right after."""
    held = {signal.SIGINT, signal.SIGTERM}
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    except (AttributeError, ValueError, OSError):  # not POSIX, or not possible here: commit unguarded
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _remove_dir(path: str, root: str, tag: str) -> str:
    """Remove a checkpoint directory: renamed away first (atomic), so that a kill mid-removal leaves a
    hidden leftover, never a half-deleted `step-N` that still looks complete. Returns the hidden name."""
    doomed = os.path.join(root, f".{tag}-{os.path.basename(path)}-{os.getpid()}")
    os.rename(path, doomed)
    if tag == "pruned":
        _save_stage("pruning", int(os.path.basename(path).split("-")[1]))
    shutil.rmtree(doomed, ignore_errors=True)
    return doomed


def staging_dir(output_dir: str, step: int) -> str:
    """A new, empty temporary directory for checkpoint `step`, for files other processes write before
    `save_checkpoint(staged=...)` commits it (DeepSpeed's ranks: `checkpoint_contents`); a kill before the commit
    leaves a leftover `clear_leftovers` removes."""
    root = os.path.join(output_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".tmp-step-{step}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def save_checkpoint(
    output_dir: str,
    step: int,
    *,
    model_state: dict[str, torch.Tensor] | None,
    optimizer,
    scaler=None,
    trainer_state: dict,
    config: dict,
    keep: int = 0,
    optimizer_state: dict | None = None,
    rng: dict | None = None,
    staged: str | None = None,
) -> str:
    """Write checkpoints/step-<step>/ atomically and return its path; keep only the newest `keep` (0 = all).
    `optimizer_state` / `rng`: already gathered (torchrun: full FSDP2 state, every rank's RNG); by default
    `optimizer.state_dict()` and this process's RNG states. An exception (or KeyboardInterrupt) before the
    marker is written removes everything this save wrote and leaves every earlier checkpoint as it was; a write
    that fails (a full disk) is `SaveFailed`. `staged`: a `staging_dir` that already holds an engine's files
    (then `model_state` and `optimizer` are None: the engine's files hold the weights and the optimizer); they are
    fsynced, recorded in the marker and committed with the rest."""
    root = os.path.join(output_dir, "checkpoints")
    final = os.path.join(root, f"step-{step}")
    try:
        tmp = staged if staged is not None else staging_dir(output_dir, step)
        _save_stage("tmp", step)
        if optimizer_state is None and optimizer is not None:
            optimizer_state = optimizer.state_dict()
        marker = _write_files(
            tmp,
            step,
            model_state=model_state,
            optimizer_state=optimizer_state,
            scaler=scaler,
            rng=rng_state() if rng is None else rng,
            trainer_state=trainer_state,
            config=config,
        )
        _commit(tmp, final, root, step, marker)
    except OSError as exc:
        raise SaveFailed(final, exc) from exc
    _save_stage("complete", step)
    if keep > 0:
        for _, old in list_checkpoints(output_dir)[:-keep]:
            _remove_dir(old, root, "pruned")
    return final


def _write_files(tmp, step, *, model_state, optimizer_state, scaler, rng, trainer_state, config) -> dict:
    """Every file of the checkpoint into `tmp`, each fsynced; returns the COMPLETE marker's content. Anything
    raised removes `tmp`."""
    try:
        for name in _files(tmp):  # what other processes wrote (an engine's partitions): on disk before the commit
            _fsync_path(os.path.join(tmp, name))
        for parent, dirs, _ in os.walk(tmp):
            for name in dirs:
                _fsync_path(os.path.join(parent, name))
        if model_state is not None:
            tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
            # serialised here and written by Python, so that a failed write is an OSError with its errno
            _write_bytes(os.path.join(tmp, "weights.safetensors"), safetensors_bytes(tensors))
            _save_stage("weights.safetensors", step)
        if optimizer_state is not None:
            _torch_save(optimizer_state, os.path.join(tmp, "optimizer.pt"))
            _save_stage("optimizer.pt", step)
        if scaler is not None:
            _torch_save(scaler.state_dict(), os.path.join(tmp, "scaler.pt"))
            _save_stage("scaler.pt", step)
        _torch_save(rng, os.path.join(tmp, "rng.pt"))
        _save_stage("rng.pt", step)
        # strict JSON (fused_stable.strict_json): the guard's statistics are floats
        _write_bytes(
            os.path.join(tmp, "trainer_state.json"),
            strict_json.dumps({**trainer_state, "step": step}, indent=2).encode(),
        )
        _save_stage("trainer_state.json", step)
        _write_bytes(os.path.join(tmp, "config.yaml"), yaml.safe_dump(config, sort_keys=False).encode())
        _save_stage("config.yaml", step)
        _fsync_path(tmp)
        return {"format": MARKER_FORMAT, "step": step, "time": time.time(), "files": _file_records(tmp)}
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _commit(tmp: str, final: str, root: str, step: int, marker: dict) -> None:
    """Rename `tmp` into place, then write the COMPLETE marker, with SIGINT/SIGTERM held back. A checkpoint of the
    same step (a rollback replaying it) is moved aside first so that the rename is atomic, and put back if the
    marker cannot be written; a `step-N` whose marker failed is removed, never left to be passed over."""
    with _signals_held():
        stale = None
        if os.path.exists(final):
            stale = os.path.join(root, f".old-step-{step}-{os.getpid()}")
            os.rename(final, stale)
        try:
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if stale:
                os.rename(stale, final)
            raise
        _fsync_path(root)
        _save_stage("renamed", step)
        try:
            _write_bytes(os.path.join(final, COMPLETE_MARKER), json.dumps(marker, indent=1).encode())
            _fsync_path(final)
        except BaseException:
            _remove_dir(final, root, "failed")
            if stale:
                os.rename(stale, final)
            raise
    if stale:
        shutil.rmtree(stale, ignore_errors=True)


_LEFTOVER = re.compile(r"^\.(tmp|old|pruned|failed)-step-(\d+)-\d+$")


def clear_leftovers(output_dir: str) -> list[str]:
    """Remove what saves killed part-way left in output_dir/checkpoints (hidden directories: a temporary one, a
    checkpoint being pruned, a failed one) and return a line for each. A complete checkpoint that a replacing
    save had moved aside (`.old-step-N-*`) goes back to `step-N` if that has no complete checkpoint. Call it
    only while holding the folder's lock (no save can be under way)."""
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    lines = []
    for name in sorted(os.listdir(root)):
        match = _LEFTOVER.match(name)
        if not match:
            continue
        path = os.path.join(root, name)
        final = os.path.join(root, f"step-{match.group(2)}")
        if match.group(1) == "old" and not os.path.isfile(os.path.join(final, COMPLETE_MARKER)):
            try:
                verify_checkpoint(path)
            except DamagedCheckpoint:
                pass
            else:
                if os.path.isdir(final):
                    _remove_dir(final, root, "failed")
                os.rename(path, final)
                lines.append(f"restored {final} (a save that replaced it was killed before it finished)")
                continue
        shutil.rmtree(path, ignore_errors=True)
        lines.append(f"removed {path} (left by a save or a clean-up that was killed part-way)")
    return lines


@contextlib.contextmanager
def _loading(path: str, name: str):
    """A file that verified but still cannot be loaded into this run (written by another version, or for
    another model): one line naming it, not a traceback."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch, safetensors and pickle raise many types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"{os.path.join(path, name)} cannot be loaded into this run ({first})") from None


def load_checkpoint(path: str, *, model=None, optimizer=None, scaler=None, restore_rng: bool = True) -> dict:
    """Restore what was saved into the given live objects; returns the trainer state (step, data position...).
    The caller verifies the checkpoint first (`verify_checkpoint`); what still fails to load is a UserError."""
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        raise DamagedCheckpoint(f"{path} is incomplete (no {COMPLETE_MARKER} marker: its save never finished)")
    if model is not None:
        with _loading(path, "weights.safetensors"):
            load_trainable_state(model, load_file(os.path.join(path, "weights.safetensors")))
    if optimizer is not None:
        with _loading(path, "optimizer.pt"):
            optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True))
    scaler_path = os.path.join(path, "scaler.pt")
    if scaler is not None and os.path.isfile(scaler_path):
        with _loading(path, "scaler.pt"):
            scaler.load_state_dict(torch.load(scaler_path, weights_only=True))
    if restore_rng:
        with _loading(path, "rng.pt"):
            # python's and numpy's states hold plain tuples/arrays: not loadable with weights_only
            set_rng_state(torch.load(os.path.join(path, "rng.pt"), weights_only=False))
    return read_trainer_state(path)


def read_trainer_state(path: str) -> dict:
    with _loading(path, "trainer_state.json"), open(os.path.join(path, "trainer_state.json"), encoding="utf-8") as f:
        state = strict_json.loads(f.read())
    if not isinstance(state, dict):
        raise UserError(f"{os.path.join(path, 'trainer_state.json')} is damaged (not a JSON object)")
    return state


def checkpoint_config(path: str) -> dict:
    """The run config saved with the checkpoint."""
    with _loading(path, "config.yaml"), open(os.path.join(path, "config.yaml")) as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict):
        raise UserError(f"{os.path.join(path, 'config.yaml')} is damaged (not a mapping of key: value)")
    return config


def resolve_resume(output_dir: str, resume: str) -> tuple[str, list[str]]:
    """'latest' -> the newest checkpoint in output_dir that verifies, and why each newer one was passed over;
    otherwise the given checkpoint directory, which must verify (DamagedCheckpoint names the damaged file)."""
    if resume == "latest":
        path, passed_over = latest_verified_checkpoint(output_dir)
        if path is None:
            where = os.path.join(output_dir, "checkpoints")
            why = f" ({len(passed_over)} damaged or incomplete: {passed_over[0]})" if passed_over else ""
            raise UserError(f"resume=latest: no complete checkpoint in {where!r}{why}")
        return path, passed_over
    if not os.path.isdir(resume):
        raise UserError(f"resume: checkpoint directory {resume!r} not found")
    try:
        verify_checkpoint(resume)
    except DamagedCheckpoint as exc:
        raise DamagedCheckpoint(f"resume: {exc}") from None
    return resume, []


# ------------------------------------------------------------------------------------------ the model's part
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
