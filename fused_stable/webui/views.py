"""What the page shows of a run, as text and tables (no gradio here): the status lines, the plots' data
(loss, pre-clip grad norm with the clip threshold, lr) and the before/after evaluation."""

from __future__ import annotations

import math

import pandas as pd

from fused_stable.webui.runs import EXTRA_LOSSES, RunStatus

MAX_POINTS = 1000  # points per plotted series (a long run is thinned evenly)
ALERT_COLUMNS = ["step", "kind", "value", "threshold", "action", "detected_at"]


def fmt(value, spec: str = ".4g") -> str:
    return "-" if not isinstance(value, (int, float)) else format(value, spec)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    minutes = f"{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return f"{seconds // 3600}:{minutes}" if seconds >= 3600 else f"{seconds // 60}:{seconds % 60:02d}"


def _at(steps: list[int]) -> str:
    return f" (at {', '.join(map(str, steps))})" if steps else ""


def status_markdown(s: RunStatus | None) -> str:
    if s is None:
        return "No run in this workspace yet: set one up and press **Start**."
    total = s.max_steps or "?"
    percent = f" ({100 * s.step / s.max_steps:.0f}%)" if s.max_steps else ""
    clip = f" (clip at {s.max_grad_norm:g})" if s.max_grad_norm else " (no clipping)"
    lines = [
        f"### `{s.name}`: {s.state}" + (f" ({s.request} asked)" if s.request else ""),
        f"step **{s.step} / {total}**{percent} | elapsed {_duration(s.elapsed_s)} | ETA {_duration(s.eta_s)}",
        f"loss **{fmt(s.loss)}** | pre-clip grad norm **{fmt(s.grad_norm)}**{clip} | lr {fmt(s.lr, '.3g')} | "
        f"skipped steps {s.skipped_total}{_at(s.skipped_steps)} | rollbacks {s.rollbacks} | alerts {len(s.alerts)}",
    ]
    lines += [f"{key} **{fmt(value)}**" for key, value in s.extra.items()]
    if s.reason:
        lines.append(f"**{s.reason}**" + (" — **Resume** continues it from its checkpoint." if s.can_resume else ""))
    if s.command:
        lines.append(f"`{s.command}`")
    return "\n\n".join(lines)


def _thin(rows: list[dict]) -> list[dict]:
    stride = max(1, math.ceil(len(rows) / MAX_POINTS))
    return rows[::stride] if stride > 1 else rows


def plot_frames(rows: list[dict], max_grad_norm: float | None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(loss, grad norm with the clip threshold, lr) as long tables: step, value, series."""

    def frame(series: dict[str, list[tuple[int, float]]]) -> pd.DataFrame:
        points = [
            (step, value, name)
            for name, pts in series.items()
            for step, value in pts
            if isinstance(value, (int, float)) and math.isfinite(value)
        ]
        return pd.DataFrame(points, columns=["step", "value", "series"])

    train = _thin([r for r in rows if "grad_norm" in r])
    loss = {"train loss": [(r["step"], r.get("loss")) for r in train]}
    for key in EXTRA_LOSSES:
        loss[key] = [(r["step"], r[key]) for r in rows if key in r]
    norm = {"pre-clip grad norm": [(r["step"], r.get("grad_norm")) for r in train]}
    if max_grad_norm and train:
        norm[f"clip threshold {max_grad_norm:g}"] = [
            (train[0]["step"], max_grad_norm),
            (train[-1]["step"], max_grad_norm),
        ]
    lr = {"lr": [(r["step"], r.get("lr")) for r in train]}
    return frame(loss), frame(norm), frame(lr)


def eval_markdown(s: RunStatus | None) -> str:
    if s is None or not s.eval or not s.eval.get("before"):
        return "No eval.json (held-out evaluation runs on the identity task, or with `evaluation: on`)."
    lines = ["| held-out set | before | after |", "|---|---|---|"]
    for name, before in s.eval["before"].items():
        after = (s.eval.get("after") or {}).get(name, {})
        lines.append(f"| {name} | {fmt(before.get('accuracy'), '.2f')} | {fmt(after.get('accuracy'), '.2f')} |")
    return "\n".join(lines)


def alerts_frame(s: RunStatus | None) -> pd.DataFrame:
    return pd.DataFrame([[a.get(c) for c in ALERT_COLUMNS] for a in (s.alerts if s else [])], columns=ALERT_COLUMNS)
