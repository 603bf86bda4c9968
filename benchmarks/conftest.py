"""pytest-benchmark suite configuration: the machine record (device, library versions) saved with every result.

Run with `python -m pytest benchmarks -m benchmark` (pyproject's default `-m 'not benchmark'` keeps it out of the
normal test run). FUSED_STABLE_BENCH_PLAN (cpu | gpu | smoke) and FUSED_STABLE_BENCH_SCALE pick the sizes (see
test_step_speed.py); FUSED_STABLE_BENCH_THREADS sets torch's CPU threads for the session.
"""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _cpu_threads():
    threads = int(os.environ.get("FUSED_STABLE_BENCH_THREADS", "0"))
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    yield
    torch.set_num_threads(previous)


def bench_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_benchmark_update_machine_info(config, machine_info):
    # device name and library versions travel with every saved result (--benchmark-save / --benchmark-json)
    from fused_stable.bench.report import environment

    env = environment(bench_device())
    machine_info["fused_stable"] = {
        k: env[k]
        for k in ("device", "runtime", "torch", "triton", "fused_stable", "git", "torch_threads", "load_average_start")
    }
