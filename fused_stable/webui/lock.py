"""One run at a time per workspace: `WORKSPACE/.webui/lock.json` names the run that holds the workspace and
the process training it.

The lock is created atomically (O_EXCL), so two starts cannot both win. A lock whose process is gone is
stale and is taken over: the process is identified by its PID and, where /proc exists, its start time (a PID
that the system gave to a new process since is not the run). A run that crashed or was killed therefore
never leaves the workspace stuck; the run's own process removes the lock when it ends (`runner`).
"""

from __future__ import annotations

import json
import os
import time

from fused_stable.errors import UserError

LOCK_FILE = "lock.json"
_WRITE_GRACE_S = 5.0  # a lock file younger than this that does not parse is being written, not damaged


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after "(comm)" (state first), or None without /proc or without the process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None


def process_alive(pid: int, start_time: int | None = None) -> bool:
    """Whether the process `pid` still runs (a zombie does not), and is the one that started at
    `start_time` (when known)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    fields = _proc_stat(pid)
    if fields is None:
        return not os.path.isdir("/proc/self")  # no /proc at all: the signal test is all there is
    if fields[0] == "Z":
        return False
    return start_time is None or int(fields[19]) == start_time


class WorkspaceLock:
    def __init__(self, control_dir: str):
        self.path = os.path.join(control_dir, LOCK_FILE)

    def holder(self) -> dict | None:
        """The live lock's record ({run_dir, pid, start_time, since}); a stale one is removed."""
        try:
            age = time.time() - os.stat(self.path).st_mtime
            with open(self.path, encoding="utf-8") as f:
                record = json.load(f)
            pid, start = int(record["pid"]), record.get("start_time")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            if age < _WRITE_GRACE_S:  # another start is writing it this moment
                return {"run_dir": "(a run being started)", "pid": "?"}
            record, pid, start = None, 0, None  # damaged: nobody can hold it
        if record is not None and process_alive(pid, start):
            return record
        self._remove_if_unchanged(record)
        return None

    def acquire(self, run_dir: str, pid: int) -> None:
        """Take the workspace for `run_dir`, held by process `pid`; UserError naming the run that holds it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(3):  # a stale lock is removed, then taken: at most a few rounds against a racing start
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                held = self.holder()
                if held is not None:
                    raise UserError(
                        f"a run is already going in this workspace ({held['run_dir']}, process {held['pid']}): "
                        "one run at a time; stop or pause it first"
                    ) from None
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self._record(run_dir, pid), f)
            return
        raise UserError(f"{self.path} keeps coming back: another page is starting runs in this workspace")

    def hand_over(self, run_dir: str, pid: int) -> None:
        """The process that holds the lock is now `pid` (the run's own, once it is started)."""
        tmp = self.path + f".{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self._record(run_dir, pid), f)
        os.replace(tmp, self.path)

    def release(self, pid: int) -> None:
        """Remove the lock if process `pid` holds it (a later run's lock is left alone)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            return
        if record.get("pid") == pid:
            self._remove_if_unchanged(record)

    @staticmethod
    def _record(run_dir: str, pid: int) -> dict:
        return {"run_dir": run_dir, "pid": pid, "start_time": process_start_time(pid), "since": time.time()}

    def _remove_if_unchanged(self, record: dict | None) -> None:
        """Remove the lock file unless it changed since `record` was read (another start took it over)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                now = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError):
            now = None
        if now == record:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
