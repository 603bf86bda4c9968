"""`fused-stable sft --optim` (issue 35 item 6): the run trains with the rule it names (train/run/optimizers.py),
says so in its header, keeps that rule's state in its checkpoints and refuses to resume with another; `muon`
splits the model (muon_param_groups) and trains the hidden matrices with Muon."""

import os

import pytest
import torch
import yaml
from sft_helpers import TINY

import fused_stable
from fused_stable.train.run import optimizers, outputs

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


@pytest.mark.slow  # one short run of the tiny model
def test_sft_optim_adafactor_trains_with_torchs_factored_state(sft, tmp_path):
    """--optim adafactor is torch.optim.Adafactor (FusedAdafactor): the checkpoint keeps row_var / col_var for the
    matrices and variance for the vectors, at the run's lr; a state precision it cannot keep is refused up front."""
    out_dir = tmp_path / "adafactor"
    code, out, err = sft(*RUN, "--optim", "adafactor", "--output_dir", out_dir)
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("fused-stable sft: model=tiny"))
    assert "| optim=adafactor (FusedAdafactor) " in header
    saved = torch.load(out_dir / "checkpoints" / "step-2" / "optimizer.pt", weights_only=True)
    entries = list(saved["state"].values())
    assert entries and all(set(e) in ({"step", "row_var", "col_var"}, {"step", "variance"}) for e in entries)
    assert any("row_var" in e for e in entries) and any("variance" in e for e in entries)
    assert {g["lr"] for g in saved["param_groups"]} == {2e-4}
    code, _, err = sft(*RUN, "--optim", "adafactor", "--state_precision", "8bit", "--output_dir", tmp_path / "q8")
    assert code == 2 and "optim adafactor: Adafactor keeps its factored second moments" in err


@pytest.mark.slow  # one short run of the tiny model
def test_sft_optim_muon_trains_the_hidden_matrices_with_muon(sft, tmp_path):
    """Full fine-tuning with --optim muon: the hidden 2-D weights keep Muon's momentum_buffer, the rest (embeddings,
    norms) AdamW's moments, all in one FusedMuon (one norm, one decision); the header names it."""
    out_dir = tmp_path / "muon"
    code, out, err = sft(*RUN, "--optim", "muon", "--output_dir", out_dir)
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("fused-stable sft: model=tiny"))
    assert "| optim=muon (FusedMuon)" in header
    saved = torch.load(out_dir / "checkpoints" / "step-2" / "optimizer.pt", weights_only=True)
    kinds = [g["use_muon"] for g in saved["param_groups"]]
    assert sorted(kinds) == [False, True]
    muon_ids = next(g["params"] for g in saved["param_groups"] if g["use_muon"])
    for param_id, entry in saved["state"].items():
        expected = {"step", "momentum_buffer"} if param_id in muon_ids else {"step", "exp_avg", "exp_avg_sq"}
        assert set(entry) == expected, (param_id, sorted(entry))
    # where each param went and why: a line after the header, and run_manifest.json (FusedMuon.describe())
    split = outputs.read_manifest(str(out_dir))["muon_split"]
    hidden = split["muon"]["reasons"]["hidden matrix"]
    assert split["muon"]["matrices"] == split["muon"]["tensors"] == hidden["tensors"] == 4 * 7  # 4 layers
    assert set(split["adamw"]["reasons"]) == {"embedding", "head", "1-D"}
    assert split["adamw"]["reasons"]["1-D"]["tensors"] == 4 * 2 + 1  # the layers' two norms and the final one
    line = next(line for line in out.splitlines() if line.startswith("optim muon: "))
    assert line.startswith(
        f"optim muon: Muon: 28 matrices in 28 tensors, {hidden['params']:,} params (hidden matrix 28)"
    )
    assert "AdamW: 11 tensors" in line and "LoRA" not in line
    # Newton-Schulz's dtype and why (the suite pins torch's bf16: tests/conftest.py)
    assert line.endswith("| Newton-Schulz in bf16 (FUSED_STABLE_NEWTON_SCHULZ=bf16)"), line
    schulz = split["newton_schulz"]
    assert (schulz["dtype"], schulz["why"]) == ("bf16", "FUSED_STABLE_NEWTON_SCHULZ=bf16")
    assert schulz["gram_blocks"] == 0, schulz  # the tiny model's Gram sides (64 rows) are one block


