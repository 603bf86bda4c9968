"""What a stress suite reports: the verdict on each run (`judge`), the markdown table, stress.png (loss curves,
usual vs guarded, one panel per scenario) and stress.json (config, scenarios, every run's result and losses,
environment).

A run "diverged" when its final loss (mean of the last FINAL_WINDOW steps) is not finite or is above twice the
clean run's of the same recipe; a run the guard stopped is reported as "stopped".
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Iterable
from dataclasses import asdict

import torch

from fused_stable import strict_json
from fused_stable.stress.runs import RunResult, Workload
from fused_stable.stress.scenarios import StressConfig


def judge(results: list[RunResult], other_data: Iterable[str] = ()) -> None:
    """Mark each run diverged (non-finite, or > 2x its recipe's clean final loss) unless the guard stopped it.
    The scenarios named in `other_data` end on other data than the clean run (`Scenario.ends_on_other_data`),
    so their loss is not compared with it (non-finite only; on a pretrained model the evaluation after the run
    says what it kept)."""
    other_data = set(other_data)
    clean = {r.recipe: r.final_loss for r in results if r.scenario == "clean"}
    for r in results:
        if r.status == "stopped":
            continue
        reference = None if r.scenario in other_data else clean.get(r.recipe)
        bad = not math.isfinite(r.final_loss) or (reference is not None and r.final_loss > 2.0 * reference)
        r.status = "diverged" if bad else "ok"


def format_table(results: list[RunResult], before: dict | None = None, start_losses: dict | None = None) -> str:
    """The markdown table; with a pretrained model's evaluation, `general` and task accuracy after each run
    (and the base model's in the first line); with held-out losses, eval and retention loss after each run
    (the start's in the first line) and, in the alerts column, how many of the alerts were evaluation rises."""
    evaluated = any(r.general_after is not None for r in results)
    measured = any(r.eval_loss_after is not None or r.retention_loss_after is not None for r in results)
    header = "| scenario | recipe | outcome | final loss |"
    if evaluated:
        header += " general after | task after |"
    if measured:
        header += " eval loss after | retention loss after |"
    header += " skipped steps | rollbacks (steps undone) | alerts | wall time |"
    lines = [header, "|" + "---|" * (header.count(" | ") + 1)]
    if (evaluated and before is not None) or (measured and start_losses is not None):
        line = "| base model | - | - | - |"
        if evaluated:
            general, task = (before["general"]["accuracy"], before["identity"]["accuracy"]) if before else (None, None)
            line += f" {_accuracy(general)} | {_accuracy(task)} |"
        if measured:
            start = start_losses or {}
            line += f" {_accuracy(start.get('eval_loss'))} | {_accuracy(start.get('retention_loss'))} |"
        lines.append(line + " - | - | - | - |")
    for r in results:
        alerts = "-"
        if r.recipe == "guarded":
            alerts = f"{r.alerts} ({r.eval_alerts} eval)" if measured else str(r.alerts)
        rollbacks = f"{r.rolled_back} ({r.rolled_back_steps})" if r.recipe == "guarded" else "-"
        line = f"| {r.scenario} | {r.recipe} | {r.status} | {r.final_loss:.3f} |"
        if evaluated:
            line += f" {_accuracy(r.general_after)} | {_accuracy(r.task_after)} |"
        if measured:
            line += f" {_accuracy(r.eval_loss_after)} | {_accuracy(r.retention_loss_after)} |"
        lines.append(line + f" {r.skipped_steps} | {rollbacks} | {alerts} | {r.wall_s:.1f}s |")
    return "\n".join(lines)


def worst_rise(evals: list[dict], key: str) -> float | None:
    """The largest ratio of an evaluation's `key` to the lowest value before it (the guard's rise measure) over
    a run's evaluations: on a clean run, the noise a rise factor must clear."""
    best, worst = None, None
    for e in evals:
        value = e.get(key)
        if value is None or not math.isfinite(value):
            continue
        if best is not None and best > 0:
            worst = max(worst or 0.0, value / best)
        best = value if best is None else min(best, value)
    return worst


def _accuracy(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def plot(results: list[RunResult], path: str, usual: str = "torch AdamW", guarded: str = "FusedAdamW") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.scenario for r in results))
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for r in results:
            if r.scenario != name:
                continue
            ys = [v if math.isfinite(v) else float("nan") for v in r.losses]
            color = "tab:red" if r.recipe == "usual" else "tab:blue"
            label = f"{r.recipe}: {r.status}"
            if r.general_after is not None:
                label += f", general {r.general_after:.2f}, task {r.task_after:.2f}"
            ax.plot(range(1, len(ys) + 1), ys, lw=1.1, label=label, color=color)
            bad = next((i for i, v in enumerate(r.losses) if not math.isfinite(v)), None)
            if bad is not None and not math.isfinite(r.final_loss):  # NaN draws nothing: mark where the curve ends
                ax.axvline(bad + 1, color=color, ls="--", lw=1)
                ax.annotate(
                    f"{r.recipe}: loss non-finite from step {bad + 1}",
                    (bad + 1, 0.95),
                    xycoords=("data", "axes fraction"),
                    fontsize=8,
                    color=color,
                    ha="center",
                )
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes[0][0].set_ylabel("train loss (per token)")
    fig.suptitle(f"fused-stable stress: usual recipe ({usual} + clip 1.0) vs guarded ({guarded} + guard)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_json(
    path: str, cfg: StressConfig, known: dict, results: list[RunResult], work: Workload, wall_s: float, finished: bool
) -> None:
    """stress.json (written after every run, atomically: a suite cut short keeps what it measured), strict JSON
    in the encoding of `fused_stable.strict_json` (a non-finite loss is the string "NaN" or "Infinity")."""
    before = None
    rises = {
        f"{r.scenario}/{r.recipe}": {k: worst_rise(r.evals, k) for k in ("eval_loss", "retention_loss")}
        for r in results
        if r.evals
    }
    if work.before is not None:
        before = {
            "general_before": work.before["general"]["accuracy"],
            "task_before": work.before["identity"]["accuracy"],
            "general_n": work.before["general"]["n"],
            "task_n": work.before["identity"]["n"],
        }
    report = {
        "config": asdict(cfg),
        "finished": finished,
        "base_model": before,
        "start_losses": work.start_losses,
        "worst_eval_rise": rises,  # per guarded run: max over its evaluations of value / best before it
        "scenarios": {n: asdict(s) for n, s in known.items() if n in {r.scenario for r in results}},
        "results": [asdict(r) for r in results],
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": cfg.threads,
            "cpus": os.cpu_count(),
        },
        "total_wall_s": wall_s,
    }
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(strict_json.dumps(report, indent=1) + "\n")
    os.replace(tmp, path)
