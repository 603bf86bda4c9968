"""Resume reproduces the uninterrupted run bit for bit; a save killed half-way never hides the previous
checkpoint; damaged checkpoints are found by their recorded sizes and checksums (resume latest passes over
them and says so, an explicit one is one line naming the file); a resume that would change the saved state's
shapes or meaning is refused; the stability guard's in-process seams (callbacks, rollback) work."""

import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from sft_helpers import TINY, Crash, crash_at, fit, read_metrics, setup_run

from fused_stable.train.run import checkpoint

RUN = ["--model", "tiny", *TINY, "--max_steps", "6", "--save_steps", "3", "--logging_steps", "1"]


def _final_weights(out):
    return load_file(os.path.join(out, "checkpoints", "step-6", "weights.safetensors"))


@pytest.mark.slow  # ~45 s on a loaded 2-core machine, ~15-25 s on a quiet one
def test_resume_matches_uninterrupted_run_bit_for_bit(sft, tmp_path):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    assert sft(*RUN, "--output_dir", straight)[0] == 0

    setup = setup_run(*RUN, "--output_dir", broken)
    setup.trainer.callbacks.append(crash_at(5))  # dies after the step-3 checkpoint, mid-way to step 6
    with pytest.raises(Crash):
        fit(setup)
    assert checkpoint.latest_checkpoint(broken).endswith("step-3")
    code, out, err = sft("--output_dir", broken, "--resume", "latest")  # the rest of the config comes from the run
    assert code == 0, err
    assert "resumed from" in out

    a, b = read_metrics(straight), read_metrics(broken)
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # exact floats, not approx
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    wa, wb = _final_weights(straight), _final_weights(broken)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    oa = torch.load(straight / "checkpoints" / "step-6" / "optimizer.pt", weights_only=True)
    ob = torch.load(broken / "checkpoints" / "step-6" / "optimizer.pt", weights_only=True)
    for key, state in oa["state"].items():
        for k, v in state.items():
            assert torch.equal(v, ob["state"][key][k]), (key, k)


def test_exception_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "run"
    setup = setup_run(*RUN, "--output_dir", out)
    real_save = checkpoint._torch_save
    calls = {"n": 0}

    def failing_save(obj, path):
        calls["n"] += 1
        if "step-6" in path and path.endswith("scaler.pt") or ("step-6" in path and path.endswith("rng.pt")):
            raise OSError("disk full (simulated)")
        return real_save(obj, path)

    monkeypatch.setattr(checkpoint, "_torch_save", failing_save)
    with pytest.raises(OSError):
        fit(setup)
    # weights and optimizer of step 6 were written before the failure; none of it is visible
    assert checkpoint.latest_checkpoint(out).endswith("step-3")
    assert sorted(os.listdir(out / "checkpoints")) == ["step-3"]
    state = checkpoint.load_checkpoint(
        checkpoint.latest_checkpoint(out), model=setup.model, optimizer=setup.trainer.optimizer
    )
    assert state["step"] == 3 and state["micro_batches"] == 6


def test_callbacks_stop_and_rollback(tmp_path):
    out = tmp_path / "cb"
    setup = setup_run(*RUN, "--output_dir", out)
    seen = []

    def guard(step, optimizer, metrics):
        seen.append((step, metrics["loss"]))
        if step == 4 and len(seen) == 4:
            return "rollback"
        if step == 5:
            return "stop"
        return None

    setup.trainer.callbacks.append(guard)
    state = fit(setup)
    # rollback at step 4 went back to the step-3 checkpoint (weights, optimizer, step) but not to its data
    assert [s for s, _ in seen] == [1, 2, 3, 4, 4, 5]
    assert state.step == 5 and state.rollbacks == 1 and state.micro_batches == 2 * 5 + 2
    assert setup.trainer.stopped_by == "callback"
    assert checkpoint.latest_checkpoint(out).endswith("step-5")


