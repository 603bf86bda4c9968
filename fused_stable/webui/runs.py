"""The run-folder reader: what a run is doing, read back from its own files (metrics.jsonl, alerts.jsonl,
run.yaml, checkpoints/, eval.json, adapter/ or model/) and the page's records of its process (`records`).

Nothing here writes or holds state, so a browser refresh, a second tab or a restarted page shows the same
run. A run's state is one of:

- `running`: its process is alive (a pause or stop asked of it shows in `request` until it ends);
- `paused`: ended by the page's Pause with a checkpoint (Resume continues it exactly);
- `stopped`: ended by the page's Stop, by the guard (`--guard stop`, exit code 3: `reason` says why), or by a
  signal from elsewhere;
- `finished`: the final adapter (or model) is written;
- `failed`: it ended in an error, or its process vanished without saying how it ended (killed).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field

import yaml

from fused_stable import strict_json
from fused_stable.train.run.outputs import MANIFEST_FILE
from fused_stable.train.run.report import ALERTS_FILE, METRICS_FILE
from fused_stable.webui.lock import process_alive
from fused_stable.webui.paths import CONTROL_DIR, Workspace
from fused_stable.webui.records import RunRecord

STATES = ("running", "paused", "stopped", "finished", "failed")
EVAL_FILE, RUN_FILE = "eval.json", "run.yaml"  # as train.evaluation.before_after and train.run.setup name them
GUARD_STOP_CODE, SIGNAL_CODES = 3, (130, 143)  # `fused-stable sft`'s exit codes (docs/trainer.md)
# metrics a row may carry besides the training loss (held-out evaluations, when the run schedules them)
EXTRA_LOSSES = ("eval_loss", "retention_loss")
_TOTAL_STEPS = re.compile(r"\| (\d+) steps x \d+ x \d+ \|")  # sft's start line: "| 40 steps x 1 x 4 |"
_ETA_WINDOW = 20  # the last rows the ETA's pace is measured over
_SKIPPED_SHOWN = 20
_MAX_DEPTH = 3  # how deep under the workspace runs are looked for


def read_rows(path: str) -> list[dict]:
    """The complete lines of a .jsonl file that a live run may be appending to (a line being written is left
    for the next read, silently), numbers decoded by `strict_json`."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return []
    rows = []
    for line in text.split("\n")[:-1]:  # the last piece has no newline yet: not complete
        if line.strip():
            try:
                row = strict_json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def final_artifact(run_dir: str) -> str | None:
    """The finished run's adapter/ or model/ folder (`save_final` writes it once training is done), or None."""
    for kind, weights in (("adapter", "adapter_model.safetensors"), ("model", "model.safetensors")):
        folder = os.path.join(run_dir, kind)
        if os.path.isfile(os.path.join(folder, weights)) or (
            kind == "model" and os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
        ):
            return folder
    return None


def latest_checkpoint(run_dir: str) -> str | None:
    from fused_stable.train.run.checkpoint import latest_checkpoint as latest

    return latest(run_dir)


@dataclass
class RunStatus:
    run_dir: str
    name: str  # the run folder relative to the workspace
    state: str
    step: int = 0
    max_steps: int | None = None
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    skipped_total: int = 0
    skipped_steps: list = field(default_factory=list)  # the latest steps the optimizer skipped (up to 20)
    tokens_per_s: float | None = None
    elapsed_s: float | None = None
    eta_s: float | None = None
    max_grad_norm: float | None = None  # the clip threshold drawn on the grad-norm plot
    alerts: list = field(default_factory=list)  # [{step, kind, value, threshold, action, detected_at}]
    rollbacks: int = 0
    reason: str = ""  # why it is in this state, one line (why it stopped or failed, what it is waiting for)
    request: str | None = None  # pause | stop, asked of the running process
    can_resume: bool = False
    checkpoint: str | None = None
    pid: int | None = None
    exit_code: int | None = None
    command: str | None = None
    eval: dict | None = None  # eval.json's before/after scores
    extra: dict = field(default_factory=dict)  # the latest eval_loss / retention_loss, when present

    def to_dict(self) -> dict:
        """JSON-ready: non-finite numbers as the strings "NaN" / "Infinity" (strict_json's encoding)."""
        return strict_json.encode(asdict(self))


