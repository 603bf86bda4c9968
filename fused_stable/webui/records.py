"""The page's own records of the runs it launched, beside (never inside) the run folders: a run folder holds
only what `fused-stable sft` wrote, so its manifest, `--overwrite` and `--resume` work as on the command line.

    WORKSPACE/.webui/runs/<run path>/process.json   the process of the latest launch: pid, start time, command
    WORKSPACE/.webui/runs/<run path>/request.json   what the page asked of it: pause | stop (cleared per launch)
    WORKSPACE/.webui/runs/<run path>/exit.json      how that process ended: written by the process itself
    WORKSPACE/.webui/runs/<run path>/log.txt        its stdout and stderr, every launch appended
    WORKSPACE/.webui/current                         the run the page started last

Each JSON file is written whole (a temporary file, then a rename), in the strict JSON of `fused_stable.strict_json`.
"""

from __future__ import annotations

import os
import time

from fused_stable import strict_json
from fused_stable.webui.paths import CONTROL_DIR

PROCESS_FILE, REQUEST_FILE, EXIT_FILE, LOG_FILE = "process.json", "request.json", "exit.json", "log.txt"
CURRENT_FILE = "current"
LOG_TAIL_BYTES = 64 * 1024  # how much of a log the page reads back (the end is what says why a run ended)


def _write_json(path: str, value: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(strict_json.dumps(value) + "\n")
    os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            value = strict_json.loads(f.read())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class RunRecord:
    """The records of one run folder (`run_dir`: absolute, inside `workspace_root`)."""

    def __init__(self, workspace_root: str, run_dir: str):
        self.run_dir = run_dir
        self.dir = os.path.join(workspace_root, CONTROL_DIR, "runs", os.path.relpath(run_dir, workspace_root))

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, LOG_FILE)

    def exists(self) -> bool:
        return os.path.isfile(os.path.join(self.dir, PROCESS_FILE))

    def new_launch(self, kind: str, argv: list[str], command: str) -> None:
        """Before a process is started: the previous launch's request and exit record go, the log says what
        starts now."""
        for name in (REQUEST_FILE, EXIT_FILE):
            try:
                os.remove(os.path.join(self.dir, name))
            except FileNotFoundError:
                pass
        os.makedirs(self.dir, exist_ok=True)
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {kind}: {command}\n")
        self._launch = {"kind": kind, "argv": argv, "command": command}

    def started(self, pid: int, start_time: int | None) -> None:
        _write_json(
            os.path.join(self.dir, PROCESS_FILE),
            {**self._launch, "pid": pid, "start_time": start_time, "started_at": time.time()},
        )

    def process(self) -> dict | None:
        return _read_json(os.path.join(self.dir, PROCESS_FILE))

    def request(self, action: str) -> None:
        _write_json(os.path.join(self.dir, REQUEST_FILE), {"action": action, "at": time.time()})

    def requested(self) -> str | None:
        record = _read_json(os.path.join(self.dir, REQUEST_FILE))
        return record.get("action") if record else None

    def ended(self, pid: int, exit_code: int) -> None:
        _write_json(os.path.join(self.dir, EXIT_FILE), {"pid": pid, "exit_code": exit_code, "ended_at": time.time()})

    def exit(self) -> dict | None:
        return _read_json(os.path.join(self.dir, EXIT_FILE))

    def log_tail(self, limit: int = LOG_TAIL_BYTES) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - limit))
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""


def set_current(workspace_root: str, run_dir: str) -> None:
    path = os.path.join(workspace_root, CONTROL_DIR, CURRENT_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(os.path.relpath(run_dir, workspace_root) + "\n")
    os.replace(tmp, path)


def current(workspace_root: str) -> str | None:
    """The absolute path of the run the page started last (None if it never started one)."""
    try:
        with open(os.path.join(workspace_root, CONTROL_DIR, CURRENT_FILE), encoding="utf-8") as f:
            relative = f.read().strip()
    except OSError:
        return None
    return os.path.join(workspace_root, relative) if relative else None
