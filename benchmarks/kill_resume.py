"""SIGKILL `fused-stable sft` at seeded random moments, resume it with `--resume latest`, and compare its end with an
uninterrupted run's, bit for bit (issue 52 item 5).

For each update rule x state precision: `python -m fused_stable sft` on the tiny model (the test suite's flags,
tests/train/sft_helpers.py's TINY, with `--tuner full`: the tiny model's LoRA factors are under 4096 elements, so an
8-bit group would keep them all fp32, and a LoRA run gives Muon no matrix) runs once straight through, timed; then
the same run again as a subprocess that is SIGKILLed after a random delay, resumed with `--resume latest` (or, when
the kill came before the first checkpoint was complete, started again with `--overwrite true`, as its message
says), killed again, `--kills` times, and then left to finish. A delay is counted from the run's header line (the
model built, the data read) and drawn uniformly from the straight run's time from its header to its exit, scaled
by the share of the steps the run has left: kills land in steps, in saves, in pruning and in the final export.

Identical means: the final weights file (model/model.safetensors) byte for byte, every logged loss as the same
float (metrics.jsonl, steps 1..N once each), and the last checkpoint's optimizer state tensor for tensor. A
combination sft refuses (exit code 2, one line) is recorded as "refused: <the line>", not as a failure.

    python benchmarks/kill_resume.py --optims lion,muon,sgd,adafactor --precisions fp32,8bit --kills 3 --out DIR

writes DIR/kill_resume.json and keeps the runs under DIR/runs; exit code 1 when a combination differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch
from safetensors.torch import load_file

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "train"))
from sft_helpers import TINY, optimizer_state_difference  # noqa: E402  (the suite's tiny flags, its comparison)

from fused_stable.train.run import checkpoint  # noqa: E402

HEADER = "fused-stable sft: model="  # the run's header line: printed once the model and data are ready


def sft_argv(optim: str, precision: str, args: argparse.Namespace) -> list[str]:
    """The run's flags: the suite's tiny run, full fine-tuning, one log line per step."""
    return [
        *TINY,
        "--threads",
        str(args.threads),
        "--tuner",
        "full",
        "--optim",
        optim,
        "--state_precision",
        precision,
        "--max_steps",
        str(args.steps),
        "--save_steps",
        str(args.save_steps),
        "--logging_steps",
        "1",
    ]


class Run:
    """One `python -m fused_stable sft` subprocess; its stdout and stderr read by threads (unbuffered), the time
    its header line came out noted."""

    def __init__(self, argv: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO_ROOT}
        cmd = [sys.executable, "-m", "fused_stable", "sft", *argv]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.header_at: float | None = None
        self.header = threading.Event()
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, pipe, lines: list[str]) -> None:
        for line in pipe:
            if line.startswith(HEADER) and self.header_at is None:
                self.header_at = time.monotonic()
                self.header.set()
            lines.append(line)
        self.header.set()  # the pipe closed: no header is coming

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code (negative: the signal), or None when it still runs after `timeout` seconds."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        for reader in self._readers:
            reader.join()
        return code

    def kill(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        return self.wait()


def straight_run(argv: list[str], out: str) -> dict:
    """The uninterrupted run, timed: its wall time and its time from the header to the exit."""
    run = Run([*argv, "--output_dir", out])
    code = run.wait()
    ended = time.monotonic()
    result = {"code": code, "wall_s": round(ended - run.started, 2), "stderr": "".join(run.err)[-3000:]}
    if run.header_at is not None:
        result["after_header_s"] = round(ended - run.header_at, 3)
    return result


def refusal(result: dict) -> str | None:
    """sft's refusal line when the run was refused as it should be (exit code 2, one line on stderr), else None."""
    lines = result["stderr"].splitlines()
    if result["code"] == 2 and len(lines) == 1:
        return lines[0]
    return None


def newest_checkpoint(out: str) -> int | None:
    """The step of the newest checkpoint `--resume latest` would take (complete and verified), or None."""
    try:
        path, _ = checkpoint.latest_verified_checkpoint(out)
    except Exception:  # no checkpoints folder yet, or nothing usable in it
        return None
    return None if path is None else int(os.path.basename(path).split("-")[1])


def logged_steps(out: str) -> list[int]:
    """The steps of metrics.jsonl's whole lines (a line the kill cut is left out)."""
    steps = []
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            for line in f:
                try:
                    steps.append(int(json.loads(line)["step"]))
                except (ValueError, KeyError, TypeError):
                    continue
    except FileNotFoundError:
        pass
    return steps


def where_it_landed(out: str) -> dict:
    """Where a kill left the run: the last step logged, the newest complete checkpoint, a save it cut short."""
    folder = os.path.join(out, "checkpoints")
    hidden = sorted(n for n in os.listdir(folder) if n.startswith(".")) if os.path.isdir(folder) else []
    steps = logged_steps(out)
    return {"step": max(steps, default=0), "checkpoint": newest_checkpoint(out), "leftovers": hidden}


def landed_text(landed: dict) -> str:
    """A kill's landing, short: `7` (step 7 logged), `7+s` (a save cut short), `-` (before step 1)."""
    if landed.get("finished"):
        return "done"
    text = str(landed["step"]) if landed["step"] else "-"
    return text + ("+s" if landed["leftovers"] else "")


def next_argv(argv: list[str], out: str) -> list[str]:
    """After a kill: `--resume latest`, or the same run again with `--overwrite true` before any checkpoint."""
    if newest_checkpoint(out) is not None:
        return ["--output_dir", out, "--resume", "latest"]
    return [*argv, "--output_dir", out, "--overwrite", "true"]


