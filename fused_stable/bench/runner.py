"""Runs the benchmark plan: one row per (parameter set, contender), on fresh tensors freed after each set.

`measure_group` measures some contenders of one set together, their steps interleaved. Two ways to run a plan
(`Options.isolation`):
  - "row" (the CPU plan's default): every row in a fresh worker process (`python -m fused_stable.bench.worker`),
    timed interleaved with the set's baseline only. A row's figures are then a function of its job alone, never
    of what ran before it: no allocator or page state left by the exact-reference rows (which allocate and
    page-fault 4-6x the set's memory every step), no first use of a compiled op inside another row's timing,
    no neighbour steps taking turns with it. The speedup compares it with the baseline timed alongside.
  - "none": the contenders of a set in this process, interleaved (the GPU plan: CUDA steps allocate nothing).
Time-boxed rows (torch.compile) always run in a worker.
"""

from __future__ import annotations

import gc
import hashlib
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from fused_stable import strict_json

from . import measure
from .contenders import Contender, baseline_for, contenders_for, runs_exact_reference
from .paramsets import DTYPES, ParamSetSpec, materialize, tensor_bytes


@dataclass
class Options:
    device: str = "cpu"
    warmup: int = 3
    min_steps: int = 10
    min_time: float = 1.0  # seconds of timed steps per row (more steps for fast rows)
    max_steps: int = 500
    input_sets: int = 3
    compile_sets: tuple = ()  # set names on which torch.compile runs
    compile_timeout: float = 120.0
    threads: int = 0  # 0: torch's default
    seed: int = 0
    profile: bool = True  # CUDA launches/syncs via torch.profiler
    contenders: tuple = ()  # restrict to these contender keys (empty: all)
    copy_bytes: int = 0  # > 0: time a copy of this size interleaved with each set's steps
    max_time: float | None = None  # seconds of timed steps per row at most (slow rows take fewer steps)
    isolation: str = "none"  # "row": each row in a fresh worker with the set's baseline; "none": in process
    row_timeout: float = 900.0  # hard limit (s) of one row's worker, compile rows excepted (compile_timeout)
    extra: dict = field(default_factory=dict)


def _row_base(spec: ParamSetSpec, contender: Contender) -> dict:
    return {
        "set": spec.name,
        "family": spec.family,
        "dtype": spec.dtype,
        "n_tensors": spec.n_tensors,
        "n_params": spec.n_params,
        "contender": contender.key,
        "label": contender.label,
        "status": "ok",
        "reason": "",
    }


@dataclass
class _Prepared:
    contender: Contender
    row: dict
    sets: list  # input sets: lists of params with grads
    built: list  # one Built per input set


def _prepare(spec: ParamSetSpec, contender: Contender, opts: Options, device: torch.device) -> _Prepared:
    """Materialise the set (several copies if small), build the contender on each, take the first steps."""
    row = _row_base(spec, contender)
    one_set = spec.n_params * torch.tensor([], dtype=DTYPES[spec.dtype]).element_size() * 4  # p, g, m, v
    n_sets = opts.input_sets if one_set <= measure.SMALL_SET_BYTES else 1
    if contender.isolated:
        n_sets = 1  # a compiled step is specialised to its tensors: every extra input set would compile again
    sets = [materialize(spec, device, seed=opts.seed + i) for i in range(max(1, n_sets))]

    def build_and_step():
        t0 = time.perf_counter()
        first = contender.build(sets[0], device)
        first.step()  # first step: lazy state allocation, and compilation for torch.compile
        measure.synchronize(device)
        row["first_step_s"] = time.perf_counter() - t0
        return first

    if contender.isolated:  # no allocator tracking around a compilation
        first, owned = build_and_step(), None
    else:
        first, owned = measure.net_allocation(build_and_step, device)
    row["optimizer_bytes"] = owned
    built = [first] + [contender.build(params, device) for params in sets[1:]]
    for b in built[1:]:
        b.step()
    row["input_sets"] = len(sets)
    row["backend"] = built[0].backend
    row["exact_reference"] = runs_exact_reference(built[0].optimizer)
    return _Prepared(contender, row, sets, built)


