"""Host time of one FusedAdamW.step() on the Triton path, measured on a machine without a GPU.

On a GPU a step costs the larger of what the GPU does and what the host thread does before the last kernel
is queued. The second part is Python: fused_stable's own, plus Triton's launch path. This benchmark runs the
real Triton launch path on CPU tensors through fused_stable.devtools.standin (a stand-in driver: kernels are
compiled for sm_90 as on a GPU, and the final call into the CUDA driver is replaced by a record), so what it
times around `opt.step()` is exactly that host work. Host time depends on the number of tensors, not on
their size, so the tensors are small.

    python benchmarks/host_time.py                                   # this checkout
    python benchmarks/host_time.py --baseline /tmp/old-checkout      # and another one, in alternating rounds
    python benchmarks/host_time.py --limits 30,60                    # exit 1 if a median exceeds its limit (us)

Parameter sets (the reference sets of the project's host-time target): `small`, 6 tensors of 64x64;
`lora`, 448 LoRA-like tensors (32 layers x 7 linears x A/B, hidden 64, MLP 176, rank 4). Scenarios: `static`,
the same grad tensors every step (steady state, what the targets are stated for), and `fresh`, new grad
tensors assigned before every step (as after `zero_grad(set_to_none=True)`; the assignment is not timed).

Method: every round starts a fresh worker process, which imports each checkout's package (a baseline under
another name), builds each set for each, takes 10 warm-up steps (plan and table builds, compilation or the
on-disk cache), then times `--steps` steps per checkout, the checkouts taking turns every 20 steps (so both see
the same machine load; the first to step alternates between rounds), with two clocks: the thread's CPU time
(`time.thread_time_ns`, which does not count the time the process waits for a core, so other jobs on a shared machine
disturb it far less) and the wall clock (`time.perf_counter_ns`). A round reports the median of each; the result is the
median over rounds, with the range. Launches per step come from the stand-in driver's count. A machine shared with other
work still slows everything down by a varying factor (frequency, caches, hyper-threads): compare checkouts
within one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BLOCK = 20  # steps a checkout takes in a row before the next one's turn (a hot loop, like a training loop's)
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SETS = ("small", "lora")
SCENARIOS = ("static", "fresh")


def shapes_for(name: str) -> list[tuple[int, ...]]:
    if name == "small":
        return [(64, 64)] * 6
    if name == "lora":
        hidden, mlp, rank, layers = 64, 176, 4, 32
        linears = [(hidden, hidden)] * 4 + [(hidden, mlp), (hidden, mlp), (mlp, hidden)]
        return [shape for _ in range(layers) for d_in, d_out in linears for shape in ((rank, d_in), (d_out, rank))]
    raise ValueError(f"unknown set {name!r}: use one of {', '.join(SETS)}")


# ------------------------------------------------------------------------------------------------------------
# worker: one checkout, in its own process


def _load_standin():
    """This checkout's stand-in driver, loaded by path (a baseline checkout may not have one)."""
    import importlib.util

    path = ROOT / "fused_stable" / "devtools" / "standin.py"
    spec = importlib.util.spec_from_file_location("_host_time_standin", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _import_package(tree: Path, alias: str):
    """The fused_stable package of another checkout, imported under another name (its modules import each other
    relatively), so that two versions can take turns in one process."""
    import importlib.util

    init = tree / "fused_stable" / "__init__.py"
    spec = importlib.util.spec_from_file_location(alias, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    spec.loader.exec_module(module)
    return module


def run_worker(trees: dict[str, str], sets: list[str], scenarios: list[str], steps: int) -> list[dict]:
    """Times every checkout's step on the same sets, taking turns every 20 steps so that all see the same load."""
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("host_time: run without TRITON_INTERPRET=1 (it times Triton's compiled launch path)")
    standin = _load_standin()
    import importlib

    import torch

    torch.set_num_threads(1)
    packages = {}
    for label, tree in trees.items():
        package = _import_package(Path(tree), f"_host_time_{label}")
        ops = importlib.import_module(f"{package.__name__}.ops")
        ops.resolve_backend = lambda requested, device: "triton"  # CPU tensors on the compiled launch path
        packages[label] = package
    results = []
    with standin.installed() as launches:
        for name in sets:
            for scenario in scenarios:
                runs = {}
                for label, package in packages.items():
                    gen = torch.Generator().manual_seed(0)
                    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes_for(name)]
                    grads = [torch.randn(p.shape, generator=gen) * 1e-3 for p in params]
                    for p, g in zip(params, grads):
                        p.grad = g
                    opt = package.FusedAdamW(params, lr=1e-3, weight_decay=1e-2, max_grad_norm=1.0)
                    for _ in range(10):
                        opt.step()
                    runs[label] = (opt, params, grads, [], [], [0])
                fresh = scenario == "fresh"
                for _ in range(steps // BLOCK):
                    for opt, params, grads, cpu, wall, count in runs.values():
                        for _ in range(BLOCK):
                            if fresh:
                                for p, g in zip(params, grads):
                                    p.grad = g.clone()
                            before = launches.count
                            w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                            opt.step()
                            c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                            count[0] += launches.count - before
                            cpu.append((c1 - c0) / 1e3)
                            wall.append((w1 - w0) / 1e3)
                for label, (_opt, _params, _grads, cpu, wall, count) in runs.items():
                    results.append(
                        {
                            "tree": label,
                            "set": name,
                            "scenario": scenario,
                            "tensors": len(params),
                            "cpu_us": statistics.median(cpu),
                            "wall_us": statistics.median(wall),
                            "launches_per_step": count[0] / len(cpu),
                        }
                    )
    return results


# ------------------------------------------------------------------------------------------------------------
# driver: one worker process per round


def _worker(trees: dict[str, Path], sets, scenarios, steps) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSED_STABLE_BACKEND")}
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # an older checkout may leave it unset (a warning, no effect here)
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--trees",
        json.dumps({k: str(v) for k, v in trees.items()}),
        "--sets",
        ",".join(sets),
        "--scenarios",
        ",".join(scenarios),
        "--steps",
        str(steps),
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"host_time worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _revision(tree: Path) -> str | None:
    proc = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return proc.stdout.strip() or None


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def measure(trees: dict[str, Path], sets, scenarios, steps: int, rounds: int) -> dict:
    per_round: dict[tuple, list[dict]] = {}
    load_start = _load()
    for r in range(rounds):
        order = dict(trees.items()) if r % 2 == 0 else dict(reversed(trees.items()))  # who steps first
        for row in _worker(order, sets, scenarios, steps):
            per_round.setdefault((row["tree"], row["set"], row["scenario"]), []).append(row)
    rows = []
    for (label, name, scenario), runs in per_round.items():
        cpu = [run["cpu_us"] for run in runs]
        wall = [run["wall_us"] for run in runs]
        rows.append(
            {
                "tree": label,
                "set": name,
                "scenario": scenario,
                "tensors": runs[0]["tensors"],
                "cpu_us": statistics.median(cpu),
                "cpu_us_range": [min(cpu), max(cpu)],
                "wall_us": statistics.median(wall),
                "wall_us_range": [min(wall), max(wall)],
                "launches_per_step": runs[0]["launches_per_step"],
                "rounds": len(runs),
            }
        )
    ratios = {}
    for (label, name, scenario), runs in per_round.items():
        base = per_round.get(("baseline", name, scenario))
        if label == "this" and base:  # each round measured both in one process, taking turns: pair them
            per = [b["cpu_us"] / t["cpu_us"] for b, t in zip(base, runs)]
            ratios[f"{name}/{scenario}"] = {"median": statistics.median(per), "range": [min(per), max(per)]}
    return {
        "ratios_baseline_over_this": ratios,
        "method": "stand-in Triton driver (fused_stable.devtools.standin), CPU tensors, 1 torch thread; per round a "
        f"fresh process, 10 warm-up steps, then {steps} timed steps per checkout taking turns every 20 steps; "
        f"median per round, then the median over {rounds} rounds",
        "steps": steps,
        "rounds": rounds,
        "load_average": [load_start, _load()],
        "trees": {label: str(tree) for label, tree in trees.items()},
        "rows": rows,
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
    }


def table(result: dict) -> str:
    lines = [
        "| checkout | set | scenario | tensors | CPU us/step (range) | wall us/step (range) | launches/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in sorted(result["rows"], key=lambda r: (r["set"], r["scenario"], r["tree"])):
        lines.append(
            f"| {row['tree']} | {row['set']} | {row['scenario']} | {row['tensors']} | {row['cpu_us']:.0f} "
            f"({row['cpu_us_range'][0]:.0f}-{row['cpu_us_range'][1]:.0f}) | {row['wall_us']:.0f} "
            f"({row['wall_us_range'][0]:.0f}-{row['wall_us_range'][1]:.0f}) | {row['launches_per_step']:g} |"
        )
    for key, ratio in result.get("ratios_baseline_over_this", {}).items():
        lines.append(
            f"\n{key}: baseline CPU time / this = {ratio['median']:.1f}x (rounds {ratio['range'][0]:.1f}-"
            f"{ratio['range'][1]:.1f}x)"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="another checkout to measure in alternating rounds")
    parser.add_argument("--baseline-name", default="", help="what the baseline is (e.g. a commit), for the record")
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--limits", help="small,lora: the largest CPU us/step (static scenario) to accept")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trees", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sets, scenarios = args.sets.split(","), args.scenarios.split(",")
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.trees), sets, scenarios, args.steps)))
        return 0
    trees = {"this": ROOT}
    if args.baseline:
        trees["baseline"] = args.baseline.resolve()
    result = measure(trees, sets, scenarios, args.steps, args.rounds)
    result["revisions"] = {"this": _revision(ROOT), "baseline": args.baseline_name or None}
    print(result["method"])
    print(f"load average {result['load_average'][0]:.2f} at the start, {result['load_average'][1]:.2f} at the end")
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    if args.limits:
        limits = dict(zip(SETS, (float(x) for x in args.limits.split(","))))
        over = [
            r
            for r in result["rows"]
            if r["tree"] == "this"
            and r["scenario"] == "static"
            and r["set"] in limits
            and r["cpu_us"] > limits[r["set"]]
        ]
        for row in over:
            print(f"over the limit: {row['set']} {row['cpu_us']:.0f} us > {limits[row['set']]:.0f} us")
        return 1 if over else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
