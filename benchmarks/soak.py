"""Soak: 2,000 optimizer steps of `fused-stable sft` on the tiny model, watching what a long run could leak.

    python benchmarks/soak.py                      # 2000 steps -> benchmarks/results/soak-<time>.json
    python benchmarks/soak.py --steps 300 --out /tmp/soak.json
    python -m pytest benchmarks/test_soak.py -m benchmark     # the same, with the limits below asserted

The run is the real command in this process (LoRA on q/v, batch 4, a checkpoint every 200 steps keeping 2, so
saving and pruning run ten times, TensorBoard events on, metrics read every 10 steps). At every logging step a
callback samples the resident set size (/proc/self/statm), the process's peak RSS (getrusage), the open file
descriptors (/proc/self/fd) and the time since the previous sample: wall clock, and the main thread's CPU time
(`time.thread_time`; with one torch thread it is the step's host work, and another job on the machine stretches
it far less than the wall clock). After a warm-up (the first WARMUP steps: allocator pools, caches, the first
checkpoints) each series gets a least-squares line against the step number: the slopes are the result.

Limits (`check`): RSS (its fitted line) and peak RSS grow by less than RSS_LIMIT_MB over the measured steps
(a leak of one small tensor per step, 16 KB, would add 29 MB), the per-step CPU time's fitted line changes by
less than TIME_LIMIT of its median over them, and the descriptors open at the end of training are the ones open
after the warm-up. `windows` gives the same series per 200 steps: on a shared machine the time per step follows
the other jobs' load up and down, where a leak would grow in every window.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

WARMUP = 200
RSS_LIMIT_MB = 8.0
TIME_LIMIT = 0.25
ARGS = [
    "--model",
    "tiny",
    "--dataset",
    "arithmetic",
    "--arithmetic_examples",
    "256",
    "--target_modules",
    "q_proj,v_proj",
    "--batch_size",
    "4",
    "--grad_accum",
    "1",
    "--max_length",
    "96",
    "--logging_steps",
    "10",
    "--save_steps",
    "200",
    "--save_total_limit",
    "2",
    "--threads",
    "1",
]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _fds() -> list[str]:
    """What each open descriptor points at (a leak shows as a growing list, and says what leaked)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the descriptor listdir itself used, closed meanwhile
    return sorted(names)


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _windows(samples: list[dict], steps: int, width: int = WARMUP) -> list[dict]:
    """Per window of `width` steps: the median and the fastest CPU and wall time per step, the RSS range. On a
    shared machine the wall clock, and less so the CPU time, follow the other jobs' load: a leak grows in every
    window, contention comes and goes."""
    out = []
    for start in range(0, steps, width):
        window = [s for s in samples if start < s["step"] <= start + width]
        if not window:
            continue
        cpu = sorted(s["cpu_ms_per_step"] for s in window)
        wall = sorted(s["wall_ms_per_step"] for s in window)
        out.append(
            {
                "steps": f"{start + 1}-{start + width}",
                "cpu_ms_per_step_median": cpu[len(cpu) // 2],
                "cpu_ms_per_step_min": cpu[0],
                "wall_ms_per_step_median": wall[len(wall) // 2],
                "rss_mb_min": min(s["rss_mb"] for s in window),
                "rss_mb_max": max(s["rss_mb"] for s in window),
                "peak_rss_mb": max(s["peak_rss_mb"] for s in window),
            }
        )
    return out


def soak(steps: int, output_dir: str) -> dict:
    from fused_stable.train.run import sft

    samples = []
    clock = {"wall": time.perf_counter(), "cpu": time.thread_time(), "step": 0}

    def sample(step, optimizer, metrics):
        wall, cpu = time.perf_counter(), time.thread_time()
        n = step - clock["step"]
        samples.append(
            {
                "step": step,
                "rss_mb": _rss_mb(),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "fds": len(_fds()),
                "wall_ms_per_step": 1e3 * (wall - clock["wall"]) / n,
                "cpu_ms_per_step": 1e3 * (cpu - clock["cpu"]) / n,
            }
        )
        if step == WARMUP:
            fds_after_warmup.extend(_fds())
        clock.update(wall=time.perf_counter(), cpu=time.thread_time(), step=step)

    fds_after_warmup: list[str] = []
    fds_at_end: list[str] = []
    build = sft.setup_run

    def with_sampler(argv):
        setup = build(argv)
        setup.trainer.callbacks.append(sample)
        setup.trainer.callbacks.append(lambda step, o, m: fds_at_end.__setitem__(slice(None), _fds()))
        return setup

    sft.setup_run = with_sampler
    load_at_start = os.getloadavg()
    t0 = time.perf_counter()
    try:
        code = sft.main([*ARGS, "--max_steps", str(steps), "--output_dir", output_dir])
    finally:
        sft.setup_run = build
    if code != 0:
        raise SystemExit(f"soak: fused-stable sft exited {code}")
    measured = [s for s in samples if s["step"] > WARMUP]
    xs = [s["step"] for s in measured]
    cpu = sorted(s["cpu_ms_per_step"] for s in measured)
    result = {
        "steps": steps,
        "warmup_steps": WARMUP,
        "wall_s": time.perf_counter() - t0,
        "rss_mb": {"after_warmup": measured[0]["rss_mb"], "end": measured[-1]["rss_mb"]},
        "rss_slope_mb_per_1000_steps": 1000 * _slope(xs, [s["rss_mb"] for s in measured]),
        "peak_rss_mb": {"after_warmup": measured[0]["peak_rss_mb"], "end": measured[-1]["peak_rss_mb"]},
        "peak_rss_slope_mb_per_1000_steps": 1000 * _slope(xs, [s["peak_rss_mb"] for s in measured]),
        "cpu_ms_per_step_median": cpu[len(cpu) // 2],
        "cpu_ms_per_step_slope_per_1000_steps": 1000 * _slope(xs, [s["cpu_ms_per_step"] for s in measured]),
        "wall_ms_per_step_slope_per_1000_steps": 1000 * _slope(xs, [s["wall_ms_per_step"] for s in measured]),
        "fds": {"after_warmup": len(fds_after_warmup), "end_of_training": len(fds_at_end)},
        "fds_opened_and_not_closed": sorted(set(fds_at_end) - set(fds_after_warmup)),
        "windows": _windows(samples, steps),
        "samples": samples,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_start": load_at_start,
        },
    }
    import torch

    result["machine"]["torch"] = torch.__version__
    result["machine"]["load_average_end"] = os.getloadavg()
    return result


def check(result: dict) -> list[str]:
    """What the soak shows that a long run must not do (empty: flat)."""
    span = (result["steps"] - result["warmup_steps"]) / 1000
    problems = []
    growth = result["rss_slope_mb_per_1000_steps"] * span
    if growth > RSS_LIMIT_MB:
        problems.append(f"RSS grew {growth:.1f} MB over the measured steps (limit {RSS_LIMIT_MB} MB)")
    peak_growth = result["peak_rss_mb"]["end"] - result["peak_rss_mb"]["after_warmup"]
    if peak_growth > RSS_LIMIT_MB:
        problems.append(f"peak RSS grew {peak_growth:.1f} MB over the measured steps (limit {RSS_LIMIT_MB} MB)")
    drift = abs(result["cpu_ms_per_step_slope_per_1000_steps"] * span) / result["cpu_ms_per_step_median"]
    if drift > TIME_LIMIT:
        problems.append(
            f"CPU time per step changed {100 * drift:.0f}% over the measured steps (limit {TIME_LIMIT:.0%})"
        )
    if result["fds_opened_and_not_closed"] or result["fds"]["end_of_training"] > result["fds"]["after_warmup"]:
        problems.append(f"file descriptors left open: {result['fds_opened_and_not_closed'][:5]}")
    return problems


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/soak-<time>.json)")
    args = p.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fused_stable_soak_") as tmp:
        result = soak(args.steps, os.path.join(tmp, "run"))
    result["problems"] = check(result)
    out = args.out or os.path.join(HERE, "results", time.strftime("soak-%Y%m%dT%H%MZ.json", time.gmtime()))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"soak: {result['steps']} steps in {result['wall_s']:.0f} s | RSS {result['rss_mb']['after_warmup']:.0f} -> "
        f"{result['rss_mb']['end']:.0f} MB (slope {result['rss_slope_mb_per_1000_steps']:+.2f} MB / 1000 steps), "
        f"peak {result['peak_rss_mb']['end']:.0f} MB (slope {result['peak_rss_slope_mb_per_1000_steps']:+.2f}) | "
        f"CPU per step {result['cpu_ms_per_step_median']:.1f} ms "
        f"(slope {result['cpu_ms_per_step_slope_per_1000_steps']:+.2f} ms / 1000 steps) | open files "
        f"{result['fds']['after_warmup']} -> {result['fds']['end_of_training']} | {out}"
    )
    for problem in result["problems"]:
        print(f"soak: {problem}")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