def _finish(
    spec: ParamSetSpec, prep: _Prepared, timing: dict, opts: Options, copy_bw: float, device: torch.device
) -> dict:
    """Add the bytes model, bandwidth, memory and (CUDA) launch and sync counts to a timed row."""
    row, params, built = prep.row, prep.sets[0], prep.built[0]
    row.update(timing)
    nbytes = measure.bytes_per_step(prep.contender.passes, params, built.optimizer)
    row["bytes_per_step"] = nbytes
    row["bytes_per_param"] = nbytes / spec.n_params
    row["state_bytes_per_param"] = measure.state_bytes(built.optimizer, params) / spec.n_params
    row["gbps"] = nbytes / timing["median_s"] / 1e9
    row["copy_bw_gbps"] = copy_bw / 1e9 if copy_bw else None
    row["pct_copy_bw"] = 100.0 * nbytes / timing["median_s"] / copy_bw if copy_bw else None
    # What the optimizer keeps allocated (measured when it was built and first stepped), else its state tensors
    owned = row.get("optimizer_bytes")
    if owned is None or owned < 0:
        owned = measure.state_bytes(built.optimizer, params)
    resident = tensor_bytes(params) + tensor_bytes([p.grad for p in params]) + owned
    extra = row["step_extra_bytes"]  # measured on the step after the first (_memory_step)
    row["resident_bytes"] = resident
    row["peak_mem_bytes"] = resident + extra
    if device.type == "cuda" and opts.profile:
        row.update(measure.count_launches_and_syncs(built.step, device))
    else:
        row.update({"launches_per_step": None, "syncs_per_step": None, "top_kernels": []})
    return row


def _error_row(spec, contender, e: Exception) -> dict:
    row = _skip(spec, contender, f"{type(e).__name__}: {e}"[:300], status="error")
    row["traceback"] = traceback.format_exc(limit=6)
    return row


def _memory_step(prep: _Prepared, device: torch.device) -> list[float]:
    """The step after the first, under allocator tracking: the step's transient memory, and the first warm-up
    step (its time, returned, counts toward the warm-up budget; the settled window never includes it)."""
    t0 = time.perf_counter()
    prep.row["step_extra_bytes"] = measure.step_extra_memory(prep.built[0].step, device)
    return [time.perf_counter() - t0]


