"""`fused-stable sft --optim` (issue 35 item 6): the run trains with the rule it names (train/run/optimizers.py),
says so in its header, keeps that rule's state in its checkpoints and refuses to resume with another; `muon`
is refused in one line, before the model loads, while fused_stable has no FusedMuon."""

import os

import pytest
import torch
import yaml
from sft_helpers import TINY

import fused_stable
from fused_stable.train.run import optimizers

RUN = [*TINY, "--tuner", "full", "--max_steps", "2", "--save_steps", "2", "--logging_steps", "1"]


@pytest.mark.slow  # one short run of the tiny model
def test_sft_optim_lion_trains_with_lions_state_and_says_so(sft, tmp_path):
    out_dir = tmp_path / "lion"
    code, out, err = sft(*RUN, "--optim", "lion", "--state_precision", "8bit", "--output_dir", out_dir)
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("fused-stable sft: model=tiny"))
    assert "| optim=lion (FusedLion) optimizer state 8bit " in header
    saved = torch.load(out_dir / "checkpoints" / "step-2" / "optimizer.pt", weights_only=True)
    # Lion's one state (exp_avg, 8-bit codes with scales on the matrices), never AdamW's second moment
    entries = list(saved["state"].values())
    assert entries and all("exp_avg" in e and not any("exp_avg_sq" in key for key in e) for e in entries)
    assert any(e["exp_avg"].dtype == torch.int8 for e in entries)
    assert {g["lr"] for g in saved["param_groups"]} == {2e-4}  # TINY's lr, given: not divided
    with open(out_dir / "run.yaml") as f:
        assert yaml.safe_load(f)["optim"] == "lion"
    # the checkpoint's state is Lion's: resuming it as AdamW is refused, in one line, before anything runs
    code, _, err = sft("--output_dir", out_dir, "--resume", "latest", "--optim", "adamw")
    assert code == 2 and "different optim (checkpoint: lion, now: adamw)" in err


def test_optim_muon_is_refused_in_one_line_before_the_model_loads(sft, tmp_path, monkeypatch):
    for name in optimizers._MUON_NAMES:
        monkeypatch.delattr(fused_stable, name, raising=False)
    code, out, err = sft(*RUN, "--optim", "muon", "--output_dir", tmp_path / "muon")
    assert code == 2
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith(
            "optim muon needs fused_stable.FusedMuon and fused_stable.muon_param_groups, which this version of "
            "fused-stable does not have yet: use --optim adamw or lion"
        )
    )
    assert not os.path.exists(tmp_path / "muon"), "nothing is written"
    assert "fused-stable sft: model=" not in out


def test_every_rule_of_the_table_is_a_choice_with_its_class():
    from fused_stable.train.config.keys import CHOICES

    assert CHOICES["optim"] == ("adamw", "lion", "muon")
    for name in ("adamw", "lion"):
        cls = getattr(fused_stable, optimizers.RULES[name].title)
        assert cls.RULE.NAME == name
    assert optimizers.RULES["adamw"].lr_factor == 1.0 and optimizers.RULES["lion"].lr_factor == pytest.approx(1 / 3)
