"""The stability guard inside `fused-stable sft`: each policy acts on a real blow-up of the tiny Llama's logits,
no false alarms over a normal 200-step run (its held-out and retention losses measured too), stop -> exit code
3 -> --resume latest, and a rollback restores exactly the checkpointed state (weights, optimizer moments and
counters, lr x factor). The evaluation alerts on a real rise: test_guard_trainer_eval.py."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from fused_stable import schedules
from fused_stable.train.run import checkpoint, sft
from fused_stable.train.run.report import read_alerts, read_metrics

FAST = [
    "--model",
    "tiny",
    "--dataset",
    "arithmetic",
    "--arithmetic_examples",
    "64",
    "--lr",
    "2e-4",
    "--target_modules",
    "q_proj,v_proj",
    "--lora_dropout",
    "0.05",
    "--batch_size",
    "2",
    "--grad_accum",
    "1",
    "--max_length",
    "96",
    "--tensorboard",
    "false",
    "--logging_steps",
    "5",
    "--save_steps",
    "10",
]
# the grad-norm statistics warm up over 25 steps: faults come after that. With grad_accum 1, micro-batch k is
# consumed by step k + 1 (until a rollback makes the two part ways)
FAULT_BATCH = 32
FAULT_STEP = FAULT_BATCH + 1


def blow_up(setup, batches, factor=1e3):
    """A real numerical blow-up on bad data: on the given micro-batches (data positions) the model's logits are
    multiplied by `factor`, as a diverging layer would, which makes that step's gradient ~factor times larger."""
    trainer = setup.trainer

    def hook(module, inputs, output):
        return output * factor if trainer.state.micro_batches in batches else output

    setup.model.get_output_embeddings().register_forward_hook(hook)
    return setup


def run_cli(monkeypatch, capsys, argv, fault_batches=(), factor=1e3):
    original = sft.setup_run
    monkeypatch.setattr(sft, "setup_run", lambda a: blow_up(original(a), set(fault_batches), factor))
    code = sft.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def metrics(out):
    return read_metrics(str(out))


def test_no_false_alarms_over_a_normal_200_step_run(monkeypatch, capsys, tmp_path):
    out = tmp_path / "clean"
    code, stdout, err = run_cli(
        monkeypatch,
        capsys,
        [
            *FAST,
            "--max_steps",
            200,
            "--save_steps",
            0,
            "--logging_steps",
            10,
            "--guard",
            "rollback",
            "--val_size",
            16,
            "--retention_probe",
            "on",
            "--eval_steps",
            20,
            "--output_dir",
            out,
        ],
    )
    assert code == 0, err
    assert read_alerts(str(out)) == [] and "guard:" not in stdout
    rows = metrics(out)
    assert len(rows) == 200 and not any(r["skipped"] for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    # the held-out and retention losses were watched all along (their worst rise here: docs/guard.md)
    assert [r["step"] for r in rows if "eval_loss" in r and "retention_loss" in r] == list(range(20, 201, 20))


def test_warn_records_the_spike_with_its_tensors(monkeypatch, capsys, tmp_path):
    out = tmp_path / "warn"
    code, stdout, err = run_cli(
        monkeypatch,
        capsys,
        [*FAST, "--max_steps", 40, "--tensorboard", "true", "--output_dir", out],
        fault_batches=[FAULT_BATCH],
    )
    assert code == 0, err
    alerts = read_alerts(str(out))
    spike = [a for a in alerts if a["kind"] == "grad_spike"]
    assert len(spike) == 1 and spike[0]["step"] == FAULT_STEP and spike[0]["action"] == "warn"
    assert spike[0]["value"] > spike[0]["threshold"] == 6.0
    names = [t["name"] for t in spike[0]["top_tensors"]]
    assert len(names) == 5 and all("lora_" in n for n in names)  # by name, from the per-tensor norms
    assert f"guard: step {FAULT_STEP}: grad-norm spike" in stdout
    assert os.path.isfile(out / "curves.png")
    assert not metrics(out)[FAULT_STEP - 1]["skipped"]  # warn: the step was applied (clipped)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("guard/grad_spike")] == [FAULT_STEP]


def test_skip_policy_skips_the_spiking_step(monkeypatch, capsys, tmp_path):
    out = tmp_path / "skip"
    code, _, err = run_cli(
        monkeypatch,
        capsys,
        [*FAST, "--max_steps", 40, "--guard", "skip", "--output_dir", out],
        fault_batches=[FAULT_BATCH],
    )
    assert code == 0, err
    rows = metrics(out)
    assert [r["step"] for r in rows if r["skipped"]] == [FAULT_STEP]
    spike = next(a for a in read_alerts(str(out)) if a["kind"] == "grad_spike")
    assert spike["action"] == "skipped"


def test_stop_policy_checkpoints_exits_3_and_resumes(monkeypatch, capsys, tmp_path):
    out = tmp_path / "stop"
    code, _, err = run_cli(
        monkeypatch,
        capsys,
        [*FAST, "--max_steps", 45, "--guard", "stop", "--output_dir", out],
        fault_batches=[FAULT_BATCH],
    )
    assert code == 3
    assert "stopped at step 35" in err and "--resume latest" in err  # detected at the next logging step
    assert checkpoint.latest_checkpoint(str(out)).endswith("step-35")
    assert [a["action"] for a in read_alerts(str(out)) if a["kind"] == "grad_spike"] == ["stop"]
    assert not os.path.exists(out / "adapter")  # the run is not finished
    code, stdout, err = run_cli(monkeypatch, capsys, ["--output_dir", out, "--resume", "latest"])
    assert code == 0, err
    assert [r["step"] for r in metrics(out)] == list(range(1, 46))
    assert os.path.exists(out / "adapter")


def test_rollback_restores_lowers_the_lr_skips_the_window_then_gives_up(monkeypatch, capsys, tmp_path):
    out = tmp_path / "rollback"
    # skip_z out of reach: the spikes get through the optimizer, so only a rollback can undo them
    argv = [
        *FAST,
        "--max_steps",
        50,
        "--guard",
        "rollback",
        "--guard_skip_z",
        1e9,
        "--guard_max_rollbacks",
        1,
        "--output_dir",
        out,
    ]
    code, stdout, err = run_cli(monkeypatch, capsys, argv, fault_batches=[FAULT_BATCH, 43])
    assert code == 3 and "gave up" in err and "max_rollbacks=1" in err
    actions = [(a["step"], a["detected_at"], a["action"]) for a in read_alerts(str(out)) if a["kind"] == "grad_spike"]
    # batch 32 spikes at step 33, seen at step 35: back to the step-30 checkpoint, data position kept at 35
    # (batches 30-34 are not replayed); batch 43 then comes at step 30 + (43 - 35) + 1 = 39: no rollback left
    assert actions == [(FAULT_STEP, 35, "rollback"), (39, 40, "give_up")]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 41))  # metrics rewound to the checkpoint, then continued
    state = json.loads((out / "checkpoints" / "step-40" / "trainer_state.json").read_text())
    assert state["rollbacks"] == 1 and state["guard"]["lr_scale"] == 0.5
    assert state["micro_batches"] == 45  # 40 steps of progress, 5 skipped micro-batches
    before = [r["lr"] for r in rows if r["step"] == 30][0]
    after = [r["lr"] for r in rows if r["step"] == 31][0]
    cosine = schedules.warmup_cosine(50, 5)  # the cosine moves one step on, the rollback halves the lr
    assert after / before == pytest.approx(0.5 * cosine.factor(30) / cosine.factor(29), rel=1e-5)


