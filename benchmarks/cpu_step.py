"""The CPU optimizer step against torch's and DeepSpeed's (issue 28 item 4, issue 27 item 3's CPU figures).

Contenders, all doing the same math (global-norm clip at 1.0 + AdamW, lr 1e-3, weight decay 0.01):
  - fused_stable: `FusedAdamW(max_grad_norm=1.0).step()` (the torch backend: host decisions and the compiled CPU
    ops of fused_stable/backends/torch/cpu_ops.py, one norm call and one update call that reads the grads times the
    clip coefficient without writing them);
  - fused_stable_bf16, fused_stable_8bit: the same with `state_precision="bf16"` / `"8bit"` (the compiled update
    with low-precision state; fp32 params, so against torch_fused's fp32 state: issue 36 item 2);
  - fused_stable_torch_ops: the same as fused_stable with torch's ops instead of the compiled ones (`_foreach_norm`,
    `_fused_adamw_`: what a machine without a C++ compiler runs);
  - torch_fused: `clip_grad_norm_(foreach=True)` + `AdamW(fused=True)` (fused_stable.bench's baseline);
  - deepspeed_cpu_adam: torch's `clip_grad_norm_(foreach=True)` (the stand-in for DeepSpeed's clip, which is a
    norm pass plus a `mul_` pass over the grads too) + `DeepSpeedCPUAdam(adamw_mode=True)`, ZeRO-Offload's CPU
    optimizer (skipped, with the reason, when deepspeed is not installed or its op does not build).

Sets: the `fused-stable bench --plan cpu` LoRA set (448 tensors) and dense set, 32 equal tensors of 16M, 32M
and 64M params (issue 27's range), and two tiny sets whose step time is the fixed cost per step. Two grad
regimes: "unclipped" (global norm 0.5: the clip changes nothing) and "clipped" (norm 5 at the first step; the
clip then stays active every step: torch's clip leaves the clipped grads, at norm 1.0, in `.grad`; fused_stable
leaves them as they were, at norm 5).

Per set, regime and thread count, `--runs` runs; in each run the contenders take turns step by step
(fused_stable.bench.measure.time_steps), and the result is each contender's median step time and its ratio to
torch_fused's median of the same run. Bytes per param are the bytes model's (docs/benchmarks.md).

    nice -n 19 python benchmarks/cpu_step.py --runs 3 --threads 1,2 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from unittest import mock

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: its CPU accelerator

import torch

from fused_stable import FusedAdamW
from fused_stable.backends.torch import cpu_ops
from fused_stable.bench import measure
from fused_stable.bench.paramsets import plan_sets, sweep_shapes
from fused_stable.bench.report import cpu_name

LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 1e-2, 1.0
CONTENDERS = (
    "fused_stable",
    "fused_stable_bf16",
    "fused_stable_8bit",
    "fused_stable_torch_ops",
    "torch_fused",
    "deepspeed_cpu_adam",
)
# the state precision of the low-precision contenders (fused_stable itself: fp32 state)
PRECISIONS = {"fused_stable_bf16": "bf16", "fused_stable_8bit": "8bit"}
# bytes per fp32 param of one step, by the bytes model: norm read 4; update read p, g, m, v + write p, m, v 28;
# a clip pass (or torch's write of the unscaled grads when _fused_adamw_ gets grad_scale) 8 or 4
BYTES_PER_PARAM = {
    ("fused_stable", "unclipped"): 32,
    ("fused_stable", "clipped"): 32,  # the compiled update reads grad * clip coefficient, writes no grad
    # bf16 moments: update read p 4, g 4, m 2, v 2 + write p 4, m 2, v 2 = 20, with the norm 24
    ("fused_stable_bf16", "unclipped"): 24,
    ("fused_stable_bf16", "clipped"): 24,
    # 8-bit moments: codes 1 + 1 read and written, one fp32 scale per 128 codes each read and written (0.125):
    # 20.125 (tensors under 4096 elements keep fp32 moments: 32, a small share of the sets' params)
    ("fused_stable_8bit", "unclipped"): 20.125,
    ("fused_stable_8bit", "clipped"): 20.125,
    ("fused_stable_torch_ops", "unclipped"): 32,
    ("fused_stable_torch_ops", "clipped"): 36,  # torch's CPU _fused_adamw_ writes grad / grad_scale back
    ("torch_fused", "unclipped"): 40,
    ("torch_fused", "clipped"): 40,
    ("deepspeed_cpu_adam", "unclipped"): 40,
    ("deepspeed_cpu_adam", "clipped"): 40,
}
GRAD_NORMS = {"unclipped": 0.5, "clipped": 5.0}


@dataclass
class Case:
    name: str
    shapes: list
    steps: int  # timed steps per contender per run


def cases(selected: set[str] | None) -> list[Case]:
    by_name = {s.name: s for s in plan_sets("cpu")}
    out = [
        Case("tiny-1", [(8,)], 400),
        Case("tiny-6", [(64, 64)] * 6, 400),
        Case("lora-448", list(by_name["lora-fp32"].shapes), 15),
        Case("dense-21", list(by_name["dense-fp32"].shapes), 15),
        Case("sweep-16M", sweep_shapes(2**24), 15),
        Case("sweep-32M", sweep_shapes(2**25), 11),
        Case("sweep-64M", sweep_shapes(2**26), 7),
    ]
    return [c for c in out if selected is None or c.name in selected]


def materialize(shapes, grad_norm: float, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    n = sum(math.prod(s) for s in shapes)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).mul_(0.02))
        p.grad = torch.randn(shape, generator=gen).mul_(grad_norm / math.sqrt(n))
        params.append(p)
    return params


def deepspeed_unavailable() -> str | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
    except Exception as e:  # not installed, or its accelerator refuses
        return f"deepspeed not importable: {type(e).__name__}: {e}"[:200]
    return None


def build(contender: str, params):
    def clip():
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)

    if contender == "fused_stable" or contender in PRECISIONS:
        if not cpu_ops.available():
            raise SystemExit("the compiled CPU ops did not build here (see the warning above): nothing to measure")
        precision = PRECISIONS.get(contender, "fp32")
        opt = FusedAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_NORM, state_precision=precision)
        return opt.step
    if contender == "fused_stable_torch_ops":
        opt = FusedAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_NORM)
        # the backend picks its ops when it builds the step plan, at the first step: that one without the
        # compiled ops (the grads keep their addresses, so the plan stays)
        with mock.patch.object(cpu_ops, "available", lambda: False):
            opt.step()
        return opt.step
    if contender == "torch_fused":
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    else:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(params, lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True)

    def step():
        clip()
        opt.step()

    return step


def measure_case(case: Case, regime: str, contenders, threads: list[int], runs: int) -> list[dict]:
    sets = {c: materialize(case.shapes, GRAD_NORMS[regime], seed=1 + i) for i, c in enumerate(contenders)}
    steps = {c: build(c, sets[c]) for c in contenders}
    for step in steps.values():
        step()  # state allocation
    rows = []
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for run in range(runs):
            groups = [[steps[c]] for c in contenders]
            timings = measure.time_steps(
                groups,
                torch.device("cpu"),
                warmup=2,
                min_steps=case.steps,
                min_time=0.0,
                max_steps=case.steps,
                host=[False] * len(groups),
            )
            base = timings[contenders.index("torch_fused")]["median_s"]
            for c, t in zip(contenders, timings):
                rows.append(
                    dict(
                        set=case.name,
                        n_tensors=len(case.shapes),
                        n_params=sum(math.prod(s) for s in case.shapes),
                        regime=regime,
                        threads=n_threads,
                        run=run,
                        contender=c,
                        median_ms=t["median_s"] * 1e3,
                        iqr_ms=t["iqr_s"] * 1e3,
                        steps=t["steps"],
                        ratio_to_torch=t["median_s"] / base,
                        bytes_per_param=BYTES_PER_PARAM[(c, regime)],
                    )
                )
            ratios = "  ".join(
                f"{r['contender']} {r['median_ms']:.3f} ms ({r['ratio_to_torch']:.2f}x)"
                for r in rows[-len(contenders) :]
            )
            print(f"{case.name:<10} {regime:<9} {n_threads}t run {run}: {ratios}", flush=True)
    del steps, sets
    gc.collect()
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (set, regime, threads, contender): the runs' ratio range and median step time."""
    keys = sorted({(r["set"], r["regime"], r["threads"], r["contender"]) for r in rows}, key=str)
    out = []
    for key in keys:
        mine = [r for r in rows if (r["set"], r["regime"], r["threads"], r["contender"]) == key]
        ratios = [r["ratio_to_torch"] for r in mine]
        deepspeed = {
            r["run"]: r["median_ms"]
            for r in rows
            if (r["set"], r["regime"], r["threads"]) == key[:3] and r["contender"] == "deepspeed_cpu_adam"
        }
        vs_ds = [deepspeed[m["run"]] / m["median_ms"] for m in mine if m["run"] in deepspeed]
        out.append(
            dict(
                set=key[0],
                regime=key[1],
                threads=key[2],
                contender=key[3],
                median_ms=statistics.median(r["median_ms"] for r in mine),
                ratio_min=min(ratios),
                ratio_max=max(ratios),
                speedup_vs_deepspeed=(min(vs_ds), max(vs_ds)) if vs_ds else None,
                bytes_per_param=mine[0]["bytes_per_param"],
            )
        )
    return out


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        "# CPU optimizer step: fused_stable (fp32, bf16, 8-bit state) vs torch clip + AdamW(fused) vs "
        "DeepSpeedCPUAdam + clip",
        "",
        f"Command: `{result['command']}`; {env['cpu']} ({env['cores']} logical cores), torch {env['torch']}, "
        f"deepspeed {env['deepspeed']}; load average {env['load_start']} at the start, {env['load_end']} at the end; "
        f"{env['wall_s']} s. {result['note']}",
        "",
        "Ratio = the contender's median step time / torch_fused's median in the same interleaved run (range over "
        "the runs); vs DS = DeepSpeedCPUAdam + clip's median / fused_stable's (range over the runs).",
        "",
        "| set | regime | threads | contender | median ms | ratio to torch (runs) | vs DS | B/param |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in result["summary"]:
        vs = s["speedup_vs_deepspeed"]
        vs_text = f"{vs[0]:.2f}-{vs[1]:.2f}x" if vs and s["contender"] == "fused_stable" else ""
        lines.append(
            f"| {s['set']} | {s['regime']} | {s['threads']} | {s['contender']} | {s['median_ms']:.3f} | "
            f"{s['ratio_min']:.2f}-{s['ratio_max']:.2f}x | {vs_text} | {s['bytes_per_param']} |"
        )
    for reason in result["skipped"]:
        lines.append(f"\nSkipped: {reason}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument(
        "--sets", default="", help="comma-separated subset of: " + ", ".join(c.name for c in cases(None))
    )
    parser.add_argument("--regimes", default="unclipped,clipped")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--name", default="")
    parser.add_argument("--note", default="", help="a line for the header (e.g. how loaded the machine was)")
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in contenders if c not in CONTENDERS] or ([] if "torch_fused" in contenders else ["(none)"])
    if unknown:
        parser.error(f"--contenders: unknown {unknown}; choose from {CONTENDERS}, torch_fused included")
    skipped = []
    if "deepspeed_cpu_adam" in contenders:
        reason = deepspeed_unavailable()
        if reason:
            skipped.append(f"deepspeed_cpu_adam: {reason}")
            contenders.remove("deepspeed_cpu_adam")
    selected = {s for s in args.sets.split(",") if s} or None
    started = time.monotonic()
    load_start = os.getloadavg()[0]
    rows = []
    for case in cases(selected):
        for regime in args.regimes.split(","):
            rows += measure_case(case, regime, contenders, threads, args.runs)
    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except Exception:
        ds_version = "not installed"
    result = dict(
        command="python benchmarks/cpu_step.py " + " ".join(argv),
        note=args.note,
        environment=dict(
            cpu=cpu_name(),
            cores=os.cpu_count(),
            torch=torch.__version__,
            deepspeed=ds_version,
            load_start=round(load_start, 2),
            load_end=round(os.getloadavg()[0], 2),
            wall_s=round(time.monotonic() - started, 1),
            date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        ),
        rows=rows,
        summary=summary(rows),
        skipped=skipped,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or "cpu-step-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%MZ")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
