"""pytest-benchmark suite configuration: the machine record (device, library versions) saved with every result.

Run with `python -m pytest benchmarks -m benchmark` (pyproject's default `-m 'not benchmark'` keeps it out of the
normal test run). FUSED_STABLE_BENCH_PLAN (cpu | gpu | smoke) and
FUSED_STABLE_BENCH_SCALE pick the sizes (see test_step_speed.py).
"""
from __future__ import annotations

import torch


def bench_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_benchmark_update_machine_info(config, machine_info):
    # device name and library versions travel with every saved result (--benchmark-save / --benchmark-json)
    from fused_stable.bench.report import environment

    env = environment(bench_device())
    machine_info["fused_stable"] = {k: env[k] for k in ("device", "runtime", "torch", "triton", "fused_stable",
                                                         "git", "torch_threads", "load_average_start")}
