"""`fused-stable bench`: parse options, measure the copy bandwidth, run the plan, print the table, write results."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import torch

from fused_stable.argcheck import (
    OneLineParser,
    check_file_name,
    check_writable,
    number,
    parse_command,
    resolve_device,
    suggestion,
)
from fused_stable.cli import offline_environment
from fused_stable.errors import UserError

from . import measure, report
from .contenders import CONTENDERS
from .paramsets import plan_sets
from .runner import Options, run_plan

# Per-plan defaults: warm-up steps (at least, within the --min-time budget; more until the step time settles),
# timed steps (at least / at most), seconds of timed steps per row (at least / at most: a row whose step takes
# seconds runs a few), compile sets and time box, copy size, and where rows run (runner.py: "row" = each in a
# fresh worker process with the set's baseline, "none" = a set's contenders in this process).
PLAN_DEFAULTS = {
    "cpu": dict(
        warmup=3,
        min_steps=15,
        min_time=1.0,
        max_time=6.0,
        max_steps=1000,
        compile_sets="dense-fp32",
        compile_timeout=120.0,
        copy_mib=256,
        isolation="row",
    ),
    "gpu": dict(
        warmup=10,
        min_steps=30,
        min_time=0.3,
        max_time=60.0,
        max_steps=500,
        compile_sets="dense-fp32,lora-fp32",
        compile_timeout=150.0,
        copy_mib=2048,
        isolation="none",
    ),
    "smoke": dict(
        warmup=1,
        min_steps=3,
        min_time=0.0,
        max_time=10.0,
        max_steps=3,
        compile_sets="",
        compile_timeout=60.0,
        copy_mib=8,
        isolation="none",
    ),
}


def load_warning(threads: int, cores: int, load: float) -> str | None:
    """A line when the machine's 1-minute load average leaves fewer free cores than the benchmark's threads:
    its CPU timings then measure the contention as much as the step (seen: 170x slower than with one thread)."""
    free = cores - load
    if free >= threads:
        return None
    return (
        f"warning: load average {load:.1f} on {cores} cores leaves about {max(free, 0):.1f} free for {threads} "
        f"thread(s): CPU timings will be slower than on an idle machine (try --threads {max(1, int(free))} or "
        "an idle machine)"
    )


def build_parser() -> OneLineParser:
    p = OneLineParser(
        prog="fused-stable bench",
        description="Time one optimizer step (global-norm clip 1.0 + AdamW) of fused_stable against torch's "
        "clip + AdamW variants; print one table and write JSON + markdown.",
        aliases={
            "--output-dir": "--out",
            "--output_dir": "--out",
            "--iters": "--steps",
            "--set": "--sets",
            "--contender": "--contenders",
            "--num-threads": "--threads",
            "--scale": "--size-scale",
            "--profile": "--no-profile",
            "--quiet": "--verbose",
        },
    )
    _add_selection_options(p)
    _add_timing_options(p)
    _add_run_options(p)
    return p


def _add_selection_options(p) -> None:
    """What is measured: device, plan, sets and contenders."""
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    p.add_argument(
        "--plan",
        default="auto",
        choices=["auto", "cpu", "gpu", "smoke"],
        help="parameter sizes: cpu (aimed at 4 minutes on 2 idle cores), gpu (1M to 1B+ params), "
        "smoke (tiny); auto picks gpu on CUDA, else cpu",
    )
    p.add_argument(
        "--size-scale",
        type=number(0, 1e3, low_open=True),
        default=1.0,
        help="multiply every set's size by this (e.g. run the gpu plan's logic on CPU with 1e-3)",
    )
    p.add_argument("--sets", default="", help="comma-separated set names or prefixes to run (default: all)")
    p.add_argument("--contenders", default="", help=f"comma-separated subset of: {', '.join(CONTENDERS)}")


def _add_timing_options(p) -> None:
    """How each row is timed: warm-up, the step budget, isolation, input sets."""
    p.add_argument(
        "--warmup",
        type=number(0, 100_000, integer=True),
        help="warm-up steps per row at least (fewer when one step outlasts --min-time); more until the step "
        "time settles, within --min-time",
    )
    p.add_argument(
        "--steps", type=number(1, 1_000_000, integer=True), help="minimum timed steps per row (unless --max-time)"
    )
    p.add_argument("--max-steps", type=number(1, 1_000_000, integer=True), help="maximum timed steps per row")
    p.add_argument("--min-time", type=number(0, 3600), help="seconds of timed steps to aim for per row")
    p.add_argument(
        "--max-time",
        type=number(0, 86_400, low_open=True),
        help="seconds of timed steps per row at most: a row whose step takes seconds runs fewer steps (at least "
        "3) (default: 6 on the cpu plan)",
    )
    p.add_argument(
        "--isolation",
        default="auto",
        choices=["auto", "row", "none"],
        help="row: each row in a fresh worker process, timed with the set's baseline (rows do not depend on "
        "what ran before); none: a set's contenders in this process, interleaved; auto: row on the cpu plan",
    )
    p.add_argument(
        "--input-sets",
        type=number(1, 64, integer=True),
        default=3,
        help="independent copies of a set (< 256 MiB) rotated between steps so caches don't flatter",
    )


def _add_run_options(p) -> None:
    """torch.compile rows, the copy reference, threads, profiling, deadline and outputs."""
    p.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="torch.compile contender: auto = on the plan's compile sets, on = every dense/LoRA set",
    )
    p.add_argument("--compile-sets", help="comma-separated sets that get the torch.compile contender")
    p.add_argument(
        "--compile-timeout",
        type=number(0, 86_400, low_open=True),
        help="time box (s) of one torch.compile row, compile included",
    )
    p.add_argument(
        "--copy-mib",
        type=number(0, 1 << 20),
        default=0.0,
        help="size of the copy-bandwidth reference (default: 256 on the cpu plan, 2048 on gpu, "
        "scaled down with --size-scale)",
    )
    p.add_argument(
        "--threads", type=number(0, 1024, integer=True), default=0, help="torch CPU threads (0: torch's default)"
    )
    p.add_argument("--no-profile", action="store_true", help="CUDA: skip the profiler pass (launches, syncs)")
    p.add_argument(
        "--verbose", action="store_true", help="let the profiler's own log lines through (hidden by default)"
    )
    p.add_argument(
        "--deadline",
        type=number(0, 7 * 86_400),
        default=0.0,
        help="seconds after which remaining rows are skipped (0: none); results are still written",
    )
    p.add_argument("--seed", type=number(0, 2**32 - 1, integer=True), default=0)
    p.add_argument("--out", default="bench-results", help="output directory for the JSON and markdown")
    p.add_argument("--name", default="", help="file stem (default: bench-<device>-<UTC date-time>)")


def _select_sets(sets, selector: str, flag: str = "--sets"):
    if not selector:
        return sets
    wanted = [s.strip() for s in selector.split(",") if s.strip()]
    chosen = [s for s in sets if any(s.name == w or s.name.startswith(w) for w in wanted)]
    if not chosen:
        raise UserError(f"{flag} {selector!r} matches none of: {', '.join(s.name for s in sets)}")
    return chosen


def _check_arguments(args, plan_of) -> tuple:
    """(device, plan, sets, contenders) from the options, or UserError with what is wrong."""
    device = resolve_device(args.device, "--device")
    plan = plan_of(device)
    sets = _select_sets(plan_sets(plan, args.size_scale), args.sets)
    contenders = tuple(c.strip() for c in args.contenders.split(",") if c.strip())
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown:
        close = suggestion(unknown[0], CONTENDERS)
        hint = f" (did you mean {close}?)" if close else ""
        raise UserError(f"--contenders: unknown {', '.join(unknown)}{hint}; choose from {', '.join(CONTENDERS)}")
    if args.compile_sets is not None:
        # a typo would silently skip every compile row
        _select_sets(plan_sets(plan, args.size_scale), args.compile_sets, "--compile-sets")
    check_writable(args.out, "--out")
    if args.name:
        check_file_name(args.name, "--name")
    return device, plan, sets, contenders


def _compile_sets(args, sets, defaults: dict) -> tuple:
    if args.compile == "off":
        return ()
    if args.compile == "on":
        return tuple(s.name for s in sets if s.family in ("dense", "lora"))
    chosen = args.compile_sets if args.compile_sets is not None else defaults["compile_sets"]
    return tuple(s.strip() for s in chosen.split(",") if s.strip())


def build_options(args, device, plan: str, sets, contenders: tuple) -> Options:
    """The run's Options: each one the option given, else the plan's default."""
    d = PLAN_DEFAULTS[plan]

    def given(name: str, key: str | None = None):
        value = getattr(args, name)
        return value if value is not None else d[key or name]

    copy_mib = args.copy_mib or int(max(8, d["copy_mib"] * min(1.0, args.size_scale)))
    return Options(
        device=str(device),
        warmup=given("warmup"),
        min_steps=given("steps", "min_steps"),
        min_time=given("min_time"),
        max_time=given("max_time"),
        max_steps=args.max_steps if args.max_steps is not None else max(d["max_steps"], args.steps or 0),
        input_sets=args.input_sets,
        compile_sets=_compile_sets(args, sets, d),
        compile_timeout=given("compile_timeout"),
        threads=args.threads,
        seed=args.seed,
        profile=not args.no_profile,
        contenders=contenders,
        copy_bytes=int(copy_mib * 2**20),
        isolation=d["isolation"] if args.isolation == "auto" else args.isolation,
    )


def new_result(argv, args, env: dict, plan: str, sets, opts: Options, copy_bw: float) -> dict:
    """The run's record before its rows: environment, command, options, copy bandwidth, bytes model, sets."""
    set_keys = ("name", "family", "dtype", "n_tensors", "n_params", "description")
    return {
        "environment": env,
        "plan": plan,
        "size_scale": args.size_scale,
        "command": "fused-stable bench " + " ".join(shlex.quote(a) for a in argv),
        "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(opts).items()},
        "copy_bytes": opts.copy_bytes,
        "copy_bandwidth_gbps": copy_bw / 1e9,
        "bytes_model": {c.key: {"passes": list(c.passes), "note": c.bytes_note} for c in CONTENDERS.values()},
        "sets": [{key: getattr(s, key) for key in set_keys} for s in sets],
        "rows": [],
        "goals": [],
    }


