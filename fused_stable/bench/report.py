"""Results of a benchmark run: the environment record, the goal checks, and the table (rich, markdown, JSON)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from pathlib import Path

import torch

from fused_stable import strict_json

from . import measure

# What the table says of a row that runs the exact tensor reference (bf16 / 8-bit state on CPU today).
EXACT_REFERENCE_NOTE = "exact reference (slow): no compiled CPU op for these tensors (non-contiguous, or no compiler)"
# Goals of issue 6. GPU goals apply to CUDA runs; the CPU bar is the core issue's bar for the torch path.
CPU_TIME_RATIO_BAR = 0.95


def _version(module: str) -> str:
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "unknown")
    except Exception as e:  # triton may be absent or fail to import on some machines
        return f"not importable ({type(e).__name__})"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_revision() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def load_average() -> list | None:
    """1/5/15-minute load: other work on the machine shows up in CPU timings, so it is recorded with them."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def environment(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
        runtime = f"CUDA {torch.version.cuda}"
    else:
        name = f"{cpu_name()} ({os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads)"
        runtime = "CPU"
    try:
        from importlib.metadata import version

        fs_version = version("fused_stable")
    except Exception:
        fs_version = "unknown"
    return {
        "device": name,
        "device_type": device.type,
        "runtime": runtime,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "bitsandbytes": _version("bitsandbytes"),
        "torchao": _version("torchao"),
        "fused_stable": fs_version,
        "git": _git_revision(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "load_average_start": load_average(),
    }


def _by(rows, set_name, contender):
    for r in rows:
        if r["set"] == set_name and r["contender"] == contender and r["status"] == "ok":
            return r
    return None


def spread_too_wide(row: dict, all_rows: list[dict]) -> str | None:
    """Why a goal read from `row` cannot be judged: its spread, or its baseline's (timed alongside it, else the
    set's baseline row), is too wide (measure.WIDE_SPREAD), or None."""
    if row.get("too_wide"):
        return f"{row['contender']} on {row['set']}: {_spread(row['q1_s'], row['median_s'], row['q3_s'])}"
    if row.get("paired_baseline_median_s") is not None:
        if row.get("paired_baseline_too_wide"):
            spread = _spread(row["paired_baseline_q1_s"], row["paired_baseline_median_s"], row["paired_baseline_q3_s"])
            return f"{row.get('baseline')} timed alongside {row['contender']} on {row['set']}: {spread}"
        return None
    base = _by(all_rows, row["set"], row.get("baseline"))
    if base is not None and base is not row and base.get("too_wide"):
        return f"{base['contender']} on {base['set']}: {_spread(base['q1_s'], base['median_s'], base['q3_s'])}"
    return None


def _spread(q1: float, median: float, q3: float) -> str:
    return f"median {median * 1e3:.3f} ms, q1 {q1 * 1e3:.3f}, q3 {q3 * 1e3:.3f}: spread too wide to judge"


def ratio_band(row: dict, all_rows: list[dict]) -> tuple[float, float] | None:
    """The time ratio to the baseline that the quartiles allow: row q1 / baseline q3 .. row q3 / baseline q1
    (the baseline timed alongside the row, else the set's baseline row)."""
    if row.get("paired_baseline_median_s") is not None:
        base_q1, base_q3 = row["paired_baseline_q1_s"], row["paired_baseline_q3_s"]
    else:
        base = _by(all_rows, row["set"], row.get("baseline"))
        if base is None:
            return None
        base_q1, base_q3 = base["q1_s"], base["q3_s"]
    if not (base_q1 > 0 and base_q3 > 0):
        return None
    return row["q1_s"] / base_q3, row["q3_s"] / base_q1


def rows_agree(a: dict, b: dict, rows_a: list[dict], rows_b: list[dict]) -> bool | None:
    """Whether two measurements of one row (alone and inside a plan, say) agree within the spread the bench
    reports: their time-ratio bands overlap (ratios, so a load that changed between the two runs, which slows
    a row and the baseline timed alongside it alike, does not count). None when either cannot be judged."""
    if spread_too_wide(a, rows_a) or spread_too_wide(b, rows_b):
        return None
    band_a, band_b = ratio_band(a, rows_a), ratio_band(b, rows_b)
    if band_a is None or band_b is None:
        return None
    return band_a[0] <= band_b[1] and band_b[0] <= band_a[1]


def _not_judged(name, set_name, value, target, why: str) -> dict:
    detail = f"not judged ({value:.3g} measured): {why}" if value is not None else f"not judged: {why}"
    return {"goal": name, "set": set_name, "value": value, "target": target, "passed": None, "detail": detail}


def _goal(name, set_name, value, target, higher_is_better, unit, why_missing="", *, rows=(), all_rows=(), band=None):
    """One goal's verdict; none (passed None) when a row it is read from has a spread too wide to judge, or when
    `band` (the value's range the quartiles allow) holds the target."""
    if value is not None:
        wide = next((w for r in rows if r is not None and (w := spread_too_wide(r, all_rows))), None)
        if wide:
            return _not_judged(name, set_name, value, target, wide)
        if band is not None and band[0] < target < band[1]:
            why = (
                f"the target {target:g}{unit} lies within the spread of the value ({band[0]:.3g}..{band[1]:.3g}{unit})"
            )
            return _not_judged(name, set_name, value, target, why)
    if value is None:
        return {
            "goal": name,
            "set": set_name,
            "value": None,
            "target": target,
            "passed": None,
            "detail": why_missing or "not measured",
        }
    passed = value >= target if higher_is_better else value <= target
    if passed:
        detail = f"met: {value:.3g}{unit} vs target {'>=' if higher_is_better else '<='} {target:g}{unit}"
    elif higher_is_better:
        detail = f"missed by {100 * (1 - value / target):.1f}%: {value:.3g}{unit}, needs >= {target:g}{unit}"
    else:
        detail = f"missed by {100 * (value / target - 1):.1f}%: {value:.3g}{unit}, needs <= {target:g}{unit}"
    return {"goal": name, "set": set_name, "value": value, "target": target, "passed": passed, "detail": detail}


def goals(rows: list[dict], device_type: str) -> list[dict]:
    """The issue's targets, checked against this run's rows (missing rows say why; a row whose spread is too
    wide to judge gives no verdict)."""
    return cpu_goals(rows) if device_type == "cpu" else gpu_goals(rows) + lowbit_goals(rows)


def cpu_goals(rows: list[dict]) -> list[dict]:
    """One goal per fused_stable row: its time <= CPU_TIME_RATIO_BAR x the baseline's, judged only when the
    ratio's whole band (its quartiles over the baseline's) is on one side of the bar."""
    return [
        _goal(
            f"CPU: {r['contender']} time <= {CPU_TIME_RATIO_BAR}x {r['baseline']}",
            r["set"],
            r.get("time_ratio"),
            CPU_TIME_RATIO_BAR,
            False,
            "x",
            rows=(r,),
            all_rows=rows,
            band=ratio_band(r, rows),
        )
        for r in rows
        if r["contender"] in ("fused_stable", "fused_stable_scaler") and r["status"] == "ok"
    ]


def gpu_goals(rows: list[dict]) -> list[dict]:
    """Issue 6's GPU targets: dense fp32 against copy bandwidth, torch and torch.compile; LoRA; fp16 AMP."""
    out = []
    dense = _by(rows, "dense-fp32", "fused_stable")
    judged = dict(all_rows=rows)
    if dense is not None and dense["n_params"] < 100_000_000:
        why = f"set has only {dense['n_params']:,} params"
        out.append(_goal("dense fp32 (>=100M params)", "dense-fp32", None, 0, True, "", why))
    else:
        value = dense and dense.get("pct_copy_bw")
        out.append(_goal("dense fp32: >= 90% of copy bandwidth", "dense-fp32", value, 90.0, True, "%", rows=(dense,)))
        value = dense and dense.get("speedup")
        name = "dense fp32: >= 1.2x torch fused + foreach clip"
        out.append(_goal(name, "dense-fp32", value, 1.2, True, "x", rows=(dense,), **judged))
        comp = _by(rows, "dense-fp32", "torch_compile")
        # both speedups are against a baseline timed alongside them, so their ratio compares like with like
        ratio = (
            dense["speedup"] / comp["speedup"] if (dense and comp and dense["speedup"] and comp["speedup"]) else None
        )
        why = "torch.compile row was skipped" if dense else ""
        name = "dense fp32: not slower than torch.compile"
        out.append(_goal(name, "dense-fp32", ratio, 1.0, True, "x", why, rows=(dense, comp), **judged))
    lora = _by(rows, "lora-fp32", "fused_stable")
    name = "LoRA (400+ tensors): >= 3x torch fused + foreach clip"
    out.append(_goal(name, "lora-fp32", lora and lora.get("speedup"), 3.0, True, "x", rows=(lora,), **judged))
    amp = _by(rows, "amp-fp16", "fused_stable_scaler")
    name = "fp16 GradScaler path: >= 1.5x torch's recipe"
    out.append(_goal(name, "amp-fp16", amp and amp.get("speedup"), 1.5, True, "x", rows=(amp,), **judged))
    return out


def lowbit_goals(rows: list[dict]) -> list[dict]:
    """Issue 22's GPU targets for 8-bit state: against fused_stable's own fp32 mode and torch's recipe on the dense
    fp32 set, its byte model's share of copy bandwidth, and bitsandbytes' AdamW8bit on the LoRA set (ratios of
    speedups against the same baseline timed alongside, so like is compared with like)."""

    def ratio(a, b):
        return a["speedup"] / b["speedup"] if (a and b and a.get("speedup") and b.get("speedup")) else None

    dense8, dense = _by(rows, "dense-fp32", "fused_stable_8bit"), _by(rows, "dense-fp32", "fused_stable")
    lora8, bnb = _by(rows, "lora-fp32", "fused_stable_8bit"), _by(rows, "lora-fp32", "bnb_8bit")
    return [
        _goal(
            "8-bit state, dense fp32: >= 1.5x fused_stable fp32 state",
            "dense-fp32",
            ratio(dense8, dense),
            1.5,
            True,
            "x",
            rows=(dense8, dense),
            all_rows=rows,
        ),
        _goal(
            "8-bit state, dense fp32: >= 2x torch fused + foreach clip",
            "dense-fp32",
            dense8 and dense8.get("speedup"),
            2.0,
            True,
            "x",
            rows=(dense8,),
            all_rows=rows,
        ),
        _goal(
            "8-bit state, dense fp32: >= 90% of copy bandwidth",
            "dense-fp32",
            dense8 and dense8.get("pct_copy_bw"),
            90.0,
            True,
            "%",
            rows=(dense8,),
        ),
        _goal(
            "8-bit state, LoRA: >= 3x bitsandbytes AdamW8bit + torch clip",
            "lora-fp32",
            ratio(lora8, bnb),
            3.0,
            True,
            "x",
            "no bnb_8bit or fused_stable_8bit row on lora-fp32 (bitsandbytes absent, or not a CUDA run)",
            rows=(lora8, bnb),
            all_rows=rows,
        ),
    ]


# ---- formatting -------------------------------------------------------------------------------------------

COLUMNS = [
    "set",
    "contender",
    "median ms",
    "q1..q3 ms",
    "steps",
    "speedup",
    "B/param",
    "state B/param",
    "GB/s",
    "% copy BW",
    "launches",
    "syncs",
    "peak MiB",
    "host ms",
    "notes",
]


def _f(x, fmt):
    return "n/a" if x is None else format(x, fmt)


def set_cell(r: dict) -> str:
    return f"{r['set']} ({r['n_params'] / 1e6:.3g}M, {r['n_tensors']} t)"


def row_cells(r: dict, name: str | None = None) -> list[str]:
    name = set_cell(r) if name is None else name
    if r["status"] != "ok":
        return [name, r["contender"]] + ["-"] * (len(COLUMNS) - 3) + [f"{r['status']}: {r['reason']}"]
    notes = []
    if r.get("backend"):
        notes.append(r["backend"])
    if r.get("exact_reference"):
        notes.append(EXACT_REFERENCE_NOTE)
    if r.get("too_wide"):
        notes.append(f"spread too wide to judge (q1..q3 over {100 * measure.WIDE_SPREAD:.0f}% of the median)")
    # (a row whose one step fills the warm-up budget never tries to settle: nothing to say)
    if r.get("warmup_settled") is False and r.get("warmup_steps", 0) >= measure.SETTLE_WINDOW:
        notes.append(f"warm-up did not settle in {r['warmup_steps']} step(s)")
    if r["contender"] == "torch_compile":
        notes.append(f"first step {r['first_step_s']:.1f} s")
    if r.get("paired_baseline_median_s"):
        notes.append(f"vs baseline re-timed alongside: {r['paired_baseline_median_s'] * 1e3:.3f} ms")
    if r["contender"] == r.get("baseline"):
        notes.append("baseline")
    return [
        name,
        r["contender"],
        f"{r['median_s'] * 1e3:.3f}",
        f"{r['q1_s'] * 1e3:.3f}..{r['q3_s'] * 1e3:.3f}",
        str(r["steps"]),
        _f(r.get("speedup"), ".2f") + ("x" if r.get("speedup") is not None else ""),
        f"{r['bytes_per_param']:.1f}",
        _f(r.get("state_bytes_per_param"), ".2f"),
        f"{r['gbps']:.1f}",
        _f(r.get("pct_copy_bw"), ".0f"),
        _f(r.get("launches_per_step"), ".1f"),
        _f(r.get("syncs_per_step"), ".1f"),
        f"{r['peak_mem_bytes'] / 2**20:.0f}",
        f"{r['host_cpu_s'] * 1e3:.2f}",
        ", ".join(notes),
    ]


def print_table(console, result: dict) -> None:
    from rich.table import Table

    env = result["environment"]
    title = (
        f"fused_stable bench: {env['device']}, torch {env['torch']}, triton {env['triton']}, "
        f"copy BW {result['copy_bandwidth_gbps']:.1f} GB/s, {env['date']}"
    )
    table = Table(title=title, show_lines=False)
    for col in COLUMNS:
        table.add_column(
            col,
            justify="left" if col in ("set", "contender", "notes") else "right",
            no_wrap=col != "notes",
            overflow="fold",
        )
    previous = None
    for r in result["rows"]:
        first = r["set"] != previous
        if first and previous is not None:
            table.add_section()
        previous = r["set"]
        table.add_row(*row_cells(r, set_cell(r) if first else ""))
    console.print(table)
    for g in result["goals"]:
        mark = {True: "PASS", False: "MISS", None: "n/a "}[g["passed"]]
        console.print(f"  [{mark}] {g['goal']} ({g['set']}): {g['detail']}", markup=False)


def _set_copy_bw(result: dict) -> dict:
    """Copy bandwidth each set's rows were compared with (the first ok row of the set carries it)."""
    out: dict[str, float] = {}
    for r in result["rows"]:
        if r["status"] == "ok" and r.get("copy_bw_gbps") and r["set"] not in out:
            out[r["set"]] = r["copy_bw_gbps"]
    return out


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        f"# fused_stable benchmark: {env['device']}",
        "",
        f"- date: {env['date']}",
        f"- device: {env['device']} ({env['runtime']})",
        f"- torch {env['torch']}, triton {env['triton']}, fused_stable {env['fused_stable']} "
        f"(git {env['git']}), python {env['python']}",
        f"- platform: {env['platform']}, torch threads: {env['torch_threads']}, "
        f"load average at start: {env['load_average_start']}, at end: {env.get('load_average_end')}",
        f"- copy bandwidth (read + write of a {result['copy_bytes'] / 2**20:.0f} MiB copy): "
        f"{result['copy_bandwidth_gbps']:.1f} GB/s at the start of the run; `% copy BW` uses the copy timed in "
        "rotation with each set's steps (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in _set_copy_bw(result).items()),
        f"- command: `{result['command']}`",
        f"- plan: {result['plan']}; step: global-norm clip at 1.0 + AdamW (lr 1e-3, wd 0.01); timing: "
        + (
            "CUDA events per step, L2 flushed between steps"
            if env["device_type"] == "cuda"
            else "time.perf_counter per step"
        )
        + ", after a warm-up that runs until the step time settles, rotating input sets when a set is < 256 MiB; "
        + (
            "each row in a fresh worker process, timed interleaved with the set's baseline"
            if result["options"].get("isolation") == "row"
            else "a set's contenders interleaved in one process"
        ),
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for r in result["rows"]:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row_cells(r)) + " |")
    lines += [
        "",
        "speedup: torch baseline median / row median (baseline: `torch_fused` = clip_grad_norm_"
        "(foreach=True) + AdamW(fused=True); `torch_scaler` for the fp16 AMP set). "
        "B/param: bytes model (docs/benchmarks.md). state B/param: the optimizer's per-element state (moments in "
        "their format with 8-bit scales, master weights), per param. launches, syncs: per step (CUDA only). "
        "peak MiB: params + grads + optimizer state + the step's transient allocations. "
        "host ms: CPU time of the process during the step call. q1..q3: the quartiles of the timed steps; a row "
        f"whose q3 - q1 is over {100 * measure.WIDE_SPREAD:.0f}% of its median is too wide to judge, and a goal "
        "read from it, or whose target lies between the ratio's quartile bounds, gets no verdict (n/a).",
        "",
        "## Goals",
        "",
    ]
    lines += ["| goal | set | result |", "|---|---|---|"]
    for g in result["goals"]:
        mark = {True: "met", False: "**missed**", None: "n/a"}[g["passed"]]
        lines.append(f"| {g['goal']} | {g['set']} | {mark}: {g['detail']} |")
    lines += ["", "## Parameter sets", ""]
    for s in result["sets"]:
        lines.append(f"- `{s['name']}`: {s['description']} ({s['n_tensors']} tensors, {s['n_params']:,} params)")
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir: Path, stem: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    # strict JSON in the encoding of every output file (fused_stable.strict_json): a NaN time is "NaN"
    json_path.write_text(strict_json.dumps(result, indent=1, default=str) + "\n")
    md_path.write_text(markdown(result))
    return json_path, md_path