def test_rollback_restores_checkpoint_exactly(tmp_path):
    out = tmp_path / "rb"
    setup = setup_run(*RUN, "--max_steps", "3", "--output_dir", out)
    fit(setup)
    saved = load_file(out / "checkpoints" / "step-3" / "weights.safetensors")
    with torch.no_grad():
        for p in setup.model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    setup.trainer.rollback()
    params = dict(setup.model.named_parameters())
    for name, value in saved.items():
        assert torch.equal(params[name].detach(), value), name
    assert setup.trainer.state.step == 3


# ------------------------------------------------------------------------------------------ damaged checkpoints
def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


# the six ways of the report, plus a same-size corruption only the checksum can see
DAMAGES = {
    "truncated-weights": ("weights.safetensors", _truncate),
    "missing-weights": ("weights.safetensors", os.remove),
    "truncated-optimizer": ("optimizer.pt", _truncate),
    "flipped-byte-optimizer": ("optimizer.pt", _flip_a_byte),
    "missing-trainer-state": ("trainer_state.json", os.remove),
    "truncated-rng": ("rng.pt", _truncate),
    "broken-marker": ("COMPLETE", lambda p: open(p, "w").write("1796051234.5\n")),
}


# what the one line says about each (docs/trainer.md): the sizes for a truncated file, the checksum for one
# damaged at the same size
WHY = {
    "truncated-weights": "bytes, the checkpoint recorded",
    "missing-weights": "is missing",
    "truncated-optimizer": "bytes, the checkpoint recorded",
    "flipped-byte-optimizer": "SHA-256 differs",
    "missing-trainer-state": "is missing",
    "truncated-rng": "bytes, the checkpoint recorded",
    "broken-marker": "is damaged (not the file list",
}


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory):
    """A finished 3-step run with a checkpoint after every step (all kept)."""
    from fused_stable.train.run import sft as sft_command

    out = tmp_path_factory.mktemp("ckpts") / "run"
    code = sft_command.main(
        [*RUN, "--max_steps", "3", "--save_steps", "1", "--save_total_limit", "0", "--output_dir", str(out)]
    )
    assert code == 0
    return out


