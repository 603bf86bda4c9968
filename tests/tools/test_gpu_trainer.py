"""benchmarks/gpu_trainer.py checked on CPU: its plan (the real architectures' sizes), its refusal without CUDA,
the host-sync recorder's bookkeeping, the goal checks, and a dry run with the tiny sizes end to end (a recipe with
its resume and chat checks, a throughput row with both trainers on the same job)."""

from __future__ import annotations

import json
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_trainer  # noqa: E402


def test_plan_names_every_recipe_and_the_real_architectures_sizes(capsys):
    assert gpu_trainer.main(["--plan"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert list(plan["recipes"]) == ["lora-bf16", "qlora-nf4", "dora-bf16", "loraplus-bf16", "lora-fp16", "full-bf16"]
    assert plan["recipes"]["qlora-nf4"]["needs"] == "bitsandbytes"
    assert all(r["steps"] == 20 for r in plan["recipes"].values())
    rows = {r["row"]: r for r in plan["throughput"]["rows"]}
    assert set(rows) == {"smollm2-360m-lora", "smollm2-360m-full", "llama-3.2-1b-lora", "llama-3.2-1b-full"}
    # the published sizes of SmolLM2-360M and Llama-3.2-1B
    assert rows["smollm2-360m-full"]["params"] == 361_821_120
    assert rows["llama-3.2-1b-full"]["params"] == 1_235_814_400
    job = plan["throughput"]["job"]
    assert (job["seq_len"], job["precision"], job["lora"]["lora_r"], job["lora"]["target_modules"]) == (
        1024,
        "bf16",
        16,
        "all-linear",
    )
    # the interrupted run stops at a logging step after its mid-run checkpoint
    recipe_job = plan["recipe_job"]
    assert recipe_job["save_steps"] < recipe_job["stopped_at"] < 20
    assert recipe_job["stopped_at"] % recipe_job["logging_steps"] == 0


def test_parameter_counts_match_the_models_built_from_the_configs():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    for arch in gpu_trainer.TINY_ARCHS.values():
        counts = gpu_trainer.llama_param_counts(arch, 16)
        model = LlamaForCausalLM(LlamaConfig(**arch))
        assert sum(p.numel() for p in model.parameters()) == counts["total"]
        lora = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear", task_type="CAUSAL_LM"))
        assert sum(p.numel() for p in lora.parameters() if p.requires_grad) == counts["lora"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_cuda_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert gpu_trainer.main(["--device", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--device cpu" in err
    assert not out.exists()


def test_bad_options_are_refused(capsys):
    for argv in (["--device", "tpu", "--plan"], ["--device", "cpu", "--size", "full", "--plan"], ["--rows", "x"]):
        with pytest.raises(SystemExit) as exc:
            gpu_trainer.main(argv)
        assert exc.value.code == 2, argv


def _code_in(path: str, source: str):
    """Functions whose frames report `path` as their file (a stand-in for a library's code)."""
    namespace = {"warnings": warnings}
    exec(compile(source, path, "exec"), namespace)
    return namespace


def test_sync_recorder_sorts_syncs_by_phase_and_origin():
    """A fake loop in the order fit() calls things: a window's batches, the optimizer step, the logging read.
    Syncs are "warned" from code that claims to live in fused_stable or transformers."""
    sync = f"warnings.warn({gpu_trainer.SYNC_MESSAGE!r})"
    trainer_code = _code_in(str(ROOT / "fused_stable" / "train" / "run" / "loop.py"), f"def read():\n    {sync}\n")
    model_code = _code_in("/x/site-packages/transformers/masking_utils.py", f"def fast_all():\n    {sync}\n")
    trainer = types.SimpleNamespace(
        state=types.SimpleNamespace(step=0),
        logging_steps=2,
        save_steps=0,
        total_steps=4,
        batches=types.SimpleNamespace(batch=lambda k: k),
        optimizer=types.SimpleNamespace(step=lambda: None),
    )
    recorder = gpu_trainer.SyncRecorder(torch.device("cpu"), listening=True)
    recorder.track(types.SimpleNamespace(trainer=trainer))
    with recorder:
        for step in range(1, 5):
            trainer.batches.batch(step)
            model_code["fast_all"]()  # the model's own sync in its forward: every step
            if step == 1:
                trainer_code["read"]()  # the first step's (the optimizer builds its plan there): apart
            if step == 3:
                trainer_code["read"]()  # a trainer sync between logging steps: the bug the check is for
            trainer.optimizer.step()
            trainer.state.step = step
            if step % 2 == 0:
                trainer_code["read"]()  # the logging step's read
    summary = recorder.summary()
    assert summary["checked"]
    assert summary["between_logs_model"] == 4
    assert summary["between_logs_trainer"] == 1 and summary["first_step_trainer"] == 1
    assert summary["at_logging_steps"] == 2
    wheres = {s["where"] for s in summary["sites"]}
    assert any(w.startswith("fused_stable/train/run/loop.py") for w in wheres)
    assert any(w.startswith("transformers/masking_utils.py") for w in wheres)
    # other warnings pass through untouched
    with pytest.warns(UserWarning, match="unrelated"), recorder:
        warnings.warn("unrelated", UserWarning, stacklevel=1)


def test_weights_compare_bitwise():
    a = {"w": torch.tensor([1.0, 2.0])}
    assert gpu_trainer.compare_weights(a, {"w": torch.tensor([1.0, 2.0])}) == {"identical": True, "max_abs_diff": 0.0}
    diff = gpu_trainer.compare_weights(a, {"w": torch.tensor([1.0, 2.5])})
    assert diff == {"identical": False, "max_abs_diff": 0.5}
    assert not gpu_trainer.compare_weights(a, {"v": torch.tensor([1.0, 2.0])})["identical"]


def _throughput_result(ours_tps, hf_tps, ours_mib, hf_mib):
    by = {
        "fused_stable": {"tokens_per_s": ours_tps, "peak_mib": ours_mib},
        "hf_trainer": {"tokens_per_s": hf_tps, "peak_mib": hf_mib},
    }
    return {"throughput": {"rows": {"r": {"by_contender": by}}}}


@pytest.mark.parametrize(
    "ours_tps, hf_tps, ours_mib, hf_mib, speed_met, memory_met",
    [(110, 100, 900, 1000, True, True), (100, 100, 1000, 1000, True, True), (99, 100, 1001, 1000, False, False)],
)
def test_throughput_goals(ours_tps, hf_tps, ours_mib, hf_mib, speed_met, memory_met):
    met = {g["goal"]: g["met"] for g in gpu_trainer.goals(_throughput_result(ours_tps, hf_tps, ours_mib, hf_mib))}
    assert met == {"r: tokens/s >= HF Trainer": speed_met, "r: peak memory <= HF Trainer": memory_met}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run; on a GPU gpu_check.sh runs the real one")
def test_dry_run_on_cpu_end_to_end(tmp_path, capsys):
    """One recipe (LoRA with fp16 AMP: the GradScaler path) and one throughput row with both trainers."""
    argv = ["--device", "cpu", "--out", str(tmp_path), "--name", "dry"]
    argv += ["--recipes", "lora-fp16", "--rows", "smollm2-360m-lora"]
    assert gpu_trainer.main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "dry.json").read_text())
    markdown = (tmp_path / "dry.md").read_text()
    assert "## Recipes" in markdown and "## Throughput" in markdown and markdown in printed

    (recipe,) = result["recipes"]["rows"]
    assert recipe["status"] == "ok", recipe
    assert recipe["resumed_from"] == "step-2" and recipe["resume"]["stopped_at"] == 3
    assert recipe["resume"]["identical"] and recipe["repeat"]["identical"]  # CPU: bit for bit
    assert recipe["chat"]["exit_code"] == 0 and recipe["chat"]["loaded_trained_weights"]
    assert recipe["host_syncs"]["checked"] is False  # needs CUDA

    row = result["throughput"]["rows"]["smollm2-360m-lora"]
    assert [g["contender"] for g in row["segments"]] == ["fused_stable", "hf_trainer"]
    assert row["same_initial_weights"]
    ours, hf = row["segments"]
    for segment in (ours, hf):
        assert segment["padding_free"] and segment["timed_steps"] == 2 and segment["tokens_per_s"] > 0
        assert segment["trainable_params"] == row["trainable"]  # the plan's count is the model's
        assert 0 < segment["optimizer_share"] < 1
    assert ours["skipped_steps"] == 0
    # the same job: the same model, batches, schedule and clip give the same losses
    assert ours["mean_loss"] == pytest.approx(hf["mean_loss"], rel=1e-5)
    goals = {g["goal"] for g in result["goals"]}
    assert "smollm2-360m-lora: tokens/s >= HF Trainer" in goals and "lora-fp16: resume = uninterrupted run" in goals


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch's sync debug mode")
def test_sync_recorder_catches_a_real_cuda_sync():
    """On a GPU: torch's own sync warning reaches the recorder with the Python stack of the sync."""
    sync = "def read(t):\n    return t.sum().item()\n"
    trainer_code = _code_in(str(ROOT / "fused_stable" / "train" / "run" / "loop.py"), sync)
    x = torch.ones(1024, device="cuda")
    recorder = gpu_trainer.SyncRecorder(torch.device("cuda"))
    recorder.phase, recorder.step = "step", 1  # between logging steps, after the first step
    with recorder:
        assert trainer_code["read"](x) == 1024.0
        x.mul_(2)  # no sync
    summary = recorder.summary()
    assert summary["between_logs_trainer"] == 1, summary
    assert summary["sites"][0]["where"].startswith("fused_stable/train/run/loop.py:2 read")
    assert torch.cuda.get_sync_debug_mode() == 0  # restored
