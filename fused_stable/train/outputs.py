"""What a run (or an export) owns in its folder, so that nothing else there is ever removed, or called a run.

A run starts only in a new or empty folder (or, with `--overwrite`, in a previous run's folder that holds
nothing else); `fused-stable export` follows the same rules for its target (`check_output_dir` for both).
Before it creates anything it writes `run_manifest.json`, naming the top-level entries it will create
(`run.yaml`, `metrics.jsonl`, `checkpoints/`, `adapter/`...). A folder with that file is a run; a folder
without it never is. `--overwrite` removes exactly the entries the manifest names (with everything inside
them) and refuses, naming a few, when the folder holds anything else. Every check here reads only, so a
refused start leaves the folder exactly as it was.
"""

from __future__ import annotations

import json
import os
import shutil

from fused_stable.argcheck import check_writable
from fused_stable.errors import UserError

SFT, EXPORT = "fused-stable sft", "fused-stable export"  # the commands that own a folder (`created_by`)
# how messages name what each command writes: (what a folder is not, what it already holds, who created files)
_NAMES = {SFT: ("a fused-stable run", "a run", "the run"), EXPORT: ("an export", "an export", "the export")}
MANIFEST_FILE = "run_manifest.json"
_MANIFEST_TMP = MANIFEST_FILE + ".tmp"
_SHOWN = 4  # foreign entries named in a refusal


def read_manifest(output_dir: str) -> dict | None:
    """The manifest of the run in output_dir; None if the folder is not a run. A damaged manifest is refused
    (never guessed at: it decides what --overwrite deletes)."""
    path = os.path.join(output_dir, MANIFEST_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        entries = manifest["entries"]
        if not (isinstance(entries, list) and all(isinstance(e, str) and e and os.sep not in e for e in entries)):
            raise ValueError("entries must be a list of names")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f"{path} is damaged ({exc}); remove the run's files by hand or choose another output_dir"
        ) from None
    return manifest


def _listing(output_dir: str) -> list[str]:
    return sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []


def _shown(names: list[str], output_dir: str) -> str:
    marked = [n + ("/" if os.path.isdir(os.path.join(output_dir, n)) else "") for n in names[:_SHOWN]]
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(marked) + more


def foreign_entries(output_dir: str, manifest: dict) -> list[str]:
    """Entries of output_dir that the run did not create."""
    owned = set(manifest["entries"]) | {MANIFEST_FILE, _MANIFEST_TMP}
    return [name for name in _listing(output_dir) if name not in owned]


def check_output_dir(
    output_dir: str,
    *,
    overwrite: bool,
    command: str = SFT,
    option: str = "output_dir",
    resume_path: str | None = None,
    has_checkpoint: bool = False,
) -> None:
    """Raise UserError unless `command` (SFT or EXPORT) may write into output_dir as asked; reads only. A new or
    empty folder is fine; one that holds what the same command wrote before (its manifest says so), only with
    `overwrite` and only if it holds nothing else. `option`: how the user named the folder (in messages).
    sft only: `resume_path`, the (verified) checkpoint to continue (continuing it in its own run folder is
    always allowed; in another folder the rules of a new run apply); `has_checkpoint`, whether the run in
    output_dir saved a complete checkpoint (it changes what to suggest)."""
    not_a, holds, creator = _NAMES[command]
    if not output_dir.strip():
        raise UserError(f"{option} is empty: give a new or empty folder")
    check_writable(output_dir, option)
    if resume_path is not None:
        home = os.path.dirname(os.path.dirname(os.path.abspath(resume_path)))  # output_dir/checkpoints/step-N
        if os.path.realpath(home) == os.path.realpath(output_dir):
            return
    entries = _listing(output_dir)
    if not entries:
        return
    manifest = read_manifest(output_dir)
    if manifest is None:
        raise UserError(
            f"{option} {output_dir!r} is not empty and is not {not_a} (it holds {_shown(entries, output_dir)}): "
            f"choose a new or empty folder (--overwrite never removes files {command} did not create)"
        )
    created_by = manifest.get("created_by", SFT)  # the first manifests were all written by sft
    if created_by != command:
        raise UserError(f"{option} {output_dir!r} holds a {created_by} run, not {not_a}: choose a new or empty folder")
    if not overwrite:
        if command != SFT:
            how = "pass --overwrite to replace it"
        elif has_checkpoint:
            how = "pass --resume latest to continue it or --overwrite to replace it"
        else:
            how = "it saved no checkpoint, so there is nothing to resume: pass --overwrite to start it again"
        raise UserError(f"{option} {output_dir!r} already holds {holds}; {how}")
    foreign = foreign_entries(output_dir, manifest)
    if foreign:
        raise UserError(
            f"--overwrite: {option} {output_dir!r} also holds files {creator} did not create "
            f"({_shown(foreign, output_dir)}); nothing was removed: move them away or choose another folder"
        )


def remove_previous_run(output_dir: str) -> list[str]:
    """Remove what the previous run's manifest names (after `check_output_dir` allowed it); returns the names
    removed. The manifest goes last, so an interrupted removal can simply be run again."""
    manifest = read_manifest(output_dir)
    if manifest is None:
        return []
    removed = []
    for name in manifest["entries"]:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
        else:
            continue
        removed.append(name)
    os.remove(os.path.join(output_dir, MANIFEST_FILE))
    return removed


def claim(output_dir: str, names: list[str], command: str = SFT, details: dict | None = None) -> None:
    """Record (atomically) that the run in output_dir creates these top-level entries; call it before
    creating them. Creates output_dir if needed; names already claimed are kept. `details`: further facts about
    the run to record beside them (sft: the optimizer state's precision and size)."""
    os.makedirs(output_dir, exist_ok=True)
    manifest = read_manifest(output_dir) or {"created_by": command, "entries": []}
    entries = list(manifest["entries"]) + [n for n in names if n not in manifest["entries"]]
    unchanged = all(manifest.get(key) == value for key, value in (details or {}).items())
    if entries == manifest["entries"] and unchanged and os.path.isfile(os.path.join(output_dir, MANIFEST_FILE)):
        return
    manifest.update(details or {})
    manifest["entries"] = entries
    tmp = os.path.join(output_dir, _MANIFEST_TMP)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(output_dir, MANIFEST_FILE))
