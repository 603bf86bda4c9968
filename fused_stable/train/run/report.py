"""What a run shows and leaves behind: a live progress bar, metrics.jsonl (one line per optimizer step; the
rows of evaluated steps also hold `eval_loss` and `retention_loss`), alerts.jsonl (one line per
stability-guard alert, `AlertLog`), optional TensorBoard events (`train/*`, `eval/loss`,
`eval/retention_loss`, `guard/*`), curves.png (loss with the evaluations' own lines, grad norm vs the clip
threshold, lr, skipped steps, alerts) and the end-of-run summary of the evaluations (`evaluation_summary`).

The loop hands rows over only at logging steps, after one device read for the whole interval. Both .jsonl
files are strict JSON in the encoding of `fused_stable.strict_json` (a non-finite number is the string "NaN",
"Infinity" or "-Infinity"); `read_metrics` and `read_alerts` give the floats back, also from files written
in the encodings of earlier versions.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from fused_stable import strict_json

METRICS_FILE = "metrics.jsonl"
ALERTS_FILE = "alerts.jsonl"
CURVES_FILE = "curves.png"
# the evaluations' fields of a metrics row -> (TensorBoard tag, label on curves.png and in the summary)
EVAL_FIELDS = {
    "eval_loss": ("eval/loss", "eval loss (held out)"),
    "retention_loss": ("eval/retention_loss", "retention loss (base model's answers)"),
}


def _fmt(row: dict) -> str:
    return (
        f"loss {row['loss']:.4f} | grad_norm {row['grad_norm']:.3g} | lr {row['lr']:.3g} | "
        f"tok/s {row['tokens_per_s']:.0f} | skipped {row['skipped_total']}"
    )


def read_jsonl(path: str, *, tolerant: bool = False) -> list[dict]:
    """The objects of a .jsonl file written here (non-finite numbers as floats again); [] if it does not exist.
    `tolerant`: a line a kill cut in half (the last one of a run that was interrupted) is dropped with a note
    instead of failing, as a resumed run must."""
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = strict_json.loads(line)
            except json.JSONDecodeError:
                if not tolerant:
                    raise
                print(f"fused-stable sft: note: dropped unreadable line {number} of {path}", file=sys.stderr)
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _rewrite_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(strict_json.dumps(row) + "\n" for row in rows)


def read_metrics(output_dir: str) -> list[dict]:
    """metrics.jsonl as written by `Reporter`, with non-finite values as floats."""
    return read_jsonl(os.path.join(output_dir, METRICS_FILE))


def read_alerts(path: str) -> list[dict]:
    """alerts.jsonl (of a run folder, or the file itself) as written by `AlertLog`, non-finite values as floats."""
    if os.path.isdir(path):
        path = os.path.join(path, ALERTS_FILE)
    return read_jsonl(path)


class AlertLog:
    """output_dir/alerts.jsonl, one JSON object per alert (a `fused_stable.guard.Alert`). A resumed run first
    drops the alerts written after the checkpoint it resumes from (they belong to the steps it is about to
    replay)."""

    def __init__(self, output_dir: str, start_step: int = 0):
        self.path = os.path.join(output_dir, ALERTS_FILE)
        if os.path.isfile(self.path):
            kept = [a for a in read_jsonl(self.path, tolerant=True) if a.get("detected_at", 0) <= start_step]
            _rewrite_jsonl(self.path, kept)

    def write(self, alerts: list) -> None:
        if not alerts:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(strict_json.dumps(asdict(alert)) + "\n" for alert in alerts)


class Reporter:
    def __init__(
        self,
        output_dir: str,
        total_steps: int,
        start_step: int,
        *,
        tensorboard: bool,
        max_grad_norm: float | None,
        wandb_config: dict | None = None,
    ):
        self.output_dir = output_dir
        self.total_steps = total_steps
        self.max_grad_norm = max_grad_norm
        self.metrics_path = os.path.join(output_dir, METRICS_FILE)
        # a resumed run continues the file: drop rows written after the checkpoint by the interrupted run (in
        # the current encoding, whichever version wrote them)
        kept = [r for r in read_jsonl(self.metrics_path, tolerant=True) if r.get("step", 0) <= start_step]
        _rewrite_jsonl(self.metrics_path, kept)
        self._metrics = open(self.metrics_path, "a", encoding="utf-8")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"), purge_step=start_step + 1)
            except ImportError:  # a dependency, so a broken install: say so, metrics.jsonl has the same data
                print(
                    "fused-stable sft: note: tensorboard is not installed, so no TensorBoard events are written "
                    "(pip install tensorboard, or --tensorboard false)",
                    file=sys.stderr,
                )
                self.tb = None
        self.wandb = start_wandb(output_dir, wandb_config) if wandb_config is not None else None
        self.console = Console(file=sys.stdout)
        self.progress = Progress(
            TextColumn("[bold]sft"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
        )
        self.task = self.progress.add_task("sft", total=total_steps, completed=start_step, stats="")
        self.progress.start()

    def log(self, rows: list[dict]) -> None:
        """One JSON line per optimizer step, TensorBoard scalars, and the progress display."""
        for row in rows:
            self._metrics.write(strict_json.dumps(row) + "\n")
            if self.tb is not None:
                for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
                    if math.isfinite(row[key]):
                        self.tb.add_scalar(f"train/{key}", row[key], row["step"])
                self.tb.add_scalar("train/skipped_total", row["skipped_total"], row["step"])
            if self.wandb is not None:
                self.wandb.log(wandb_row(row, self.max_grad_norm), step=row["step"])
        self._metrics.flush()
        last = rows[-1]
        self.progress.update(self.task, completed=last["step"], stats=_fmt(last))
        if not self.console.is_terminal:  # logs and CI: a plain line per logging step instead of a live bar
            print(f"step {last['step']}/{self.total_steps} | {_fmt(last)} | {last['elapsed_s']:.1f}s", flush=True)

    def evaluation(self, step: int, values: dict, seconds: float) -> None:
        """An evaluation's held-out losses (also on the metrics row of `step`, when there is one): a console line
        and TensorBoard `eval/loss`, `eval/retention_loss`."""
        shown = " | ".join(f"{k} {v:.4f}" for k, v in values.items())
        self.message(f"evaluation at step {step} ({seconds:.1f}s): {shown}")
        if self.tb is not None:
            for key, value in values.items():
                if key in EVAL_FIELDS and math.isfinite(value):
                    self.tb.add_scalar(EVAL_FIELDS[key][0], value, step)
        if self.wandb is not None and step == 0:  # later evaluations reach wandb on their step's metrics row
            self.wandb.log({EVAL_FIELDS[k][0]: v for k, v in values.items() if k in EVAL_FIELDS and _finite(v)}, step=0)

    def alerts(self, alerts: list) -> None:
        """Stability-guard alerts (fused_stable.guard.Alert): a console line each and TensorBoard events."""
        for alert in alerts:
            self.message(alert.describe())
            if self.tb is not None:
                if math.isfinite(alert.value):
                    self.tb.add_scalar(f"guard/{alert.kind}", alert.value, alert.step)
                self.tb.add_text("guard/alerts", alert.describe(), alert.step)
            if self.wandb is not None and math.isfinite(alert.value):
                self.wandb.log({f"guard/{alert.kind}": alert.value}, step=alert.step)

    def rewind(self, step: int) -> None:
        """After a rollback to `step`: metrics.jsonl keeps the trajectory the model actually has (rows up to
        `step`); what happened after it stays on record in alerts.jsonl."""
        self._metrics.close()
        _rewrite_jsonl(self.metrics_path, [r for r in read_jsonl(self.metrics_path) if r["step"] <= step])
        self._metrics = open(self.metrics_path, "a", encoding="utf-8")
        self.progress.update(self.task, completed=step)

    def message(self, text: str) -> None:
        self.progress.console.print(text) if self.console.is_terminal else print(text, flush=True)

    def close(self) -> None:
        self.progress.stop()
        self._metrics.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


# the names the HF Trainer logs under (its `train/` prefix and `learning_rate`), so dashboards built for HF
# runs read ours; what the Trainer has no name for is under fused_stable/
WANDB_NAMES = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/learning_rate"}


def wandb_row(row: dict, max_grad_norm: float | None) -> dict:
    """One metrics row as wandb values: the HF Trainer's names, then clipping, skips and throughput."""
    values = {name: row[key] for key, name in WANDB_NAMES.items() if math.isfinite(row[key])}
    if max_grad_norm and math.isfinite(row["grad_norm"]):
        values["fused_stable/clipped"] = int(row["grad_norm"] > max_grad_norm)
    values["fused_stable/skipped"] = int(row["skipped"])
    values["fused_stable/skipped_total"] = row["skipped_total"]
    if math.isfinite(row["tokens_per_s"]):
        values["fused_stable/tokens_per_s"] = row["tokens_per_s"]
    # an evaluated step's held-out losses, under the HF Trainer's eval/ names
    values.update({name: row[key] for key, (name, _) in EVAL_FIELDS.items() if _finite(row.get(key))})
    return values


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


