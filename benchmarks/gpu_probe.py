"""A two-minute GPU probe of fused_stable's step: what only a GPU can say, in one run (benchmarks/gpu_probe.sh).

    python benchmarks/gpu_probe.py --out DIR [--budget 100]    # on a CUDA machine
    python benchmarks/gpu_probe.py --dry-run                   # anywhere: the plan, and its inputs checked

Sections (each a key of the result JSON; a section that does not fit the time budget is marked skipped):
  environment   device, driver, torch / triton versions
  kernels       per-kernel device times of one fused step (torch.profiler), per parameter set
  graph_step    device time of a whole step alone, no host: the step captured in a CUDA graph, replays timed
                with CUDA events; fused_stable and torch's clip_grad_norm_(foreach) + AdamW(fused, capturable)
  host_step     host time of an eager step (the Python before the last launch), both contenders
  candidates    the launch configurations tests/core/test_kernels_codegen.py lets through (devtools/codegen.py
                CANDIDATES) side by side: norm pass and update pass device times per configuration and chunk size
  multi_device  with two or more GPUs: a step on cuda:1 while cuda:0 is current matches torch and runs on cuda:1
Results: DIR/results/gpu-probe-<stamp>.json and .md. Parameter sets: fused_stable.bench's GPU plan
(`dense-fp32`, 492M params in 75 tensors; `lora-fp32`, 40M params in 448 LoRA tensors; `dense-bf16`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fused_stable.bench.paramsets import materialize, plan_sets  # noqa: E402

SETS = ("lora-fp32", "dense-fp32", "dense-bf16")
CHUNK_SIZES = (65536, 16384)
SECTIONS = ("environment", "kernels", "graph_step", "host_step", "candidates", "multi_device")


def probe_plan(size_scale: float = 1.0) -> dict:
    """What the probe measures (also its dry run): sets with their sizes, contenders, candidate configurations."""
    from fused_stable.devtools.codegen import CANDIDATES

    specs = {spec.name: spec for spec in plan_sets("gpu", size_scale)}
    return {
        "sections": list(SECTIONS),
        "sets": {name: {"tensors": specs[name].n_tensors, "params": specs[name].n_params} for name in SETS},
        "contenders": ["fused_stable", "torch_fused"],
        "candidates": {kernel: [vars(config) for config in configs] for kernel, configs in CANDIDATES.items()},
        "chunk_sizes": list(CHUNK_SIZES),
    }


# ------------------------------------------------------------------------------------------------------------
# building blocks (device-agnostic where they can be: tests/tools/test_gpu_probe.py runs them on CPU)


def fused_optimizer(params, **extra):
    from fused_stable import FusedAdamW

    return FusedAdamW(params, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0, **extra)


def torch_step(params, capturable=False):
    """torch's usual step: clip_grad_norm_(foreach) then AdamW(fused); capturable for a CUDA graph."""
    lr = torch.tensor(1e-3, device=params[0].device) if capturable else 1e-3
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True, capturable=capturable)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    return step


def candidate_tables(opt, sumsq_config, adamw_config, chunk_size):
    """The same device tables as the optimizer's own, launched with other configurations and chunk size."""
    from fused_stable.backends import triton_backend

    plan, _ = opt.build_step_plan()  # the plan of the grads the probe set (the package-internal surface)
    tables = triton_backend.TritonTables(
        plan,
        opt.step_buffers,
        opt.policy,
        opt.device,
        sumsq_config=sumsq_config,
        adamw_config=adamw_config,
        chunk_size=chunk_size,
    )
    tables.refresh_grads(plan)
    tables.refresh_hparams(opt.hparam_rows())  # the rule's HParams rows, as a step hands them (rules/declaration.py)
    return tables


def run_candidate(tables, part: str) -> None:
    """One pass of a candidate: the norm pass, or the update pass, or the whole step."""
    from fused_stable.backends import triton_backend
    from fused_stable.kernels.launch import current_stream
    from fused_stable.kernels.norm import run_sumsq
    from fused_stable.kernels.update import run_update

    if part == "step":
        triton_backend.launch_step(tables)
        return
    stream = current_stream(tables.device.index or 0)
    for prepared in tables.norms if part == "norm" else tables.updates:
        (run_sumsq(prepared, None, stream) if part == "norm" else run_update(prepared, stream))


# ------------------------------------------------------------------------------------------------------------
# measurements (CUDA)


def cuda_times_ms(fn, reps: int = 20, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1], "n": len(ordered)}


def kernel_times(step, steps: int = 3) -> dict:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            times.setdefault(event.name, []).append(event.device_time / 1e3)  # us -> ms
    return {name: {"ms_per_step": sum(v) / steps, "launches_per_step": len(v) / steps} for name, v in times.items()}


def graph_step_ms(step, reps: int = 20) -> dict:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return summary(cuda_times_ms(graph.replay, reps))


def host_step_us(step, reps: int = 30) -> dict:
    step()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return summary(times)