def _lora_muon_run(sft, out_dir, *flags):
    """A LoRA run of the tiny model (q_proj, v_proj of 4 layers: 16 factors, 16,384 params at r 8) with --optim
    muon; (stdout, the manifest's muon_split, the step-2 checkpoint's optimizer state)."""
    code, out, err = sft(*TINY, "--max_steps", "2", "--optim", "muon", *flags, "--output_dir", out_dir)
    assert code == 0, err
    saved = torch.load(out_dir / "checkpoints" / "step-2" / "optimizer.pt", weights_only=True)
    return out, outputs.read_manifest(str(out_dir))["muon_split"], saved


@pytest.mark.slow  # one short run of the tiny model
def test_a_lora_muon_run_says_its_factors_are_on_adamw(sft, tmp_path):
    """LLaMA-Factory's split, the default: no Muon matrix in a LoRA run, said in the line after the header with
    how to change it, and in the manifest; every factor keeps AdamW's moments."""
    out, split, saved = _lora_muon_run(sft, tmp_path / "lora")
    assert split["muon"]["matrices"] == 0 and split["adamw"]["reasons"] == {
        "LoRA factor": {"tensors": 16, "params": 16384}
    }
    line = next(line for line in out.splitlines() if line.startswith("optim muon: "))
    assert line.startswith("optim muon: Muon: 0 matrices in 0 tensors, 0 params | AdamW: 16 tensors, 16,384 params")
    assert "--muon_lora puts them on Muon" in line
    assert all(set(entry) == {"step", "exp_avg", "exp_avg_sq"} for entry in saved["state"].values())


@pytest.mark.slow  # two short runs of the tiny model
def test_muon_lora_puts_the_lora_factors_on_muon_and_a_resume_cannot_change_it(sft, tmp_path):
    out_dir = tmp_path / "lora"
    out, split, saved = _lora_muon_run(sft, out_dir, "--muon_lora", "true")
    assert split["muon"]["reasons"] == {"LoRA factor": {"tensors": 16, "params": 16384}}
    assert split["muon"]["matrices"] == 16 and split["adamw"]["tensors"] == 0
    assert "--muon_lora puts" not in out
    assert len(saved["state"]) == 16
    assert all(set(entry) == {"step", "momentum_buffer"} for entry in saved["state"].values())
    with open(out_dir / "run.yaml") as f:
        assert yaml.safe_load(f)["muon_lora"] is True
    code, _, err = sft("--output_dir", out_dir, "--resume", "latest", "--muon_lora", "false", "--max_steps", "3")
    assert code == 2 and "different muon_lora (checkpoint: True, now: False)" in err


def test_muon_lora_without_optim_muon_is_refused_in_one_line(sft, tmp_path):
    code, _, err = sft(*TINY, "--muon_lora", "true", "--output_dir", tmp_path / "adamw")
    assert code == 2 and err.count("\n") == 1
    assert "muon_lora puts the LoRA factors on Muon: it needs optim muon, not adamw" in err
    assert not os.path.exists(tmp_path / "adamw")


def test_optim_muon_with_loraplus_is_refused_in_one_line_before_the_model_loads(sft, tmp_path):
    lora = [*TINY, "--tuner", "lora", "--max_steps", "2"]
    code, out, err = sft(*lora, "--optim", "muon", "--loraplus_lr_ratio", "16", "--output_dir", tmp_path / "muon")
    assert code == 2
    assert "optim muon builds its own param groups (muon_param_groups)" in err.strip().splitlines()[-1]
    assert not os.path.exists(tmp_path / "muon"), "nothing is written"


@pytest.mark.parametrize(
    "ranks, deepspeed, tuner, refused",
    [(2, False, "full", True), (1, False, "full", False), (2, True, "full", False), (2, False, "lora", False)],
)
def test_8bit_muon_under_fsdp2_is_refused_before_the_model_loads(monkeypatch, ranks, deepspeed, tuner, refused):
    """torchrun's full fine-tune is FSDP2, whose row shards 8-bit Muon momentum (blocks over whole matrices) cannot
    hold: refused with the run's keys, before the model loads; one process, DDP's LoRA and DeepSpeed (checked per
    stage in deepspeed_run) are not."""
    from fused_stable.errors import UserError
    from fused_stable.train.config.keys import TrainConfig
    from fused_stable.train.run import optimizers

    monkeypatch.setattr(optimizers, "_launched_ranks", lambda: ranks)
    cfg = TrainConfig(optim="muon", tuner=tuner, state_precision="8bit")
    if refused:
        with pytest.raises(UserError, match="state_precision 8bit under torchrun: FSDP2 shards each matrix by rows"):
            optimizers.check_available(cfg, deepspeed=deepspeed)
    else:
        optimizers.check_available(cfg, deepspeed=deepspeed)
    optimizers.check_available(TrainConfig(optim="muon", tuner=tuner, state_precision="bf16"), deepspeed=deepspeed)


