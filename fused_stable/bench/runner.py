"""Runs the benchmark plan: one row per (parameter set, contender), each on fresh tensors, then freed.

`measure_row` is the whole measurement of one row; the parent process calls it directly, and the worker process
(`python -m fused_stable.bench.worker`) calls it for contenders that must be time-boxed (torch.compile).
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from . import measure
from .contenders import CONTENDERS, Contender, baseline_for, contenders_for
from .paramsets import ParamSetSpec, materialize, tensor_bytes


@dataclass
class Options:
    device: str = "cpu"
    warmup: int = 3
    min_steps: int = 10
    min_time: float = 1.0          # seconds of timed steps per row (more steps for fast rows)
    max_steps: int = 500
    input_sets: int = 3
    compile_sets: tuple = ()       # set names on which torch.compile runs
    compile_timeout: float = 120.0
    threads: int = 0               # 0: torch's default
    seed: int = 0
    profile: bool = True           # CUDA launches/syncs via torch.profiler
    contenders: tuple = ()         # restrict to these contender keys (empty: all)
    extra: dict = field(default_factory=dict)


def _row_base(spec: ParamSetSpec, contender: Contender) -> dict:
    return {"set": spec.name, "family": spec.family, "dtype": spec.dtype, "n_tensors": spec.n_tensors,
            "n_params": spec.n_params, "contender": contender.key, "label": contender.label,
            "status": "ok", "reason": ""}


def measure_row(spec: ParamSetSpec, contender: Contender, opts: Options, copy_bw: float) -> dict:
    """Materialise the set (several copies if small), build the contender on each, and measure."""
    device = torch.device(opts.device)
    row = _row_base(spec, contender)
    one_set = spec.n_params * torch.tensor([], dtype=_dtype(spec)).element_size() * 4  # p, g, m, v
    n_sets = opts.input_sets if one_set <= measure.SMALL_SET_BYTES else 1
    if contender.isolated:
        n_sets = 1   # a compiled step is specialised to its tensors: every extra input set would compile again
    sets = [materialize(spec, device, seed=opts.seed + i) for i in range(max(1, n_sets))]
    built = []
    try:
        t0 = time.perf_counter()
        built = [contender.build(params, device) for params in sets]
        built[0].step()      # first step: lazy state allocation, and compilation for torch.compile
        measure.synchronize(device)
        row["first_step_s"] = time.perf_counter() - t0
        for b in built[1:]:
            b.step()
        timing = measure.time_steps([b.step for b in built], device, warmup=opts.warmup,
                                    min_steps=opts.min_steps, min_time=opts.min_time, max_steps=opts.max_steps)
        row.update(timing)
        row["input_sets"] = len(sets)
        row["backend"] = built[0].backend
        nbytes = measure.bytes_per_step(contender.passes, sets[0], built[0].optimizer)
        row["bytes_per_step"] = nbytes
        row["bytes_per_param"] = nbytes / spec.n_params
        row["gbps"] = nbytes / timing["median_s"] / 1e9
        row["pct_copy_bw"] = 100.0 * nbytes / timing["median_s"] / copy_bw if copy_bw else None
        resident = (tensor_bytes(sets[0]) + tensor_bytes([p.grad for p in sets[0]])
                    + measure.state_bytes(built[0].optimizer, sets[0]))
        extra = measure.step_extra_memory(built[0].step, device)
        row["resident_bytes"] = resident
        row["step_extra_bytes"] = extra
        row["peak_mem_bytes"] = resident + extra
        if device.type == "cuda" and opts.profile:
            row.update(measure.count_launches_and_syncs(built[0].step, device))
        else:
            row.update({"launches_per_step": None, "syncs_per_step": None, "top_kernels": []})
    finally:
        del built, sets
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _dtype(spec: ParamSetSpec):
    from .paramsets import DTYPES
    return DTYPES[spec.dtype]


def _skip(spec, contender, reason, status="skipped") -> dict:
    row = _row_base(spec, contender)
    row.update(status=status, reason=reason)
    return row


def _run_isolated(spec: ParamSetSpec, contender: Contender, opts: Options, copy_bw: float,
                  timeout: float) -> dict:
    """Run one row in a worker process with a hard time limit (torch.compile can take minutes, or hang)."""
    job = {"spec": spec.to_json(), "contender": contender.key, "opts": asdict(opts), "copy_bw": copy_bw}
    cmd = [sys.executable, "-m", "fused_stable.bench.worker", json.dumps(job)]
    # Own session, so a timeout can kill the worker together with inductor's compile subprocesses.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return _skip(spec, contender, f"exceeded its {timeout:.0f} s time box (compile + warm-up + timing)")
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (err.strip().splitlines() or ["no output"])[-1]
    # Reported as skipped, not as a failure of the run: compilation is optional (no compiler, unsupported op...).
    return _skip(spec, contender, f"worker failed (exit code {proc.returncode}): {tail[:200]}")


def run_plan(sets: list[ParamSetSpec], opts: Options, copy_bw: float, *, deadline: float | None = None,
             on_row=None) -> list[dict]:
    """All rows of the plan, in order; `on_row(row)` is called after each (for progress and partial saves)."""
    device = torch.device(opts.device)
    rows = []
    for spec in sets:
        for contender in contenders_for(spec.family):
            if opts.contenders and contender.key not in opts.contenders:
                continue
            if deadline is not None and time.monotonic() > deadline:
                row = _skip(spec, contender, "the run's --deadline was reached before this row")
            elif (reason := contender.unavailable(device)) is not None:
                row = _skip(spec, contender, reason)
            elif contender.isolated and spec.name not in opts.compile_sets:
                row = _skip(spec, contender, "not in --compile-sets (compile-time budget)")
            else:
                try:
                    if contender.isolated:
                        timeout = opts.compile_timeout
                        if deadline is not None:
                            timeout = max(1.0, min(timeout, deadline - time.monotonic()))
                        row = _run_isolated(spec, contender, opts, copy_bw, timeout)
                    else:
                        row = measure_row(spec, contender, opts, copy_bw)
                except Exception as e:  # one broken contender must not lose the rest of the table
                    row = _skip(spec, contender, f"{type(e).__name__}: {e}"[:300], status="error")
                    row["traceback"] = traceback.format_exc(limit=6)
            rows.append(row)
            if on_row is not None:
                on_row(row)
    add_speedups(rows)
    return rows


def add_speedups(rows: list[dict]) -> None:
    """speedup = baseline median / row median, within each parameter set."""
    by_set: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_set.setdefault(r["set"], {})[r["contender"]] = r
    for name, group in by_set.items():
        family = next(iter(group.values()))["family"]
        base = group.get(baseline_for(family))
        for r in group.values():
            ok = r["status"] == "ok" and base is not None and base["status"] == "ok"
            r["baseline"] = baseline_for(family)
            r["speedup"] = base["median_s"] / r["median_s"] if ok else None
            r["time_ratio"] = r["median_s"] / base["median_s"] if ok else None


def contender_by_key(key: str) -> Contender:
    return CONTENDERS[key]
