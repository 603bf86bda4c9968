"""Smoke test of benchmarks/cpu_step.py (the CPU step against torch's and DeepSpeed's): one tiny set, one run,
the JSON and markdown it writes, and the bytes model it reports for each contender."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fused_stable.backends.torch import cpu_ops

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(tmp_path, contenders: str, regime: str) -> dict:
    """benchmarks/cpu_step.py once on the tiny set, one thread: its summary rows by contender (r.json, r.md)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_step.py"), "--runs", "1", "--threads", "1", "--sets",
         "tiny-6", "--regimes", regime, "--contenders", contenders, "--out", str(tmp_path), "--name", "r"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return {r["contender"]: r for r in json.loads((tmp_path / "r.json").read_text())["summary"]}


@pytest.mark.skipif(not cpu_ops.available(), reason="the compiled CPU ops could not be built here")
def test_cpu_step_benchmark_writes_its_table(tmp_path):
    contenders = "fused_stable,fused_stable_torch_ops,torch_fused"
    rows = run_benchmark(tmp_path, contenders, "clipped")
    assert set(rows) == set(contenders.split(","))
    # the compiled update reads the clipped grads without writing them; torch's CPU _fused_adamw_ writes them
    assert [rows[c]["bytes_per_param"] for c in contenders.split(",")] == [32, 36, 40]
    assert rows["torch_fused"]["ratio_min"] == rows["torch_fused"]["ratio_max"] == 1.0
    assert all(r["median_ms"] > 0 for r in rows.values())
    table = (tmp_path / "r.md").read_text()
    assert table.count("| tiny-6 | clipped | 1 |") == 3


@pytest.mark.skipif(not cpu_ops.available(), reason="the compiled CPU ops could not be built here")
def test_cpu_step_benchmark_has_the_precision_axis(tmp_path):
    """bf16 and 8-bit state rows beside fp32's, against torch's fp32-state clip + fused AdamW (issue 36 item 2),
    with their bytes models: 24 and 20.125 B/param for fp32 params."""
    contenders = "fused_stable,fused_stable_bf16,fused_stable_8bit,torch_fused"
    rows = run_benchmark(tmp_path, contenders, "unclipped")
    assert [rows[c]["bytes_per_param"] for c in contenders.split(",")] == [32, 24, 20.125, 40]
    assert all(r["median_ms"] > 0 for r in rows.values())
