"""The GPU probe (benchmarks/gpu_probe.sh, gpu_probe.py) checked on CPU: its plan, its refusal without CUDA, and
that every launch configuration it times computes exactly the step the default one does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_close, interpret_available

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_dry_run_prints_the_plan_without_a_gpu():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_probe.py"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)
    assert plan["sections"] == ["environment", "kernels", "graph_step", "host_step", "candidates", "multi_device"]
    assert plan["sets"]["lora-fp32"]["tensors"] == 448
    assert len(plan["candidates"]["sumsq"]) == len(plan["candidates"]["adamw"]) >= 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_shell_script_fails_loudly_without_cuda(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_probe.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--dry-run" in proc.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.skipif(not interpret_available(), reason="needs TRITON_INTERPRET=1")
def test_every_candidate_configuration_computes_the_default_step():
    import gpu_probe

    from fused_stable.devtools.codegen import CANDIDATES

    shapes = [(17_000,), (700,), (33_000,)]  # several chunks of 16384 elements
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]

    def two_steps(candidate=None):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = gpu_probe.fused_optimizer(params, backend="interpret")
        for p, g in zip(params, grads[0]):
            p.grad = g.clone()
        opt.step()
        for p, g in zip(params, grads[1]):
            p.grad = g.clone()
        if candidate is None:
            opt.step()
        else:
            opt._plan.current_grads(opt.param_groups)  # record the new grad storage, as a step does first
            gpu_probe.run_candidate(gpu_probe.candidate_tables(opt, *candidate), "step")
        return params, opt

    expected, reference = two_steps()
    for chunk_size in gpu_probe.CHUNK_SIZES:
        for sumsq_config, adamw_config in zip(CANDIDATES["sumsq"], CANDIDATES["adamw"]):
            got, opt = two_steps((sumsq_config, adamw_config, chunk_size))
            what = f"chunk {chunk_size}, norm {sumsq_config}, update {adamw_config}"
            assert_close(opt.grad_norm, reference.grad_norm, 1e-6, 0, what)
            for a, b in zip(got, expected):
                assert_close(a, b, 1e-6, 1e-7, what)
