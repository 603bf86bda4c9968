"""Starting, stopping, pausing and resuming runs: each run is a `fused-stable sft` process of its own, in a
new session (closing the page or stopping the webui never ends it; Ctrl-C in the webui's terminal does not
reach it), started by `runner` with its output in the page's log of the run.

- **Start**: the run's keys (YAML) are checked exactly as `fused-stable sft` checks them (`resolve_config`,
  `check_output_dir`: the same one-line messages), with every path resolved inside the workspace (`paths`);
  then the workspace lock is taken and the process started. A bad value starts nothing.
- **Stop** and **Pause**: SIGINT to the run's process, as Ctrl-C: the step under way finishes, a verified
  checkpoint is saved, the process exits (130). Pause also records that it was asked to wait.
- **Resume**: `fused-stable sft --output_dir RUN --resume latest` in the same folder, which continues the
  run from its checkpoint exactly (on CPU, bit for bit: `tests/webui/test_api.py`).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import yaml

from fused_stable.argcheck import suggestion
from fused_stable.errors import UserError
from fused_stable.train.config.keys import ALIASES, FIELDS
from fused_stable.train.run.outputs import MANIFEST_FILE
from fused_stable.webui import records
from fused_stable.webui.lock import WorkspaceLock, process_alive, process_start_time
from fused_stable.webui.paths import Workspace
from fused_stable.webui.records import RunRecord
from fused_stable.webui.runs import RunStatus, read_status

BUILTIN_DATASETS = ("identity", "arithmetic")
PATH_KEYS = ("output_dir", "dataset", "eval_dataset", "model")  # sft keys naming files: kept inside the workspace
DATASET_KEYS = ("dataset", "eval_dataset")  # a comma list (or YAML list) of datasets, each resolved on its own
RUNNER = [sys.executable, "-m", "fused_stable.webui.runner"]


def builtin_models() -> tuple[str, ...]:
    from fused_stable.train.model.sources import EMBEDDED, TINY

    return (TINY, *EMBEDDED)


def parse_keys(text: str) -> dict:
    """The run's sft keys from YAML text (a mapping of key: value); UserError on anything else."""
    try:
        values = yaml.safe_load(text or "")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"the run's keys: invalid YAML{where} ({getattr(exc, 'problem', None) or exc})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise UserError("the run's keys must be a YAML mapping of key: value (as in an sft --config file)")
    return values


