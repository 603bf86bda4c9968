"""`report_to`: tensorboard (the default), wandb (offline with no network, the HF Trainer's series names),
none."""

import os

import pytest
from sft_helpers import TINY

from fused_stable.train.config.resolve import resolve_config
from fused_stable.train.run import report

RUN = [*TINY, "--max_steps", "2", "--logging_steps", "1", "--save_steps", "0", "--evaluation", "off"]


def test_report_to_choices_and_what_each_writes(tmp_path):
    from fused_stable.train.run.setup import run_entries

    for value, tensorboard, wandb in (("tensorboard", True, False), ("wandb", False, True), ("none", False, False)):
        cfg, _ = resolve_config(["--report_to", value])
        entries = run_entries(cfg)
        assert ("tensorboard" in entries, "wandb" in entries) == (tensorboard, wandb), value
    with pytest.raises(Exception, match="report_to must be one of tensorboard | wandb | none"):
        resolve_config(["--report_to", "mlflow"])


def test_wandb_series_use_the_hf_trainers_names():
    row = {"step": 3, "loss": 2.5, "grad_norm": 4.0, "lr": 1e-3, "skipped": False, "skipped_total": 1}
    row["tokens_per_s"] = 100.0
    assert report.wandb_row(row, max_grad_norm=1.0) == {
        "train/loss": 2.5,
        "train/grad_norm": 4.0,
        "train/learning_rate": 1e-3,
        "fused_stable/clipped": 1,
        "fused_stable/skipped": 0,
        "fused_stable/skipped_total": 1,
        "fused_stable/tokens_per_s": 100.0,
    }


class FakeRun:
    def __init__(self):
        self.logged, self.finished = [], False

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def test_a_run_logs_every_step_to_wandb(sft, tmp_path, monkeypatch):
    run = FakeRun()
    started = []
    monkeypatch.setattr(report, "start_wandb", lambda out, config: started.append((out, config)) or run)
    code, _, err = sft(*RUN, "--report_to", "wandb", "--output_dir", tmp_path / "out")
    assert code == 0, err
    assert started[0][0] == str(tmp_path / "out") and started[0][1]["report_to"] == "wandb"
    assert [step for step, _ in run.logged] == [1, 2] and run.finished
    assert {"train/loss", "train/grad_norm", "train/learning_rate"} <= set(run.logged[-1][1])
    assert not (tmp_path / "out" / "tensorboard").exists()


def test_wandb_offline_needs_no_network(sft, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "out"
    code, _, err = sft(*RUN, "--report_to", "wandb", "--output_dir", out)
    assert code == 0, err
    runs = [name for name in os.listdir(out / "wandb") if name.startswith("offline-run-")]
    assert len(runs) == 1
    assert any(name.endswith(".wandb") for name in os.listdir(out / "wandb" / runs[0]))


def test_evaluations_reach_wandb_under_the_hf_trainers_eval_names(sft, tmp_path, monkeypatch):
    """The held-out loss before the first step (step 0) and at each evaluation, as `eval/loss`."""
    run = FakeRun()
    monkeypatch.setattr(report, "start_wandb", lambda out, config: run)
    argv = [*RUN, "--max_steps", "4", "--val_size", "8", "--eval_steps", "2", "--report_to", "wandb"]
    code, _, err = sft(*argv, "--output_dir", tmp_path / "out")
    assert code == 0, err
    evaluated = [step for step, values in run.logged if "eval/loss" in values]
    assert evaluated == [0, 2, 4], run.logged
    assert all(values["eval/loss"] > 0 for _, values in run.logged if "eval/loss" in values)


def test_the_quiet_reporter_of_other_ranks_has_every_method_of_the_reporter():
    from fused_stable.train.run.report import QuietReporter, Reporter

    public = {name for name in vars(Reporter) if not name.startswith("_")}
    assert public and public == {name for name in vars(QuietReporter) if not name.startswith("_")}
