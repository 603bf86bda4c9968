"""What a run (or an export) owns in its folder, so that nothing else there is ever removed, or called a run.

A run starts only in a new or empty folder (or, with `--overwrite`, in a previous run's folder that holds
nothing else); `fused-stable export` follows the same rules for its target (`check_output_dir` for both).
Before it creates anything it writes `run_manifest.json`, naming the top-level entries it will create
(`run.yaml`, `metrics.jsonl`, `checkpoints/`, `adapter/`...). A folder with that file is a run; a folder
without it never is. `--overwrite` removes exactly the entries the manifest names (with everything inside
them) and refuses, naming a few, when the folder holds anything else. Every check here reads only, so a
refused start leaves the folder exactly as it was.

While a command writes a folder it holds its `FolderLock`: a second command into the same folder is refused at
once (`check_output_dir` looks first), also with `--overwrite`, and a run that was killed leaves no lock behind.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import time

from fused_stable.argcheck import check_writable
from fused_stable.errors import UserError

SFT, EXPORT, STRESS = "fused-stable sft", "fused-stable export", "fused-stable stress"  # who owns a folder
# how messages name what each command writes: (what a folder is not, what it already holds, who created files)
_NAMES = {
    SFT: ("a fused-stable run", "a run", "the run"),
    EXPORT: ("an export", "an export", "the export"),
    STRESS: ("a fused-stable stress result", "stress results", "the stress suite"),
}
MANIFEST_FILE = "run_manifest.json"
_MANIFEST_TMP = MANIFEST_FILE + ".tmp"
LOCK_FILE = ".fused-stable.lock"
_BOOKKEEPING = {MANIFEST_FILE, _MANIFEST_TMP, LOCK_FILE}  # never a run's entry, never a foreign one
_SHOWN = 4  # foreign entries named in a refusal


# ------------------------------------------------------------------------------------------ the lock
class FolderBusy(UserError):
    """Another live process holds the folder's lock."""