def killed_run(argv: list[str], out: str, kills: int, rng: random.Random, straight: dict, steps: int) -> dict:
    """The run SIGKILLed `kills` times at random moments, resumed after each, then left to finish."""
    landed, command = [], [*argv, "--output_dir", out]
    for _ in range(kills):
        run = Run(command)
        run.header.wait()
        if run.header_at is None:  # it ended before its header: an error, not a kill
            return {"landed": landed, "code": run.wait(), "stderr": "".join(run.err)[-3000:]}
        left = 1 - (newest_checkpoint(out) or 0) / steps
        delay = rng.uniform(0, straight["after_header_s"] * left)
        code = run.wait(timeout=max(0.0, delay - (time.monotonic() - run.header_at)))
        if code is not None:  # it finished before the kill came
            landed.append({"delay_s": round(delay, 3), "finished": True, "code": code})
            return {"landed": landed, "code": code, "stderr": "".join(run.err)[-3000:]}
        run.kill()
        landed.append({"delay_s": round(delay, 3), **where_it_landed(out)})
        command = next_argv(argv, out)
    run = Run(command)
    code = run.wait()
    return {"landed": landed, "code": code, "stderr": "".join(run.err)[-3000:]}


def losses(out: str) -> list[tuple[int, float]]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [(row["step"], row["loss"]) for row in rows if "loss" in row]


def file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def same_optimizer_state(a: str, b: str) -> bool:
    """Two optimizer.pt files hold the same state (the suite's own comparison, sft_helpers)."""
    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return optimizer_state_difference(sa, sb) is None


def compare(straight: str, killed: str, steps: int) -> dict:
    """The killed-and-resumed run's end against the straight run's: weights file, losses, optimizer state."""
    weights = os.path.join("model", "model.safetensors")
    optimizer = os.path.join("checkpoints", f"step-{steps}", "optimizer.pt")
    wa, wb = load_file(os.path.join(straight, weights)), load_file(os.path.join(killed, weights))
    la, lb = losses(straight), losses(killed)
    result = {
        "weights_file_bytes": file_digest(os.path.join(straight, weights))
        == file_digest(os.path.join(killed, weights)),
        "weights_tensors": wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa),
        "losses": la == lb and [s for s, _ in la] == list(range(1, steps + 1)),
        "optimizer_state": same_optimizer_state(os.path.join(straight, optimizer), os.path.join(killed, optimizer)),
    }
    if not result["losses"]:
        result["first_loss_difference"] = next(
            ([a, b] for a, b in zip(la, lb) if a != b), [la[len(lb) :], lb[len(la) :]]
        )
    result["identical"] = all(result[k] for k in ("weights_file_bytes", "weights_tensors", "losses", "optimizer_state"))
    return result


def one_combination(optim: str, precision: str, args, root: str) -> dict:
    """The straight run, the killed one, and their comparison for one rule x precision."""
    argv = sft_argv(optim, precision, args)
    folder = os.path.join(root, "runs", f"{optim}-{precision}")
    os.makedirs(folder, exist_ok=True)
    row = {"optim": optim, "precision": precision, "kills": args.kills}
    straight = straight_run(argv, os.path.join(folder, "straight"))
    row["straight"] = {k: v for k, v in straight.items() if k != "stderr"}
    if refusal(straight) is not None:
        return {**row, "result": f"refused: {refusal(straight)}"}
    if straight["code"] != 0:
        return {**row, "result": "straight run failed", "stderr": straight["stderr"]}
    rng = random.Random(f"{args.seed}-{optim}-{precision}")
    killed = killed_run(argv, os.path.join(folder, "killed"), args.kills, rng, straight, args.steps)
    row["landed"] = killed["landed"]
    if killed["code"] != 0:
        return {**row, "result": f"resumed run failed (exit {killed['code']})", "stderr": killed["stderr"]}
    row["compare"] = compare(os.path.join(folder, "straight"), os.path.join(folder, "killed"), args.steps)
    return {**row, "result": "identical" if row["compare"]["identical"] else "DIFFERS"}


def table(rows: list[dict]) -> str:
    """The results as a Markdown table: rule, precision, kills, where each landed, identical."""
    lines = [
        "| rule | state | kills | landed at (step logged; +s: in a save) | identical |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        landed = ", ".join(landed_text(x) for x in row.get("landed", [])) or "-"
        result = row["result"]
        shown = "yes" if result == "identical" else ("no: " + result if not result.startswith("refused") else result)
        lines.append(f"| {row['optim']} | {row['precision']} | {len(row.get('landed', []))} | {landed} | {shown} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optims", default="lion,muon,sgd,adafactor", help="comma-separated update rules")
    parser.add_argument("--precisions", default="fp32,8bit", help="comma-separated state precisions")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs per run before it is left to finish")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kills' delays")
    parser.add_argument("--steps", type=int, default=48, help="optimizer steps of each run")
    parser.add_argument("--save_steps", type=int, default=4, help="a checkpoint every N steps")
    parser.add_argument("--threads", type=int, default=1, help="each run's CPU threads (1: steadier on a busy machine)")
    parser.add_argument("--out", default=None, help="folder for kill_resume.json and the runs (default: a new one)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = args.out or tempfile.mkdtemp(prefix="kill_resume_")
    os.makedirs(root, exist_ok=True)
    rows = []
    for optim in args.optims.split(","):
        for precision in args.precisions.split(","):
            rows.append(one_combination(optim, precision, args, root))
            print(f"{optim} {precision}: {rows[-1]['result']}", file=sys.stderr, flush=True)
    record = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "args": vars(args),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    with open(os.path.join(root, "kill_resume.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(table(rows))
    print(f"wrote {os.path.join(root, 'kill_resume.json')}")
    failed = [r for r in rows if r["result"] != "identical" and not r["result"].startswith("refused")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