def start_wandb(output_dir: str, config: dict):
    """A wandb run writing under output_dir/wandb: offline unless WANDB_MODE says otherwise (this trainer runs
    without a network; `wandb sync output_dir/wandb/offline-run-*` uploads it later)."""
    import wandb

    os.makedirs(os.path.join(output_dir, "wandb"), exist_ok=True)  # wandb writes output_dir/wandb/<run>
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "fused-stable"),
        name=os.path.basename(os.path.abspath(output_dir)),
        dir=output_dir,
        config=config,
        mode=os.environ.get("WANDB_MODE", "offline"),
        reinit=True,
    )


def evaluation_summary(rows: list[dict], start: dict | None = None) -> str | None:
    """One line per evaluated loss for the end of a run: its value before the first step (`start`), at the
    last evaluation, and its best (lowest) with the step; None when nothing was evaluated."""
    lines = []
    for key in EVAL_FIELDS:
        points = [(0, start[key])] if start and key in start else []
        points += [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if not points:
            continue
        finite = [p for p in points if math.isfinite(p[1])]
        best = min(finite, key=lambda p: p[1]) if finite else points[-1]
        first, last = points[0], points[-1]
        lines.append(
            f"{key} {first[1]:.4f} (step {first[0]}) -> {last[1]:.4f} (step {last[0]}), best {best[1]:.4f} "
            f"(step {best[0]}), {len(points)} evaluations"
        )
    return "\n".join(lines) or None


def plot_curves(
    output_dir: str, max_grad_norm: float | None, note: str | None = None, eval_start: dict | None = None
) -> str | None:
    """curves.png from metrics.jsonl (and alerts.jsonl, if a guard wrote one); `note` (the before/after
    evaluation table) is written in its own panel under the curves, so it hides none of them; `eval_start`:
    the evaluations' values before the first step, the first points of their lines."""
    rows = read_metrics(output_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = os.path.basename(os.path.abspath(output_dir))
    fig = curves_figure(rows, read_alerts(output_dir), max_grad_norm, note, name, eval_start)
    path = os.path.join(output_dir, CURVES_FILE)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def drawable(text: str) -> bool:
    """Whether matplotlib's default font has a glyph for every character of `text` (a CJK folder name would
    be drawn as empty boxes, with a warning per missing glyph)."""
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    font = FT2Font(font_manager.findfont(font_manager.FontProperties()))
    return all(font.get_char_index(ord(c)) != 0 for c in text if not c.isspace())


def curves_figure(
    rows: list[dict],
    alerts: list[dict],
    max_grad_norm: float | None,
    note: str | None,
    name: str,
    eval_start: dict | None = None,
):
    """The figure of curves.png: loss, grad norm and lr panels; the note, if any, in a panel of its own."""
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    skipped = [r["step"] for r in rows if r["skipped"]]
    panels = 4 if note else 3
    heights = [3, 3, 3, 0.25 * (note.count("\n") + 2)] if note else [3, 3, 3]
    fig, axes = plt.subplots(
        panels, 1, figsize=(9, 9 + (heights[-1] if note else 0)), gridspec_kw={"height_ratios": heights}
    )
    ax_loss, ax_norm, ax_lr = axes[:3]
    for ax in (ax_norm, ax_lr):
        ax.sharex(ax_loss)
    ax_loss.plot(steps, [r["loss"] for r in rows], lw=1.2, color="tab:blue", label="train loss")
    for (key, (_, label)), color in zip(EVAL_FIELDS.items(), ("tab:red", "tab:brown")):
        points = [(0, eval_start[key])] if eval_start and key in eval_start else []
        points += [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            ys = [v if math.isfinite(v) else float("nan") for _, v in points]
            ax_loss.plot([p[0] for p in points], ys, marker="o", ms=3, lw=1.2, color=color, label=label)
    ax_loss.set_ylabel("loss (per token)")
    # a name the font cannot draw is left out rather than drawn as empty boxes
    title = f"{name}: " if drawable(name) else ""
    ax_loss.set_title(f"{title}{len(rows)} optimizer steps")
    if note:
        axes[3].axis("off")
        axes[3].text(0.0, 1.0, note, transform=axes[3].transAxes, family="monospace", fontsize=8, va="top")
    ax_norm.plot(
        steps,
        [r["grad_norm"] if math.isfinite(r["grad_norm"]) else float("nan") for r in rows],
        lw=1.0,
        color="tab:orange",
        label="grad norm (before clipping)",
    )
    if max_grad_norm:
        ax_norm.axhline(max_grad_norm, color="black", ls="--", lw=1, label=f"clip threshold {max_grad_norm:g}")
    ax_norm.set_yscale("log")
    ax_norm.set_ylabel("global grad L2 norm")
    ax_lr.plot(steps, [r["lr"] for r in rows], lw=1.2, color="tab:green", label="learning rate")
    ax_lr.set_ylabel("lr")
    ax_lr.set_xlabel("optimizer step")
    for ax in (ax_loss, ax_norm, ax_lr):
        for i, step in enumerate(skipped):
            ax.axvline(
                step, color="red", alpha=0.5, lw=1, label="skipped step (non-finite or spike)" if i == 0 else None
            )
        for i, alert in enumerate(alerts):
            ax.axvline(alert["step"], color="purple", ls=":", lw=1.5, label="guard alert" if i == 0 else None)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


class QuietReporter:
    """Stands in for `Reporter` on torchrun ranks other than 0: they write no metrics and print nothing (the same
    methods as Reporter's, a test keeps them so)."""

    def log(self, rows: list[dict]) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def alerts(self, alerts: list) -> None:
        pass

    def evaluation(self, step: int, values: dict, seconds: float) -> None:
        pass

    def rewind(self, step: int) -> None:
        pass