def multi_device_check() -> dict:
    if torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} CUDA device(s): needs two"}
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in [(4097,), (300, 7), (65_537,)]]
    ours = [torch.nn.Parameter(t.to("cuda:1")) for t in init]
    theirs = [torch.nn.Parameter(t.to("cuda:1")) for t in init]
    opt, ref = fused_optimizer(ours), torch.optim.AdamW(theirs, lr=1e-3, weight_decay=0.01)
    torch.cuda.set_device(0)
    for _ in range(3):
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape, generator=gen).to("cuda:1")
            a.grad, b.grad = g.clone(), g.clone()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            opt.step()
            torch.cuda.synchronize(1)
        torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        ref.step()
    worst = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
    devices = sorted({e.device_index for e in prof.events() if e.device_type.name == "CUDA"})
    return {"max_abs_diff": worst, "kernel_devices": devices, "ok": worst < 1e-5 and devices == [1]}


def run(out_dir: Path | None, budget_s: float, size_scale: float) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_probe: no CUDA device (torch.cuda.is_available() is False); use --dry-run on CPU")
    started = time.monotonic()
    device = torch.device("cuda")
    specs = {spec.name: spec for spec in plan_sets("gpu", size_scale)}
    result: dict = {"plan": probe_plan(size_scale), "budget_s": budget_s}
    props = torch.cuda.get_device_properties(0)
    import triton

    result["environment"] = {
        "device": f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs)",
        "devices": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
    }

    def time_left() -> bool:
        return time.monotonic() - started < budget_s

    for section in ("kernels", "graph_step", "host_step", "candidates"):
        result[section] = {}
    for name in SETS:
        if not time_left():
            for section in ("kernels", "graph_step", "host_step", "candidates"):
                result[section][name] = {"skipped": "time budget"}
            continue
        params = materialize(specs[name], device)
        opt = fused_optimizer(params, capturable=True)
        result["kernels"][name] = {"fused_stable": kernel_times(opt.step)}
        result["host_step"][name] = {"fused_stable": host_step_us(opt.step)}
        result["graph_step"][name] = {"fused_stable": graph_step_ms(opt.step)}
        if specs[name].dtype == "fp32":  # torch's fused AdamW keeps bf16 moments for bf16 params: another step
            twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
            for p, q in zip(twin, params):
                p.grad = q.grad.clone()
            result["kernels"][name]["torch_fused"] = kernel_times(torch_step(twin))
            result["host_step"][name]["torch_fused"] = host_step_us(torch_step(twin))
            result["graph_step"][name]["torch_fused"] = graph_step_ms(torch_step(twin, capturable=True))
            del twin
        rows = []
        from fused_stable.devtools.codegen import CANDIDATES

        for chunk_size in CHUNK_SIZES:
            for sumsq_config, adamw_config in zip(CANDIDATES["sumsq"], CANDIDATES["adamw"]):
                if not time_left():
                    break
                tables = candidate_tables(opt, sumsq_config, adamw_config, chunk_size)
                rows.append(
                    {
                        "chunk_size": chunk_size,
                        "sumsq": vars(sumsq_config),
                        "adamw": vars(adamw_config),
                        "norm_ms": summary(cuda_times_ms(lambda t=tables: run_candidate(t, "norm"))),
                        "update_ms": summary(cuda_times_ms(lambda t=tables: run_candidate(t, "update"))),
                        "step_ms": summary(cuda_times_ms(lambda t=tables: run_candidate(t, "step"))),
                    }
                )
        result["candidates"][name] = rows
        del opt, params
        torch.cuda.empty_cache()
    result["multi_device"] = multi_device_check() if time_left() else {"skipped": "time budget"}
    result["elapsed_s"] = time.monotonic() - started
    if out_dir is not None:
        write(result, out_dir)
    return result


def write(result: dict, out_dir: Path) -> Path:
    stem = "gpu-probe-" + time.strftime("%Y%m%dT%H%MZ", time.gmtime())
    results = out_dir / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (results / f"{stem}.md").write_text(markdown(result))
    return results / f"{stem}.json"


def markdown(result: dict) -> str:
    lines = [f"# GPU probe: {result['environment']['device']}", "", f"{json.dumps(result['environment'])}", ""]
    lines += ["| set | contender | graph step ms (median) | host us/step (median) |", "|---|---|---|---|"]
    for name, by in result["graph_step"].items():
        for contender, timing in by.items() if isinstance(by, dict) and "skipped" not in by else []:
            host = result["host_step"][name].get(contender, {})
            lines.append(f"| {name} | {contender} | {timing['median']:.3f} | {host.get('median', float('nan')):.0f} |")
    lines += [
        "",
        "| set | chunk | norm config | update config | norm ms | update ms | step ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in result["candidates"].items():
        for row in rows if isinstance(rows, list) else []:
            s, a = row["sumsq"], row["adamw"]
            lines.append(
                f"| {name} | {row['chunk_size']} | {s['block']}x{s['num_warps']}w | {a['block']}x{a['num_warps']}w | "
                f"{row['norm_ms']['median']:.3f} | {row['update_ms']['median']:.3f} | {row['step_ms']['median']:.3f} |"
            )
    lines += ["", f"multi-device: {json.dumps(result['multi_device'])}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write results/gpu-probe-<stamp>.json and .md under this folder")
    parser.add_argument("--budget", type=float, default=100.0, help="seconds of measurements (default 100)")
    parser.add_argument("--size-scale", type=float, default=1.0, help="scale every set's size (default 1)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and check its inputs; needs no GPU")
    args = parser.parse_args(argv)
    if args.dry_run:
        print(json.dumps(probe_plan(args.size_scale), indent=2))
        return 0
    result = run(args.out, args.budget, args.size_scale)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
