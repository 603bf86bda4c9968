"""The guard's evaluation checks inside `fused-stable sft` (docs/guard.md, "What is watched"), on a real rise of
the tiny Llama's retention_loss: for five optimizer steps the lr is 100x (a fault keyed by the data position, as
the blow-ups of test_guard_trainer.py are), which moves the model away from its base's own answers (retention
1.00x -> 1.62x of the step-5 value at step 15, measured on the tiny model of 320-wide MLPs with the 30-step
schedule; 50x reached only 1.294x there, under the 1.3 factor) while the training loss and the gradients stay
unremarkable. Each
policy answers it: warn and skip warn, stop checkpoints and exits 3, rollback returns to the last checkpoint
whose evaluation passed, halves the lr and does not replay the window. A clean run with both losses measured
raises nothing (test_guard_trainer.py's 200-step run)."""

from __future__ import annotations

import json

import pytest
from test_guard_trainer import FAST

from fused_stable.train.run import checkpoint, sft
from fused_stable.train.run.report import read_alerts, read_metrics

SPIKE = 100.0  # the lr multiplier inside the fault window
WINDOW = range(10, 15)  # micro-batches 10-14: steps 11-15 (grad_accum 1)
# warm-up pinned at 3 steps (ceil(0.1 x 30) is 4 in floating point): the fault window and the steps its rise is
# seen at below were measured with it
EVALUATED = [*FAST, "--retention_probe", "on", "--val_size", "16", "--eval_steps", "5", "--threads", "1"]
EVALUATED += ["--warmup_steps", "3"]


def lr_spike(setup, window=WINDOW, factor=SPIKE):
    """Every group's lr x `factor` while the micro-batch being consumed is in `window` (the guard's own lr scale
    kept), set before each forward."""
    trainer, opt = setup.trainer, setup.trainer.optimizer

    def before_forward(module, args):
        scale = factor if trainer.state.micro_batches in window else 1.0
        for group, base in zip(opt.param_groups, trainer.guard.base_lrs):
            group["lr"] = base * trainer.guard.lr_scale * scale

    setup.model.register_forward_pre_hook(before_forward)
    return setup


def run_spiked(monkeypatch, capsys, argv):
    original = sft.setup_run
    monkeypatch.setattr(sft, "setup_run", lambda a: lr_spike(original(a)))
    code = sft.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def evaluated(out) -> dict:
    return {r["step"]: r["retention_loss"] for r in read_metrics(str(out)) if "retention_loss" in r}


@pytest.mark.parametrize("policy", ["warn", "skip"])
def test_warn_and_skip_warn_on_a_real_retention_rise(monkeypatch, capsys, tmp_path, policy):
    out = tmp_path / policy
    code, stdout, err = run_spiked(
        monkeypatch, capsys, [*EVALUATED, "--max_steps", 30, "--guard", policy, "--output_dir", out]
    )
    assert code == 0, err
    alerts = read_alerts(str(out))
    assert {a["kind"] for a in alerts} == {"retention_loss_rise"}  # nothing else noticed the fault
    first = alerts[0]
    assert (first["step"], first["detected_at"], first["action"]) == (15, 15, "warn")
    assert [a["step"] for a in alerts] == [15, 20, 25, 30]  # the model stays where the fault took it: warned again
    retention = evaluated(out)
    start = retention[5]  # before the fault
    assert first["value"] > first["threshold"] == 1.3 and retention[15] > 1.3 * start
    assert "retention loss rose to" in stdout
    assert [r["step"] for r in read_metrics(str(out))] == list(range(1, 31))  # nothing skipped, nothing undone


def test_stop_checkpoints_and_exits_3_on_a_real_retention_rise(monkeypatch, capsys, tmp_path):
    out = tmp_path / "stop"
    code, _, err = run_spiked(
        monkeypatch, capsys, [*EVALUATED, "--max_steps", 30, "--guard", "stop", "--output_dir", out]
    )
    assert code == 3 and "stopped at step 15" in err and "--resume latest" in err
    assert [(a["kind"], a["step"], a["action"]) for a in read_alerts(str(out))] == [("retention_loss_rise", 15, "stop")]
    assert checkpoint.latest_checkpoint(str(out)).endswith("step-15")


def test_rollback_returns_to_the_last_checkpoint_whose_evaluation_passed(monkeypatch, capsys, tmp_path):
    """Checkpoints every 5 steps, evaluations every 10: under rollback every checkpoint is evaluated first, and
    the step-15 one (after the fault) fails, so it is not written and the run goes back to step 10."""
    out = tmp_path / "rollback"
    argv = [*EVALUATED, "--eval_steps", 10, "--save_steps", 5, "--max_steps", 25, "--guard", "rollback"]
    code, stdout, err = run_spiked(monkeypatch, capsys, [*argv, "--output_dir", out])
    assert code == 0, err
    alerts = read_alerts(str(out))
    assert [(a["kind"], a["step"], a["action"]) for a in alerts] == [("retention_loss_rise", 15, "rollback")]
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == list(range(1, 26))  # rewound to step 10, then continued
    retention = {r["step"]: r["retention_loss"] for r in rows if "retention_loss" in r}
    assert sorted(retention) == [5, 10, 15, 20, 25]  # the failed step-15 evaluation was rewound with its row
    # the window is not replayed and the lr cut by guard_eval_lr_factor (0.25): the model stays near its base
    assert max(retention.values()) < 1.1 * retention[5]
    state = json.loads((out / "checkpoints" / "step-15" / "trainer_state.json").read_text())
    assert state["rollbacks"] == 1 and state["guard"]["lr_scale"] == 0.25
    assert state["micro_batches"] == 20  # steps 11-15 replayed on micro-batches 15-19, the fault window skipped
    best = min(state["eval_start"]["retention_loss"], *retention.values())  # the model before its first step too
    assert state["guard"]["best_eval"]["retention_loss"] == pytest.approx(best, rel=1e-6)
    # the rollback forgot the undone step-15 evaluation's bests: the history is the kept model's
    assert [step for step, _ in state["guard"]["eval_history"]] == [0, 5, 10, 15]