def flag_value(value) -> str:
    """A YAML value as `fused-stable sft` reads it from a flag."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass
class Launch:
    """A checked start: the sft arguments, the run folder and the command a person would type."""

    args: list[str]
    run_dir: str

    @property
    def command(self) -> str:
        return "fused-stable sft " + shlex.join(self.args)


class RunController:
    """The runs of one workspace. `program`: what runs one run (default: `python -m fused_stable.webui.runner`;
    it is given `WORKSPACE RUN_DIR -- SFT_ARGS`)."""

    def __init__(self, workspace: Workspace, program: list[str] | None = None):
        self.workspace = workspace
        self.program = list(program or RUNNER)
        self.lock = WorkspaceLock(workspace.control)
        self._children: dict[int, subprocess.Popen] = {}  # processes this page started (reaped when they end)
        self._mutex = threading.Lock()  # the page's handlers run in threads

    # ------------------------------------------------------------------------------------------ checking
    def prepare(self, keys: dict) -> Launch:
        """Check a run's keys as `fused-stable sft` would, with its paths inside the workspace; nothing is
        written or started."""
        from fused_stable.train.config.resolve import resolve_config
        from fused_stable.train.run.outputs import check_output_dir

        values = {}
        for name, value in keys.items():
            name = str(name)
            if name not in FIELDS:
                close = suggestion(name, FIELDS, ALIASES)
                hint = f"; did you mean {close!r}?" if close else "; see `fused-stable sft --help` for the keys"
                raise UserError(f"unknown key {name!r}{hint}")
            if name == "resume":
                raise UserError("resume is not a key of a new run: use Resume to continue a paused or stopped run")
            if isinstance(value, (list, dict)) and not (name in DATASET_KEYS and isinstance(value, list)):
                raise UserError(f"{name} must be a single value, got {value!r}")
            values[name] = value
        values["output_dir"] = self.workspace.resolve(values.get("output_dir") or self._new_run_name(), "output_dir")
        for name in DATASET_KEYS:
            if values.get(name) is not None:
                values[name] = self._datasets(values[name], name)
        if values.get("model") not in (None, *builtin_models()):
            values["model"] = self.workspace.resolve(flag_value(values["model"]), "model")
        args = [f"--{name}={flag_value(value)}" for name, value in values.items()]
        cfg, _ = resolve_config(args)  # the CLI's own checks and messages
        check_output_dir(cfg.output_dir, overwrite=cfg.overwrite)
        return Launch(args, cfg.output_dir)

    def _datasets(self, value, name: str) -> str:
        """A dataset key's comma list (or YAML list) with each file inside the workspace; the built-in tasks
        and each item's `#N` (its sample count) kept as they are."""
        from fused_stable.train.data import mixing

        text = value if isinstance(value, list) else flag_value(value)
        if not mixing.split_list(text):
            raise UserError(f"{name} is empty: give a built-in task or a file inside the workspace")
        return mixing.rename(
            text, lambda path: path if path in BUILTIN_DATASETS else self.workspace.resolve(path, name)
        )

    def preview(self, text: str) -> Launch:
        return self.prepare(parse_keys(text))

    def _new_run_name(self) -> str:
        base = "run-" + time.strftime("%Y%m%d-%H%M%S")
        name, n = base, 1
        while os.path.exists(os.path.join(self.workspace.root, name)):
            n += 1
            name = f"{base}-{n}"
        return name

    # ------------------------------------------------------------------------------------------ actions
    def start(self, text: str) -> RunStatus:
        """Check the keys, take the workspace, start the run; UserError if anything is wrong (nothing starts)."""
        with self._mutex:
            launch = self.preview(text)
            self._launch(launch.run_dir, launch.args, "start")
        return self._status_of(launch.run_dir)

    def resume(self, run: str = "") -> RunStatus:
        """Continue a paused, stopped or failed run from its newest checkpoint, in its own folder."""
        with self._mutex:
            run_dir = self.run_dir(run)
            status = read_status(self.workspace, run_dir, self.lock.holder())
            if not status.can_resume:
                why = "it has no checkpoint" if status.checkpoint is None else f"it is {status.state}"
                raise UserError(f"{status.name} cannot be resumed: {why}")
            self._launch(run_dir, ["--output_dir", run_dir, "--resume", "latest"], "resume")
        return self._status_of(run_dir)

    def stop(self) -> RunStatus:
        return self._interrupt("stop")

    def pause(self) -> RunStatus:
        return self._interrupt("pause")

    def _interrupt(self, action: str) -> RunStatus:
        """SIGINT to the running run's process (it finishes the step, saves a checkpoint and exits)."""
        with self._mutex:
            held = self.lock.holder()
            if held is None:
                raise UserError(f"no run is going in this workspace: nothing to {action}")
            run_dir = held["run_dir"]
            record = RunRecord(self.workspace.root, run_dir)
            process = record.process() or {}
            pid = process.get("pid")
            if not pid or pid == os.getpid() or not process_alive(pid, process.get("start_time")):
                raise UserError(f"{self.workspace.relative(run_dir)} is being started: {action} it in a moment")
            if action == "pause" and not os.path.isfile(os.path.join(run_dir, MANIFEST_FILE)):
                raise UserError(
                    "the run is still loading its model and data (nothing written yet, so there is no state to "
                    "pause at): pause it once training has begun, or stop it"
                )
            record.request(action)
            os.kill(pid, signal.SIGINT)
        return self._status_of(run_dir)

    def _launch(self, run_dir: str, args: list[str], kind: str) -> None:
        """Take the workspace lock and start the run's process (called with the mutex held)."""
        self.lock.acquire(run_dir, os.getpid())
        try:
            record = RunRecord(self.workspace.root, run_dir)
            launch = Launch(args, run_dir)
            record.new_launch(kind, args, launch.command)
            with open(record.log_path, "ab") as log:
                proc = subprocess.Popen(
                    [*self.program, self.workspace.root, run_dir, "--", *args],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.workspace.root,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},  # the log shows each line as it is printed
                    start_new_session=True,
                )
        except BaseException:
            self.lock.release(os.getpid())
            raise
        self._children[proc.pid] = proc
        record.started(proc.pid, process_start_time(proc.pid))
        self.lock.hand_over(run_dir, proc.pid)
        records.set_current(self.workspace.root, run_dir)

    # ------------------------------------------------------------------------------------------ reading
    def run_dir(self, run: str = "") -> str:
        """The folder of `run` (relative to the workspace), or of the run started last."""
        if run and run.strip():
            return self.workspace.resolve(run, "run")
        held = self.lock.holder()
        current = held["run_dir"] if held and held.get("pid") != "?" else records.current(self.workspace.root)
        if current is None:
            raise UserError("no run in this workspace yet: start one")
        return current

    def status(self, run: str = "") -> RunStatus:
        """What `run` (relative to the workspace; default: the run started last) is doing."""
        return self._status_of(self.run_dir(run))

    def _status_of(self, run_dir: str) -> RunStatus:
        self._reap()
        return read_status(self.workspace, run_dir, self.lock.holder())

    def running_processes(self) -> list[subprocess.Popen]:
        """The run processes this page started that are still going."""
        self._reap()
        return list(self._children.values())

    def _reap(self) -> None:
        """Collect the exit status of the processes this page started (a zombie would look alive to a PID)."""
        for pid, proc in list(self._children.items()):
            if proc.poll() is not None:
                del self._children[pid]
