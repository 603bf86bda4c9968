"""benchmarks/rules_step.py (issue 35 item 7): the rule axis of the CPU benchmark runs and writes its rows; the
smoke plan here, for the code path (the figures come from a quiet run: docs/benchmarks.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import rules_step  # noqa: E402


def test_the_rules_benchmark_writes_a_row_per_set_and_rule(tmp_path):
    threads = torch.get_num_threads()
    try:
        assert rules_step.main(["--plan", "smoke", "--budget", "0.05", "--threads", "1", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    (result,) = tmp_path.glob("rules-step-*.json")
    saved = json.loads(result.read_text())
    rows = saved["rows"]
    # the variables that chose Newton-Schulz's dtype and products are kept (the suite pins bf16: conftest.py)
    assert saved["meta"]["environment"]["FUSED_STABLE_NEWTON_SCHULZ"] == "bf16"
    assert [(r["set"], r["rule"]) for r in rows] == [
        ("dense-fp32", "lion"),
        ("dense-fp32", "muon"),
        ("lora-fp32", "lion"),
        ("lora-fp32", "muon"),
    ]
    for row in rows:
        fused, reference = (v for k, v in row.items() if k.endswith("_ms"))
        assert fused > 0 and reference > 0 and abs(row["ratio"] - fused / reference) < 1e-9
    assert "| lora-fp32 | muon |" in result.with_suffix(".md").read_text()


def test_the_muon_split_keeps_the_embedding_and_head_on_adamw():
    from fused_stable.bench.paramsets import materialize, plan_sets

    dense = next(s for s in plan_sets("smoke") if s.name == "dense-fp32")
    params = materialize(dense, torch.device("cpu"))
    muon, rest = rules_step._muon_split(params, "dense")
    largest = sorted((p for p in params if p.dim() == 2), key=lambda p: p.numel())[-2:]
    assert all(any(p is q for q in rest) for p in largest)
    assert all(p.dim() == 2 for p in muon) and len(muon) + len(rest) == len(params)