def _config(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, RUN_FILE), encoding="utf-8") as f:
            value = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return {}
    return value if isinstance(value, dict) else {}


def _total_steps(log: str, config: dict) -> int | None:
    found = _TOTAL_STEPS.findall(log)
    if found:
        return int(found[-1])
    return config.get("max_steps") if isinstance(config.get("max_steps"), int) else None


def _eta(rows: list[dict], step: int, total: int | None) -> float | None:
    recent = [r for r in rows[-_ETA_WINDOW:] if isinstance(r.get("elapsed_s"), (int, float))]
    if total is None or len(recent) < 2 or recent[-1]["step"] <= recent[0]["step"]:
        return None
    pace = (recent[-1]["elapsed_s"] - recent[0]["elapsed_s"]) / (recent[-1]["step"] - recent[0]["step"])
    return max(0.0, pace * (total - step))


def _last_line(log: str, needle: str | None = None) -> str:
    lines = [ln.strip() for ln in log.splitlines() if ln.strip() and not ln.startswith("===")]
    if needle is not None:
        lines = [ln for ln in lines if needle in ln]
    return lines[-1] if lines else ""


def _guard_reason(log: str, alerts: list[dict]) -> str:
    lines = log.splitlines()
    for i in range(len(lines) - 1, 0, -1):  # sft prints the guard's message, then "  resume: ..."
        if lines[i].startswith("  resume:") and lines[i - 1].startswith("fused-stable sft: "):
            return "the guard stopped the run: " + lines[i - 1][len("fused-stable sft: ") :].strip()
    stops = [a for a in alerts if a.get("action") == "stop"]
    if stops:
        a = stops[-1]
        return f"the guard stopped the run: {a.get('kind')} at step {a.get('step')} (value {a.get('value')})"
    return "the guard stopped the run (exit code 3): see alerts"


def _ended(code: int, request: str | None, final: str | None, checkpoint: str | None, log: str, alerts: list):
    """(state, reason) of a process that ended with `code`."""
    if code == 0 or final is not None:
        return "finished", ""
    if code == GUARD_STOP_CODE:
        return "stopped", _guard_reason(log, alerts)
    if code in SIGNAL_CODES:
        if checkpoint is None:
            return "stopped", "stopped before training started: nothing was written (start it again)"
        if request == "pause":
            return "paused", f"paused with a checkpoint ({os.path.basename(checkpoint)}): Resume continues it"
        if request == "stop":
            return "stopped", f"stopped from the page with a checkpoint ({os.path.basename(checkpoint)})"
        return "stopped", f"interrupted by a signal (exit code {code}) with a checkpoint"
    error = _last_line(log, "error:") or _last_line(log)
    return "failed", f"exit code {code}: {error}" if error else f"exit code {code}"


