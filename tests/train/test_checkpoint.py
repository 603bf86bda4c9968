"""Resume reproduces the uninterrupted run bit for bit; a save killed half-way never hides the previous
checkpoint; the stability guard's in-process seams (callbacks, rollback) work."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from fused_stable.train import checkpoint
from sft_helpers import REPO_ROOT, TINY, fit, read_metrics, setup_run

RUN = [*TINY, "--max_steps", "6", "--save_steps", "3", "--logging_steps", "1"]


class Crash(Exception):
    pass


def _crash_at(step_to_crash):
    def callback(step, optimizer, metrics):
        if step == step_to_crash:
            raise Crash(f"simulated crash at step {step}")
    return callback


def _final_weights(out):
    return load_file(os.path.join(out, "checkpoints", "step-6", "weights.safetensors"))


@pytest.mark.slow  # ~45 s on a loaded 2-core machine, ~15-25 s on a quiet one
def test_resume_matches_uninterrupted_run_bit_for_bit(sft, tmp_path):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    assert sft(*RUN, "--output_dir", straight)[0] == 0

    setup = setup_run(*RUN, "--output_dir", broken)
    setup.trainer.callbacks.append(_crash_at(5))  # dies after the step-3 checkpoint, mid-way to step 6
    with pytest.raises(Crash):
        fit(setup)
    assert checkpoint.latest_checkpoint(broken).endswith("step-3")
    code, out, err = sft("--output_dir", broken, "--resume", "latest")  # the rest of the config comes from the run
    assert code == 0, err
    assert "resumed from" in out

    a, b = read_metrics(straight), read_metrics(broken)
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]          # exact floats, not approx
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
    state = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(out), model=setup.model,
                                       optimizer=setup.trainer.optimizer)
    assert state["step"] == 3 and state["micro_batches"] == 6


KILL_SCRIPT = textwrap.dedent("""
    import os, sys
    from fused_stable.train import checkpoint, cli
    real = checkpoint._write_bytes
    def write_then_die(path, data):
        if "step-6" in path and path.endswith(checkpoint.COMPLETE_MARKER):
            os._exit(9)  # killed after the rename, before the completion marker
        real(path, data)
    checkpoint._write_bytes = write_then_die
    real_save = checkpoint._torch_save
    def save_then_die(obj, path):
        if "step-3" in path and path.endswith("rng.pt") and os.environ.get("DIE_EARLY"):
            os._exit(9)  # killed with half of the files of the temporary directory written
        real_save(obj, path)
    checkpoint._torch_save = save_then_die
    sys.exit(cli.main(sys.argv[1:]))
""")


@pytest.mark.slow  # ~45 s on a loaded 2-core machine, ~15-25 s on a quiet one
def test_process_killed_mid_save(tmp_path, sft):
    """A real process killed (os._exit) mid-save: `resume latest` picks the newest complete checkpoint."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, *RUN, "--output_dir", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert os.path.isdir(out / "checkpoints" / "step-6")                      # renamed into place...
    assert not os.path.exists(out / "checkpoints" / "step-6" / "COMPLETE")     # ...but never marked complete
    assert checkpoint.latest_checkpoint(out).endswith("step-3")
    code, stdout, err = sft("--output_dir", out, "--resume", "latest")
    assert code == 0, err
    assert "resumed from" in stdout and "step-3" in stdout
    assert checkpoint.latest_checkpoint(out).endswith("step-6")
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))

    # killed while the temporary directory was half written: no step-3 at all, nothing to resume from
    early = tmp_path / "early"
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, *RUN, "--output_dir", str(early)],
                          env={**env, "DIE_EARLY": "1"}, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 9
    assert checkpoint.latest_checkpoint(early) is None
    assert [n for n in os.listdir(early / "checkpoints") if n.startswith(".tmp-step-3")]
    code, _, err = sft("--output_dir", early, "--resume", "latest")
    assert code == 2 and "no complete checkpoint" in err


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
