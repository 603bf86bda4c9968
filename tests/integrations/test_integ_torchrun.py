"""The torchrun path the trainer uses: 2 CPU ranks under `torchrun --standalone` (its own free port),
process group from the environment, DDP for adapters / FSDP2 for full, each rank its data shard,
metrics and the checkpoint written by rank 0 only."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from integ_models import tiny_llama

from fused_stable.integrations import distributed as fused_distributed

SCRIPT = Path(__file__).with_name("integ_torchrun_script.py")


@pytest.mark.parametrize("tuner, wrapper", [("lora", "DistributedDataParallel"), ("full", "FSDPLlamaForCausalLM")])
def test_torchrun_two_ranks(tmp_path, tuner, wrapper):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        str(tmp_path),
        tuner,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world_size"], r["main"]) for r in ranks] == [(0, 2, True), (1, 2, False)]
    assert all(r["wrapped"] == wrapper and r["rows"] == 8 for r in ranks)  # 16 rows, 8 per rank
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert len(metrics["losses"]) == 2 and all(math.isfinite(x) for x in metrics["losses"])
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    if tuner == "full":  # rank 0's checkpoint is the whole unsharded model, loadable as is
        tiny_llama().load_state_dict(state, strict=True)
    else:
        assert any("lora_A" in k for k in state)


def test_single_process_without_torchrun_env(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    info = fused_distributed.init_distributed_from_env()
    assert (info.rank, info.world_size, info.is_distributed) == (0, 1, False)
    assert fused_distributed.is_main_process()
    model = torch.nn.Linear(2, 2)
    assert fused_distributed.wrap_model(model, "full") is model
    assert fused_distributed.shard_data([1, 2, 3]) == [1, 2, 3]


def test_torchrun_env_errors(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        fused_distributed.init_distributed_from_env()


def test_shard_data_equal_counts():
    items = list(range(7))
    shards = [fused_distributed.shard_data(items, r, 2) for r in range(2)]
    assert shards == [[0, 2, 4], [1, 3, 5]]  # the odd one out is dropped: equal step counts
    with pytest.raises(ValueError, match="rank"):
        fused_distributed.shard_data(items, 2, 2)
    with pytest.raises(ValueError, match="at least one"):
        fused_distributed.shard_data([1], 0, 2)