def test_rollback_restores_exactly_the_checkpointed_state(tmp_path):
    out = tmp_path / "exact"
    setup = sft.setup_run([str(a) for a in [*FAST, "--max_steps", 10, "--guard", "rollback", "--output_dir", out]])
    setup.start()
    try:
        setup.trainer.fit()
    finally:
        setup.trainer.reporter.close()
    trainer, opt = setup.trainer, setup.trainer.optimizer
    path = checkpoint.latest_checkpoint(str(out))
    saved_weights = load_file(os.path.join(path, "weights.safetensors"))
    saved_opt = torch.load(os.path.join(path, "optimizer.pt"), weights_only=True)
    # wreck the live state: weights, moments, counters and lr
    with torch.no_grad():
        for p in setup.model.parameters():
            if p.requires_grad:
                p.mul_(3.0)
                p.grad = torch.randn_like(p)
    opt.step()
    for group in opt.param_groups:
        group["lr"] = 1.0
    trainer.rollback()
    trainer.guard.apply_rollback(opt, cut_lr=True)
    params = dict(setup.model.named_parameters())
    for name, value in saved_weights.items():
        assert torch.equal(params[name].detach(), value), name
    live = opt.state_dict()
    for key, state in saved_opt["state"].items():
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(live["state"][key][field], state[field]), (key, field)
    assert torch.equal(live["fused_stable"]["istate"], saved_opt["fused_stable"]["istate"])
    # the saved base lr (state_dict saves it as "lr"), halved; the groups show the schedule's lr of it
    assert opt.base_lrs() == [0.5 * g["lr"] for g in saved_opt["param_groups"]]
    assert trainer.state.step == 10 and trainer.state.rollbacks == 1 and trainer.guard.rollbacks == 1


def test_guard_state_travels_in_checkpoints(monkeypatch, capsys, tmp_path):
    out = tmp_path / "state"
    code, _, err = run_cli(monkeypatch, capsys, [*FAST, "--max_steps", 30, "--output_dir", out])
    assert code == 0, err
    state = json.loads((out / "checkpoints" / "step-30" / "trainer_state.json").read_text())
    guard = state["guard"]
    assert guard["loss_stats"]["count"] == 30 and guard["rollbacks"] == 0 and guard["lr_scale"] == 1.0
    assert math.isfinite(guard["loss_stats"]["mean"]) and guard["best_interval_loss"] > 0


def test_bad_guard_keys_are_one_line_errors(capsys):
    for argv, message in (
        (["--guard", "panic"], "guard must be one of warn | skip | stop | rollback"),
        (["--guard_lr_factor", "2"], "guard_lr_factor must be in (0, 1]"),
        (["--clip", "soft"], "clip must be one of fixed | zscore"),
    ):
        assert sft.main(argv) == 2
        assert message in capsys.readouterr().err