def _progress_line(row: dict) -> str:
    if row["status"] != "ok":
        return f"  {row['set']:<14} {row['contender']:<20} {row['status']}: {row['reason']}"
    spread = f"(q1 {row['q1_s'] * 1e3:.3f}, q3 {row['q3_s'] * 1e3:.3f}, {row['steps']} steps)"
    wide = ", spread too wide to judge" if row.get("too_wide") else ""
    return f"  {row['set']:<14} {row['contender']:<20} {row['median_s'] * 1e3:.3f} ms {spread}{wide}"


def main(argv: list[str]) -> int:
    """`fused-stable bench`; a bad option is one line on stderr and exit code 2, before anything is written."""
    offline_environment()
    args, code = parse_command(build_parser(), argv, "bench")
    if args is None:
        return code
    from rich.console import Console

    console = Console(width=max(200, Console().width))
    try:
        device, plan, sets, contenders = _check_arguments(
            args, lambda device: args.plan if args.plan != "auto" else ("gpu" if device.type == "cuda" else "cpu")
        )
    except UserError as e:
        print(f"fused-stable bench: error: {e}", file=sys.stderr)
        return 2
    measure.QUIET_PROFILER = not args.verbose
    if args.threads:
        torch.set_num_threads(args.threads)
    opts = build_options(args, device, plan, sets, contenders)

    started = time.monotonic()
    deadline = started + args.deadline if args.deadline > 0 else None
    env = report.environment(device)
    if device.type == "cpu":
        busy = load_warning(torch.get_num_threads(), os.cpu_count() or 1, os.getloadavg()[0])
        if busy:
            console.print(busy, markup=False)
    console.print(f"measuring copy bandwidth on {env['device']} ...", markup=False)
    copy_bw = measure.copy_bandwidth(device, opts.copy_bytes)
    stem = args.name or f"bench-{device.type}-{env['date'][:19].replace(':', '').replace('-', '')}"
    out_dir = Path(args.out)
    result = new_result(argv, args, env, plan, sets, opts, copy_bw)

    def on_row(row):
        result["rows"].append(row)
        console.print(_progress_line(row), markup=False)
        report.write(result, out_dir, stem)  # partial results survive a kill

    result["rows"] = run_plan(sets, opts, copy_bw, deadline=deadline, on_row=on_row)
    env["load_average_end"] = report.load_average()
    env["wall_s"] = round(time.monotonic() - started, 1)
    result["goals"] = report.goals(result["rows"], device.type)
    json_path, md_path = report.write(result, out_dir, stem)
    report.print_table(console, result)
    console.print(f"wrote {json_path} and {md_path}", markup=False)
    return 0
