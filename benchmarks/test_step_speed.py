"""pytest-benchmark timings of one optimizer step (clip 1.0 + AdamW), per parameter set and contender.

The same parameter sets, contenders and bytes model as `fused-stable bench` (which adds copy bandwidth, launch
and sync counts, and the goal checks); here pytest-benchmark does the statistics, comparison and storage:
    python -m pytest benchmarks -m benchmark --benchmark-group-by=group --benchmark-columns=median,iqr,rounds
torch.compile is left to `fused-stable bench`, which time-boxes it in a separate process.
"""

from __future__ import annotations

import os

import pytest
import torch

from fused_stable.bench.contenders import contenders_for
from fused_stable.bench.measure import bytes_per_step, synchronize
from fused_stable.bench.paramsets import materialize, plan_sets

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PLAN = os.environ.get("FUSED_STABLE_BENCH_PLAN") or ("gpu" if DEVICE.type == "cuda" else "cpu")
SETS = plan_sets(PLAN, float(os.environ.get("FUSED_STABLE_BENCH_SCALE", "1.0")))
CASES = [
    pytest.param(spec, c, id=f"{spec.name}-{c.key}")
    for spec in SETS
    for c in contenders_for(spec.family)
    if not c.isolated
]


@pytest.mark.benchmark
@pytest.mark.parametrize(("spec", "contender"), CASES)
def test_step(benchmark, spec, contender):
    device = DEVICE
    reason = contender.unavailable(device)
    if reason:
        pytest.skip(reason)
    params = materialize(spec, device)
    before = [p.detach().clone() for p in params[:4]]
    built = contender.build(params, device)

    def step():
        built.step()
        synchronize(device)  # CUDA: time the work, not the launch

    benchmark.group = spec.name
    rounds = 10 if device.type == "cpu" else 50
    benchmark.pedantic(step, rounds=rounds, warmup_rounds=3, iterations=1)

    nbytes = bytes_per_step(contender.passes, params, built.optimizer)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        contender=contender.label,
        backend=built.backend,
        n_params=spec.n_params,
        n_tensors=spec.n_tensors,
        bytes_per_step=nbytes,
        bytes_per_param=nbytes / spec.n_params,
        gbps=nbytes / median / 1e9,
    )
    # the timed calls really stepped: params moved and stayed finite
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, params))
    assert all(torch.isfinite(p.detach().float()).all() for p in params[:4])