def _muon_entries(saved: dict) -> list[dict]:
    muon_ids = next(g["params"] for g in saved["param_groups"] if g["use_muon"])
    return [entry for param_id, entry in saved["state"].items() if param_id in muon_ids]


@pytest.mark.slow  # one short run of the tiny model
@pytest.mark.parametrize(
    "source",
    [
        "flags",  # --optim muon --tuner full --state_precision 8bit
        "llamafactory",  # use_muon: true beside an HF optim name that asks for 8-bit state
    ],
)
def test_muon_with_8bit_state_keeps_the_momentum_as_8bit_codes(sft, tmp_path, source):
    """8-bit Muon momentum (issue 50 item 4): the hidden matrices' momentum_buffer is int8 codes with their block
    scales in the checkpoint (the tiny model's 128-wide matrices are above the 4096-element threshold)."""
    out_dir = tmp_path / "muon"
    if source == "flags":
        argv = [*RUN, "--optim", "muon", "--state_precision", "8bit"]
    else:
        config = tmp_path / "lf.yaml"
        config.write_text("stage: sft\nfinetuning_type: full\nuse_muon: true\noptim: paged_adamw_8bit\n")
        argv = ["--config", config, *RUN]
    code, out, err = sft(*argv, "--output_dir", out_dir)
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("fused-stable sft: model=tiny"))
    assert "| optim=muon (FusedMuon) optimizer state 8bit " in header
    saved = torch.load(out_dir / "checkpoints" / "step-2" / "optimizer.pt", weights_only=True)
    entries = _muon_entries(saved)
    assert entries and all(e["momentum_buffer"].dtype == torch.int8 for e in entries)
    assert all(e["momentum_buffer_scale"].dtype == torch.float32 for e in entries)


@pytest.mark.slow  # one short run of the tiny model
def test_resuming_a_muon_run_with_8bit_state_converts_its_momentum_once(sft, tmp_path):
    out_dir = tmp_path / "muon"
    code, _, err = sft(*RUN, "--optim", "muon", "--output_dir", out_dir)
    assert code == 0, err
    code, out, err = sft("--output_dir", out_dir, "--resume", "latest", "--state_precision", "8bit", "--max_steps", 4)
    assert code == 0, err
    assert "its fp32 optimizer state is converted to 8bit once" in out
    saved = torch.load(out_dir / "checkpoints" / "step-4" / "optimizer.pt", weights_only=True)
    assert all(e["momentum_buffer"].dtype == torch.int8 for e in _muon_entries(saved))


def test_every_rule_of_the_table_is_a_choice_with_its_class():
    from fused_stable.train.config.keys import CHOICES

    assert CHOICES["optim"] == tuple(fused_stable.OPTIMIZERS)  # every optimizer of the one registry
    assert {"adamw", "lion", "muon", "sgd"} <= set(CHOICES["optim"])
    for name, entry in fused_stable.OPTIMIZERS.items():
        assert getattr(fused_stable, optimizers.RULES[name].title) is entry.cls
        if not entry.own_param_groups:
            assert entry.cls.RULE.name == name
    assert optimizers.RULES["muon"].title == fused_stable.FusedMuon.__name__


def test_the_help_headers_name_every_rule_the_trainer_builds(sft):
    from fused_stable.cli import SUBCOMMANDS

    code, out, _ = sft("--help")
    header = out.split("\n\n")[1].replace("\n", " ")  # the paragraph under the usage line
    assert code == 0 and header.startswith("Supervised fine-tuning")
    for rule in optimizers.RULES.values():
        assert rule.title in header, rule.title
    assert "fused_stable.OPTIMIZERS" in SUBCOMMANDS["sft"][1]  # the one registry, which lists them all
    assert "where this fused_stable has it" not in out  # Muon is in this fused_stable