def read_status(workspace: Workspace, run_dir: str, lock_holder: dict | None = None) -> RunStatus:
    """Everything the page shows about the run in `run_dir` (inside the workspace). `lock_holder`: the
    workspace lock's record, for runs the page did not start (a live lock on them means running)."""
    record = RunRecord(workspace.root, run_dir)
    process, ended, request = record.process(), record.exit(), record.requested()
    log = record.log_tail()
    rows = read_rows(os.path.join(run_dir, METRICS_FILE))
    alerts = [
        {k: a.get(k) for k in ("step", "kind", "value", "threshold", "action", "detected_at")}
        for a in read_rows(os.path.join(run_dir, ALERTS_FILE))
    ]
    config = _config(run_dir)
    final, checkpoint = final_artifact(run_dir), latest_checkpoint(run_dir)
    status = RunStatus(run_dir=run_dir, name=workspace.relative(run_dir), state="failed", checkpoint=checkpoint)
    if process is not None:
        status.pid, status.command = process.get("pid"), process.get("command")
    alive = process is not None and ended is None and process_alive(process["pid"], process.get("start_time"))
    if alive:
        status.state, status.request = "running", request
        if request:
            status.reason = f"{request} asked: finishing the step, then saving a checkpoint"
        elif not os.path.isfile(os.path.join(run_dir, MANIFEST_FILE)):
            status.reason = "starting: loading the model and data"
    elif ended is not None:
        status.exit_code = ended.get("exit_code")
        status.state, status.reason = _ended(status.exit_code, request, final, checkpoint, log, alerts)
    elif process is not None:  # no exit record and no process: it was killed (or the machine went down)
        status.state = "finished" if final else "failed"
        if not final:
            status.reason = f"its process ({process.get('pid')}) ended without saying how (killed?)"
    elif final is not None:
        status.state = "finished"
    elif lock_holder is not None and os.path.realpath(lock_holder.get("run_dir", "")) == os.path.realpath(run_dir):
        status.state, status.pid = "running", lock_holder.get("pid")
    else:
        status.state, status.reason = "stopped", "not started from this page, and no final adapter or model"
    status.can_resume = status.state in ("paused", "stopped", "failed") and checkpoint is not None
    status.max_steps = _total_steps(log, config)
    mgn = config.get("max_grad_norm")
    status.max_grad_norm = float(mgn) if isinstance(mgn, (int, float)) and mgn > 0 else None
    status.alerts = alerts
    status.rollbacks = sum(1 for a in alerts if a.get("action") == "rollback")
    _fill_metrics(status, rows)
    status.eval = _read_eval(run_dir)
    return status


def _fill_metrics(status: RunStatus, rows: list[dict]) -> None:
    train_rows = [r for r in rows if "loss" in r and "grad_norm" in r]
    if train_rows:
        last = train_rows[-1]
        status.step = int(last.get("step", 0))
        status.loss, status.grad_norm, status.lr = last.get("loss"), last.get("grad_norm"), last.get("lr")
        status.skipped_total = int(last.get("skipped_total", 0))
        status.tokens_per_s, status.elapsed_s = last.get("tokens_per_s"), last.get("elapsed_s")
        status.skipped_steps = [r["step"] for r in train_rows if r.get("skipped")][-_SKIPPED_SHOWN:]
    if status.state == "running":
        status.eta_s = _eta(train_rows, status.step, status.max_steps)
    for key in EXTRA_LOSSES:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if values:
            status.extra[key] = values[-1]


def _read_eval(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, EVAL_FILE), encoding="utf-8") as f:
            report = strict_json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict):
        return None
    return {k: report.get(k) for k in ("model", "before", "after")}


def list_runs(workspace: Workspace) -> list[str]:
    """The run folders under the workspace (folders with a run_manifest.json written by sft, and folders
    the page launched a run into), newest first."""
    found = set()
    for top, dirs, files in os.walk(workspace.root):
        depth = os.path.relpath(top, workspace.root).count(os.sep) + (top != workspace.root)
        dirs[:] = [d for d in dirs if not d.startswith(".") and depth < _MAX_DEPTH]
        if MANIFEST_FILE in files and _created_by_sft(os.path.join(top, MANIFEST_FILE)):
            found.add(top)
            dirs[:] = []  # a run's own folders (checkpoints/, adapter/) hold no runs
    records = os.path.join(workspace.root, CONTROL_DIR, "runs")
    for top, _, files in os.walk(records):
        if "process.json" in files:
            found.add(os.path.join(workspace.root, os.path.relpath(top, records)))
    return sorted(found, key=_mtime, reverse=True)


def _created_by_sft(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return strict_json.loads(f.read()).get("created_by", "fused-stable sft") == "fused-stable sft"
    except (OSError, ValueError, AttributeError):
        return False


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0