def measure_group(spec: ParamSetSpec, contenders: list[Contender], opts: Options, copy_bw: float) -> list[dict]:
    """Measure several contenders on one parameter set, their timed steps interleaved (see measure.py).
    A contender that fails to build or step becomes an error row; the others are still measured."""
    device = torch.device(opts.device)
    rows: dict[str, dict] = {}
    prepared: list[_Prepared] = []
    try:
        done = []
        for c in contenders:
            try:
                prep = _prepare(spec, c, opts, device)
                done.append(_memory_step(prep, device))
                prepared.append(prep)
            except Exception as e:  # one broken contender must not lose the rest of the table
                rows[c.key] = _error_row(spec, c, e)
        if prepared:
            groups = [[b.step for b in p.built] for p in prepared]
            if opts.copy_bytes:
                # The copy-bandwidth reference is timed in the same rotation as the steps, so it sees the same
                # machine load; the run-level copy measured at the start is the fallback.
                src = torch.ones(opts.copy_bytes // 4, device=device)
                dst = torch.empty_like(src)
                groups.append([lambda: dst.copy_(src)])
            timings = measure.time_steps(
                groups,
                device,
                warmup=opts.warmup,
                min_steps=opts.min_steps,
                min_time=opts.min_time,
                max_steps=opts.max_steps,
                max_time=opts.max_time,
                host=[True] * len(prepared) + [False] * (len(groups) - len(prepared)),
                done=done + [[]] * (len(groups) - len(prepared)),
            )
            if opts.copy_bytes:
                copy_bw = 2 * (opts.copy_bytes // 4) * 4 / timings[-1]["median_s"]
                del src, dst
            for prep, timing in zip(prepared, timings):
                try:
                    rows[prep.contender.key] = _finish(spec, prep, timing, opts, copy_bw, device)
                except Exception as e:
                    rows[prep.contender.key] = _error_row(spec, prep.contender, e)
    finally:
        del prepared
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return [rows[c.key] for c in contenders]


def _skip(spec, contender, reason, status="skipped") -> dict:
    row = _row_base(spec, contender)
    row.update(status=status, reason=reason)
    return row


def worker_job(spec: ParamSetSpec, contender: Contender, opts: Options) -> dict:
    """What one worker measures: the set, the row's contender, the set's baseline timed alongside it (none for
    the baseline's own job) and the measurement options. Nothing about the rest of the plan is in it (the run's
    --contenders and --compile-sets filters are not), so a row alone and in the plan run the same job."""
    base = baseline_for(spec.family)
    measured = asdict(opts)
    measured.update(contenders=(), compile_sets=())
    return {
        "spec": spec.to_json(),
        "contender": contender.key,
        "pair_with": base if contender.key != base else None,
        "opts": measured,
    }


def job_digest(job: dict) -> str:
    """A short name of a worker job, kept with its rows: equal digests, equal measurement."""
    return hashlib.sha256(strict_json.dumps(job, sort_keys=True).encode()).hexdigest()[:12]


def _run_worker(spec: ParamSetSpec, contender: Contender, opts: Options, copy_bw: float, timeout: float) -> list:
    """One worker process for `contender`'s row, with a hard time limit: its rows ([baseline, row] when paired,
    else [row]). The set's baseline is timed in the worker, interleaved with the row, so the row's speedup does
    not compare two processes run at different moments of a shared machine's load."""
    job = worker_job(spec, contender, opts)
    cmd = [sys.executable, "-m", "fused_stable.bench.worker", strict_json.dumps({**job, "copy_bw": copy_bw})]
    # Own session, so a timeout can kill the worker together with inductor's compile subprocesses.
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    # A time-boxed row (torch.compile) that fails is skipped, not an error: compilation is optional.
    failed = "skipped" if contender.isolated else "error"
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        what = "(compile + warm-up + timing)" if contender.isolated else "(a row's worker)"
        return [_skip(spec, contender, f"exceeded its {timeout:.0f} s time box {what}", status=failed)]
    except BaseException:  # Ctrl-C: the worker's own session would outlive the run
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            rows = strict_json.loads(line[len("RESULT ") :])
            for row in rows:
                row["job"] = job_digest(job)
            rows[-1]["worker_wall_s"] = round(time.monotonic() - started, 2)  # what the row cost the run
            return rows
    tail = (err.strip().splitlines() or ["no output"])[-1]
    return [_skip(spec, contender, f"worker failed (exit code {proc.returncode}): {tail[:200]}", status=failed)]


class _Plan:
    """The rows of one run, emitted as they come (`on_row`), each checked for the deadline and availability
    when its turn comes."""

    def __init__(self, opts: Options, copy_bw: float, deadline: float | None, on_row) -> None:
        self.opts, self.copy_bw, self.deadline, self.on_row = opts, copy_bw, deadline, on_row
        self.device = torch.device(opts.device)
        self.rows: dict[tuple, dict] = {}

    def emit(self, spec: ParamSetSpec, row: dict) -> None:
        self.rows[(spec.name, row["contender"])] = row
        if self.on_row is not None:
            self.on_row(row)

    def runnable(self, spec: ParamSetSpec, contender: Contender) -> bool:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.emit(spec, _skip(spec, contender, "the run's --deadline was reached before this row"))
        elif (reason := contender.unavailable(self.device)) is not None:
            self.emit(spec, _skip(spec, contender, reason))
        elif contender.isolated and spec.name not in self.opts.compile_sets:
            self.emit(spec, _skip(spec, contender, "not in --compile-sets (compile-time budget)"))
        else:
            return True
        return False

    def in_worker(self, spec: ParamSetSpec, contender: Contender) -> list[dict]:
        timeout = self.opts.compile_timeout if contender.isolated else self.opts.row_timeout
        if self.deadline is not None:
            timeout = max(1.0, min(timeout, self.deadline - time.monotonic()))
        try:
            return _run_worker(spec, contender, self.opts, self.copy_bw, timeout)
        except Exception as e:
            return [_error_row(spec, contender, e)]

    def rows_in_workers(self, spec: ParamSetSpec, contenders: list[Contender]) -> None:
        """Each row in its own worker, paired with the baseline; the baseline's own row is the one timed in the
        first of those workers (in a worker of its own when it is the set's only row)."""
        base = baseline_for(spec.family)
        wants_base = any(c.key == base for c in contenders)
        for c in contenders:
            if c.key == base or not self.runnable(spec, c):
                continue
            rows = self.in_worker(spec, c)
            if wants_base and len(rows) == 2 and (spec.name, base) not in self.rows:
                self.emit(spec, rows[0])
            self.emit(spec, rows[-1])
        for c in contenders:
            if c.key == base and (spec.name, base) not in self.rows and self.runnable(spec, c):
                self.emit(spec, self.in_worker(spec, c)[-1])

    def rows_in_process(self, spec: ParamSetSpec, contenders: list[Contender]) -> None:
        group = [c for c in contenders if self.runnable(spec, c)]
        if group:
            for row in measure_group(spec, group, self.opts, self.copy_bw):
                self.emit(spec, row)


def run_plan(
    sets: list[ParamSetSpec], opts: Options, copy_bw: float, *, deadline: float | None = None, on_row=None
) -> list[dict]:
    """All rows of the plan, returned in plan order; `on_row(row)` is called after each (progress, partial saves).

    Rows run in fresh workers or in process, as `opts.isolation` says (module doc). Time-boxed rows
    (torch.compile) run after all the others, so a slow compile can only eat the time left at the end of the
    run, never the rows the goals are read from.
    """
    plan = _Plan(opts, copy_bw, deadline, on_row)
    jobs = [
        (spec, [c for c in contenders_for(spec.family) if not opts.contenders or c.key in opts.contenders])
        for spec in sets
    ]
    for spec, contenders in jobs:
        plain = [c for c in contenders if not c.isolated]
        if opts.isolation == "row":
            plan.rows_in_workers(spec, plain)
        else:
            plan.rows_in_process(spec, plain)
    for spec, contenders in jobs:
        for c in contenders:
            if c.isolated and plan.runnable(spec, c):
                plan.emit(spec, plan.in_worker(spec, c)[-1])
    ordered = [plan.rows[(spec.name, c.key)] for spec, contenders in jobs for c in contenders]
    add_speedups(ordered)
    return ordered


def add_speedups(rows: list[dict]) -> None:
    """speedup = baseline median / row median, within each parameter set; a time-boxed row is compared with
    the baseline timed alongside it in its worker."""
    by_set: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_set.setdefault(r["set"], {})[r["contender"]] = r
    for group in by_set.values():
        family = next(iter(group.values()))["family"]
        base = group.get(baseline_for(family))
        for r in group.values():
            r["baseline"] = baseline_for(family)
            if r.get("paired_baseline_median_s"):
                base_median = r["paired_baseline_median_s"]
            elif base is not None and base["status"] == "ok":
                base_median = base["median_s"]
            else:
                base_median = None
            ok = r["status"] == "ok" and base_median is not None
            r["speedup"] = base_median / r["median_s"] if ok else None
            r["time_ratio"] = r["median_s"] / base_median if ok else None