def _copy(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def _tree(folder):
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


def test_marker_records_every_file_size_and_checksum(three_checkpoints):
    ckpt = three_checkpoints / "checkpoints" / "step-3"
    marker = json.loads((ckpt / checkpoint.COMPLETE_MARKER).read_text())
    assert marker["step"] == 3 and set(marker["files"]) == set(os.listdir(ckpt)) - {checkpoint.COMPLETE_MARKER}
    for name, record in marker["files"].items():
        data = (ckpt / name).read_bytes()
        assert record == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert checkpoint.verify_checkpoint(str(ckpt))["step"] == 3


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_explicit_damaged_checkpoint_is_one_line_naming_the_file(sft, three_checkpoints, tmp_path, damage):
    run = _copy(three_checkpoints, tmp_path)
    name, spoil = DAMAGES[damage]
    ckpt = run / "checkpoints" / "step-3"
    size = os.path.getsize(ckpt / name)
    spoil(ckpt / name)
    before = _tree(run)
    code, out, err = sft("--resume", ckpt, "--max_steps", "4")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in out + err
    assert f"{ckpt / name}" in err and WHY[damage] in err, err
    if damage.startswith("truncated"):
        assert f"({size // 2} bytes, the checkpoint recorded {size})" in err
    assert _tree(run) == before  # a failed start writes nothing, run.yaml included


@pytest.mark.slow  # seven short resumes: ~40 s on a loaded 2-core machine
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_resume_latest_passes_over_damaged_checkpoints(sft, three_checkpoints, tmp_path, damage):
    run = _copy(three_checkpoints, tmp_path)
    name, spoil = DAMAGES[damage]
    spoil(run / "checkpoints" / "step-3" / name)
    code, out, err = sft("--output_dir", run, "--resume", "latest")  # step 2 -> 3 again
    assert code == 0, err
    passed = [line for line in err.splitlines() if "passed over a damaged checkpoint" in line]
    assert len(passed) == 1 and str(run / "checkpoints" / "step-3" / name) in passed[0]
    assert f"resumed from {run / 'checkpoints' / 'step-2'}" in out
    # the step-3 checkpoint is written again, whole, and the resumed run equals the original one
    checkpoint.verify_checkpoint(str(run / "checkpoints" / "step-3"))
    original = load_file(three_checkpoints / "checkpoints" / "step-3" / "weights.safetensors")
    again = load_file(run / "checkpoints" / "step-3" / "weights.safetensors")
    assert all(torch.equal(original[k], again[k]) for k in original)
    assert [r["loss"] for r in read_metrics(run)] == [r["loss"] for r in read_metrics(three_checkpoints)]


def test_resume_latest_with_every_checkpoint_damaged(sft, three_checkpoints, tmp_path):
    run = _copy(three_checkpoints, tmp_path)
    for step in (1, 2, 3):
        _truncate(run / "checkpoints" / f"step-{step}" / "optimizer.pt")
    before = _tree(run)
    code, _, err = sft("--output_dir", run, "--resume", "latest")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "no complete checkpoint" in err and "3 damaged or incomplete" in err and "step-3/optimizer.pt" in err
    # what it found and what to do, never the advice to --overwrite (which would delete them)
    assert "the run saved 3 (step-1, step-2, step-3) and none verifies" in err and "never saved" not in err
    assert "another output_dir (--overwrite here would delete them)" in err
    assert _tree(run) == before


@pytest.mark.parametrize(
    "flags,needles",
    [
        (["--lora_r", "16"], ["lora_r (checkpoint: 8, now: 16)"]),
        (
            ["--lora_r", "16", "--target_modules", "all-linear"],
            ["lora_r (checkpoint: 8, now: 16)", "target_modules (checkpoint: q_proj,v_proj, now: all-linear)"],
        ),
        (["--tuner", "dora"], ["tuner (checkpoint: lora, now: dora)"]),
        (["--quant_bits", "4"], ["quant_bits (checkpoint: None, now: 4)"]),
        (["--lora_alpha", "32"], ["lora_alpha (checkpoint: 16.0, now: 32.0)"]),
        (["--loraplus_lr_ratio", "16"], ["loraplus_lr_ratio (checkpoint: None, now: 16.0)"]),
        # the optimizer state restores these: a new value would be silently ignored
        (
            ["--lr", "1e-3", "--weight_decay", "0.1"],
            ["lr (checkpoint: 0.0002, now: 0.001)", "weight_decay (checkpoint: 0.01, now: 0.1)"],
        ),
    ],
)
def test_resume_with_state_changing_settings_is_one_line(sft, three_checkpoints, tmp_path, flags, needles):
    run = _copy(three_checkpoints, tmp_path)
    before = _tree(run)
    code, out, err = sft("--output_dir", run, "--resume", "latest", *flags)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in out + err, err
    assert "cannot resume" in err and "step-3" in err
    for needle in needles:
        assert needle in err
    assert _tree(run) == before


def test_resume_accepts_the_same_settings_spelled_differently(three_checkpoints, tmp_path):
    run = _copy(three_checkpoints, tmp_path)
    setup = setup_run(
        "--output_dir",
        run,
        "--resume",
        "latest",
        "--target_modules",
        "v_proj, q_proj",
        "--lora_r",
        "8",
        "--lr",
        "2e-4",
        "--max_steps",
        "5",
        "--max_grad_norm",
        "0.5",
    )
    assert setup.resume_path.endswith("step-3") and setup.cfg.max_steps == 5 and setup.cfg.max_grad_norm == 0.5


def test_rollback_passes_over_a_damaged_checkpoint(three_checkpoints, tmp_path):
    run = _copy(three_checkpoints, tmp_path)
    _flip_a_byte(run / "checkpoints" / "step-3" / "weights.safetensors")
    setup = setup_run("--resume", run / "checkpoints" / "step-1")
    setup.start()
    setup.trainer.reporter.close()
    assert setup.trainer.state.step == 1
    setup.trainer.rollback()  # the newest checkpoint, step-3, is damaged: to step-2, the newest that verifies
    assert setup.trainer.state.step == 2
    saved = load_file(run / "checkpoints" / "step-2" / "weights.safetensors")
    params = dict(setup.model.named_parameters())
    assert all(torch.equal(params[k].detach(), v) for k, v in saved.items())