class FolderLock:
    """An exclusive lock on a folder for as long as one command writes it: `fcntl.flock` on `folder/LOCK_FILE`.

    flock rather than a PID file: the kernel ties the lock to the open file and drops it when the process ends,
    however it ends (SIGKILL and the OOM killer included), so a killed run never leaves the folder locked and
    nothing has to guess whether a recorded PID is still the same process (PIDs are reused, and mean nothing
    across the containers or hosts that may share a folder). The file records who holds the lock (pid, host,
    command, start time) for the refusal's message only. `release` removes the file while it still holds the
    lock; `acquire` checks that the file it locked is still the one at the path (else it was just released and
    removed: lock again), so a lock is never held on a removed file. A killed run leaves the file behind, not
    the lock: the next acquire takes it over. Advisory: it binds only the commands of this package. A
    filesystem without flock (some network mounts) cannot be locked: `acquire` then returns False and the
    command goes on unguarded.

        lock = FolderLock("runs/sft", command="fused-stable sft")
        lock.acquire()            # FolderBusy (a UserError naming the holder) if another process holds it
        try: ...                  # write the folder
        finally: lock.release()   # or `with FolderLock(...):`

    `acquire` creates the folder if it is missing; `release` removes the folders it created if they are still
    empty (a command that was refused before writing leaves no trace).
    """

    RETRIES, RETRY_S = 20, 0.025  # `folder_lock_holder` takes the lock shared for an instant: wait that out

    def __init__(self, folder: str, command: str = SFT):
        self.folder, self.command = folder, command
        self.path = os.path.join(folder, LOCK_FILE)
        self._file = None
        self._created: list[str] = []

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> bool:
        """Take the lock (True), or find the filesystem without flock (False); FolderBusy if another process
        holds it. Creates the folder if needed."""
        import fcntl

        if self._file is not None:
            return True
        self._created = _make_folders(self.folder)
        try:
            for _ in range(self.RETRIES):
                f = open(self.path, "a+", encoding="utf-8")
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    f.close()
                    time.sleep(self.RETRY_S)
                    continue
                except OSError as exc:
                    f.close()
                    if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        return False
                    raise
                if _same_file(f, self.path):
                    self._file = f
                    f.seek(0)
                    f.truncate()
                    holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command}
                    f.write(json.dumps({**holder, "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
                    f.flush()
                    return True
                f.close()  # locked a file that its holder had just removed: lock the new one
            raise FolderBusy(_busy_message(self.folder, read_holder(self.path), "the folder"))
        except BaseException:
            self._remove_created()
            raise

    def release(self) -> None:
        """Remove the lock file and let go (a no-op when not held); then the folders `acquire` created, if empty."""
        if self._file is not None:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
            self._file.close()  # closing drops the flock
            self._file = None
        self._remove_created()

    def _remove_created(self) -> None:
        for folder in reversed(self._created):
            try:
                os.rmdir(folder)
            except OSError:
                break  # not empty: the command wrote something there
        self._created = []

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _make_folders(folder: str) -> list[str]:
    """Create folder and its missing parents; returns those created, outermost first."""
    missing = []
    probe = os.path.abspath(folder)
    while not os.path.exists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    os.makedirs(folder, exist_ok=True)
    return list(reversed(missing))


def _same_file(f, path: str) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        return False


def read_holder(path: str) -> dict:
    """What the lock file at `path` says about its holder ({} if unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            holder = json.loads(f.readline() or "{}")
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def folder_lock_holder(folder: str) -> dict | None:
    """Who holds `folder`'s lock: {"pid", "host", "command", "started"} as its holder wrote them ({} if it wrote
    nothing readable), or None when nobody does (no lock file, or one a killed process left). Reads only: it
    takes the lock shared for an instant, which an `acquire` at that moment waits out."""
    import fcntl

    path = os.path.join(folder, LOCK_FILE)
    try:
        f = open(path, encoding="utf-8")
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_holder(path)
        except OSError:
            return None  # no flock on this filesystem: nobody can hold it
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return None


def _busy_message(folder: str, holder: dict, option: str) -> str:
    who = holder.get("command", "another fused-stable command")
    where = ", ".join(
        part
        for part in (
            f"pid {holder['pid']}" if "pid" in holder else "",
            f"on {holder['host']}" if "host" in holder else "",
            f"started {holder['started']}" if "started" in holder else "",
        )
        if part
    )
    return (
        f"{option} {folder!r} is in use by {who}{f' ({where})' if where else ''}: two commands would write the "
        "same files; wait for it to end or stop it (Ctrl-C saves a checkpoint), then run this again"
    )


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
    """The folder's entries, without the lock file (a killed run may leave it: it holds nothing)."""
    return sorted(n for n in os.listdir(output_dir) if n != LOCK_FILE) if os.path.isdir(output_dir) else []


def _shown(names: list[str], output_dir: str) -> str:
    marked = [n + ("/" if os.path.isdir(os.path.join(output_dir, n)) else "") for n in names[:_SHOWN]]
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(marked) + more


def foreign_entries(output_dir: str, manifest: dict) -> list[str]:
    """Entries of output_dir that the run did not create."""
    owned = set(manifest["entries"]) | _BOOKKEEPING
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
    """Raise UserError unless `command` (SFT, EXPORT or STRESS) may write into output_dir as asked; reads only. A
    folder whose `FolderLock` another process holds is refused first (FolderBusy). A new or empty folder is fine;
    one that holds what the same command wrote before (its manifest says so), only with `overwrite` and only if
    it holds nothing else. `option`: how the user named the folder (in messages).
    sft only: `resume_path`, the (verified) checkpoint to continue (continuing it in its own run folder is
    always allowed; in another folder the rules of a new run apply); `has_checkpoint`, whether the run in
    output_dir saved a complete checkpoint (it changes what to suggest)."""
    not_a, holds, creator = _NAMES[command]
    if not output_dir.strip():
        raise UserError(f"{option} is empty: give a new or empty folder")
    check_writable(output_dir, option)
    holder = folder_lock_holder(output_dir)  # first: a live run's folder is busy, whatever else it holds
    if holder is not None:
        raise FolderBusy(_busy_message(output_dir, holder, option))
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
