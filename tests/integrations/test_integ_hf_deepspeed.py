"""The HF Trainer's `TrainingArguments(deepspeed=...)` path with FusedAdamW (FusedStableTrainerMixin), as
LLaMA-Factory and ms-swift use it: the config goes through `prepare_config` before transformers builds the engine
(its "auto" gradient_clipping, filled with max_grad_norm, becomes 0: the clip is FusedAdamW's), the integration is
attached before the first step, and 2 gloo ranks at ZeRO-2 and ZeRO-3 train like the same Trainer without DeepSpeed
(DDP): the same losses, pre-clip grad norms and lr per step and the same weights, with `applied_steps` the engine's
step count. Real processes (torchrun), DeepSpeed on the CPU; not installed is a failure, not a skip."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("integ_hf_deepspeed_script.py")
EXTENSIONS_DIR = Path(tempfile.gettempdir()) / "fused_stable_deepspeed_extensions"  # integ_deepspeed.py's build


def run(mode: str, stage: int, out: Path) -> dict:
    clean = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in clean}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(EXTENSIONS_DIR))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
    proc = subprocess.run([*cmd, mode, str(stage), str(out)], env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def without_deepspeed(tmp_path_factory):
    return run("ddp", 0, tmp_path_factory.mktemp("hf") / "ddp.pt")


@pytest.mark.parametrize("stage", [2, 3])
def test_hf_trainer_deepspeed_config_trains_like_ddp(without_deepspeed, stage, tmp_path):
    ours = run("deepspeed", stage, tmp_path / "ds.pt")
    assert ours["attached"] and ours["stage"] == stage
    assert ours["gradient_clipping"] == 0  # prepare_config ran before the engine was built
    steps = ours["global_step"]
    assert steps == 4 and ours["applied"] == ours["engine_steps"] == steps  # one decision per engine step
    reference = without_deepspeed
    assert len(ours["log"]) == len(reference["log"]) == steps
    for (loss, norm, lr), (ref_loss, ref_norm, ref_lr) in zip(ours["log"], reference["log"]):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-5) and norm > 0.5  # pre-clip, and every step clipped
        assert lr == pytest.approx(ref_lr, rel=1e-6)
    for ours_p, ref_p in zip(ours["params"], reference["params"]):
        torch.testing.assert_close(ours_p, ref_p, rtol=1e-5, atol=1e-6)
