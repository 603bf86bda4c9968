"""Faults a real machine produces, each with real processes (the tiny model, a few steps):

- SIGKILL at several points of a checkpoint save (between its files, after the rename but before the COMPLETE
  marker, while pruning an old one) and in the middle of a metrics.jsonl line: `--resume latest` continues from
  the newest intact checkpoint to exactly the uninterrupted run's losses and weights, nothing half-written is
  loaded, the leftovers are cleared, and a file of the user's in the folder is left alone;
- a full disk (a file-size limit, and a small tmpfs where one can be mounted) during a save: one line, exit code 1,
  nothing of the failed checkpoint left, the previous ones intact and loadable;
- a second `fused-stable sft` into a folder a run is writing: refused at once (also with `--overwrite true`),
  before any model is loaded; and a run that was killed leaves no lock behind.

The processes dying at exact points are children forked by fault_script.py (one interpreter start for all of them);
the point is a named stage of the save (`checkpoint._save_stage`), so no test waits on a timer.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from sft_helpers import REPO_ROOT, TINY, optimizer_state_difference, read_metrics, wait_for

from fused_stable.train.run import checkpoint, outputs

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_script.py")
# 6 steps, a checkpoint at steps 3 and 6, a log line per step: the faults hit the step-6 save
RUN = ["--model", "tiny", *TINY, "--max_steps", "6", "--save_steps", "3", "--logging_steps", "1"]

# name -> (fault, extra flags, the newest complete checkpoint afterwards)
KILLS = {
    "between-files": ({"kill": ["weights.safetensors", 6]}, [], 3),
    "after-rng": ({"kill": ["rng.pt", 6]}, [], 3),
    "before-complete": ({"kill": ["renamed", 6]}, [], 3),
    "while-pruning": ({"kill": ["pruning", 3]}, ["--save_total_limit", "1"], 6),
    "metrics-line-cut": ({"cut_metrics": 5}, [], 3),
}
# issue 52 item 5: new rules with 8-bit state, full fine-tuning (the tiny model's matrices are >= 4096 elements, so
# their moments are 8-bit codes; a LoRA run would keep them fp32), SIGKILLed between the step-6 save's files
RULE_KILLS = {
    "lion-8bit": ["--optim", "lion", "--tuner", "full", "--state_precision", "8bit"],
    "muon-8bit": ["--optim", "muon", "--tuner", "full", "--state_precision", "8bit"],
}
FILE_SIZE_LIMIT = 8192  # bytes: below the step-6 checkpoint's weights file, above metrics.jsonl


def _mount_small_tmpfs(where) -> bool:
    """A 16 MiB tmpfs at `where` (needs root, or a container that allows mounts); False when it cannot be."""
    where.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)], capture_output=True)
    return done.returncode == 0


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    """Every faulted run of this module from one fault_script.py process, and the uninterrupted run."""
    root = tmp_path_factory.mktemp("faults")
    cases = [
        {"name": name, "fault": fault, "extra": extra, "output_dir": str(root / name)}
        for name, (fault, extra, _) in KILLS.items()
    ]
    for name, extra in RULE_KILLS.items():
        kill = {"kill": ["weights.safetensors", 6]}
        cases.append({"name": name, "fault": kill, "extra": extra, "output_dir": str(root / name)})
    limit = {"file_size_limit": ["tmp", 6, FILE_SIZE_LIMIT]}
    cases.append({"name": "file-size-limit", "fault": limit, "output_dir": str(root / "file-size-limit")})
    small = root / "small-disk"
    mounted = _mount_small_tmpfs(small)
    if mounted:
        fill = {"fill_disk": ["tmp", 6, str(small / "filler")]}
        cases.append({"name": "disk-full", "fault": fill, "output_dir": str(small / "run"), "log": str(root / "disk")})
    plan = root / "plan.json"
    plan.write_text(json.dumps({"args": RUN, "cases": cases}))
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(
            [sys.executable, SCRIPT, str(plan)], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, done.stderr[-3000:]
        results = {r["name"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])}
        if mounted:
            os.remove(small / "filler")  # the disk has room again: what is left must resume
        yield root, results, mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(small)], capture_output=True)


@pytest.fixture(scope="module")
def straight(faulted, tmp_path_factory):
    """The same run, never interrupted (in this process)."""
    from fused_stable.train.run import sft as sft_command

    out = tmp_path_factory.mktemp("straight") / "run"
    assert sft_command.main([*RUN, "--output_dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def straight_rules(faulted, tmp_path_factory):
    """RULE_KILLS' runs, never interrupted (in this process)."""
    from fused_stable.train.run import sft as sft_command

    runs = {}
    for name, extra in RULE_KILLS.items():
        runs[name] = tmp_path_factory.mktemp("straight-" + name) / "run"
        assert sft_command.main([*RUN, *extra, "--output_dir", str(runs[name])]) == 0
    return runs


def _err(out) -> str:
    log = out.parent.parent / "disk" if out.parent.name == "small-disk" else out  # not on the full disk
    with open(f"{log}.err") as f:
        return f.read()


def _hidden(out) -> list[str]:
    return sorted(n for n in os.listdir(out / "checkpoints") if n.startswith("."))


def _assert_continues_exactly(sft, out, straight, resumed_from: int):
    """A user's file in the folder, then `--resume latest`: the uninterrupted run's losses and weights."""
    (out / "notes.txt").write_text("mine\n")
    code, stdout, err = sft("--output_dir", out, "--resume", "latest")
    assert code == 0, err
    assert f"resumed from {out / 'checkpoints' / f'step-{resumed_from}'}" in stdout
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(straight)]  # exact floats
    mine = load_file(out / "checkpoints" / "step-6" / "weights.safetensors")
    theirs = load_file(straight / "checkpoints" / "step-6" / "weights.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert (out / "notes.txt").read_text() == "mine\n"
    assert _hidden(out) == []  # what the killed save left is cleared
    assert not os.path.exists(out / outputs.LOCK_FILE)  # the lock is let go at the end
    return stdout, err


@pytest.mark.parametrize("name", list(KILLS))
def test_sigkill_during_a_save_then_resume_latest_continues_exactly(faulted, straight, sft, name):
    root, results, _ = faulted
    out = root / name
    assert results[name]["signal"] == signal.SIGKILL, (results[name], _err(out)[-3000:])
    newest = KILLS[name][2]
    # nothing half-written is ever taken for a checkpoint
    path, passed_over = checkpoint.latest_verified_checkpoint(str(out))
    assert path == str(out / "checkpoints" / f"step-{newest}")
    complete = [step for step, _ in checkpoint.list_checkpoints(str(out))]
    assert complete == ([3] if newest == 3 else [6])
    if name == "before-complete":
        why = "is incomplete (no COMPLETE marker: its save never finished)"
        assert passed_over == [f"{out / 'checkpoints' / 'step-6'} {why}"]
    if name in ("between-files", "after-rng"):
        assert [n.rsplit("-", 1)[0] for n in _hidden(out)] == [".tmp-step-6"]
    if name == "while-pruning":
        assert [n.rsplit("-", 1)[0] for n in _hidden(out)] == [".pruned-step-3"]
    if name == "metrics-line-cut":
        assert not open(out / "metrics.jsonl").read().endswith("\n")  # the last line was cut by the kill
    stdout, err = _assert_continues_exactly(sft, out, straight, newest)
    if name == "metrics-line-cut":
        assert "dropped unreadable line 5" in err
        assert os.path.getsize(out / "curves.png") > 0 and "done: steps 3->6" in stdout
    if name in ("between-files", "after-rng", "while-pruning"):
        assert "fused-stable sft: note: removed" in stdout


@pytest.mark.parametrize("name", list(RULE_KILLS))
def test_sigkill_of_a_new_rule_with_8bit_state_then_resume_latest_is_bit_identical(faulted, straight_rules, sft, name):
    """Lion's and Muon's 8-bit momentum codes (and their scales) go through a killed save and `--resume latest`:
    losses, weights and the step-6 optimizer state are the uninterrupted run's, bit for bit."""
    root, results, _ = faulted
    out, straight = root / name, straight_rules[name]
    assert results[name]["signal"] == signal.SIGKILL, (results[name], _err(out)[-3000:])
    assert checkpoint.latest_verified_checkpoint(str(out))[0] == str(out / "checkpoints" / "step-3")
    _assert_continues_exactly(sft, out, straight, 3)
    mine = torch.load(out / "checkpoints" / "step-6" / "optimizer.pt", weights_only=True)
    theirs = torch.load(straight / "checkpoints" / "step-6" / "optimizer.pt", weights_only=True)
    moment = "momentum_buffer" if name.startswith("muon") else "exp_avg"
    codes = [s for s in theirs["state"].values() if moment in s and s[moment].dtype == torch.int8]
    assert codes, f"no 8-bit {moment} in the run: the test would not see its codes"
    assert optimizer_state_difference(mine, theirs) is None


@pytest.mark.parametrize("name", ["file-size-limit", "disk-full"])
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_earlier_checkpoints(faulted, straight, sft, name):
    root, results, mounted = faulted
    if name == "disk-full" and not mounted:
        pytest.skip("cannot mount a small tmpfs here (needs root); the file-size limit gives the same failure")
    out = root / name if name != "disk-full" else root / "small-disk" / "run"
    assert results[name]["code"] == 1, (results[name], _err(out)[-3000:])
    err = _err(out)
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("fused-stable sft: error:")]
    step6, step3 = out / "checkpoints" / "step-6", out / "checkpoints" / "step-3"
    why = "a file-size limit was reached" if name == "file-size-limit" else "the disk is full"
    assert errors == [
        f"fused-stable sft: error: {why}: saving {step6} failed "
        f"({'File too large' if name == 'file-size-limit' else 'No space left on device'}) and left nothing behind; "
        f"the newest complete checkpoint, {step3}, is intact; free space, then continue: "
        f"fused-stable sft --output_dir {out} --resume latest"
    ], err[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["step-3"]  # nothing of the failed save is left
    checkpoint.verify_checkpoint(str(step3))
    _assert_continues_exactly(sft, out, straight, 3)


# ------------------------------------------------------------------------------------------- one writer
def _slow_run(out, pids):
    """A real `fused-stable sft` that trains slowly (interrupt_script.py), so a second one meets it running."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interrupt_script.py")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1", "STEP_SLEEP": "0.5", "PID_DIR": str(pids)}
    args = [*RUN, "--max_steps", "200", "--save_steps", "2", "--output_dir", str(out)]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.Popen([sys.executable, script, *args], env=env, cwd=REPO_ROOT, **pipes)


def test_a_second_run_into_a_busy_folder_is_refused_at_once_and_a_killed_run_leaves_no_lock(sft, tmp_path, monkeypatch):
    out, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    first = _slow_run(out, pids)
    try:
        wait_for(lambda: os.path.isfile(out / "checkpoints" / "step-2" / "COMPLETE"), first, "step-2 was saved")
        holder = outputs.folder_lock_holder(str(out))
        assert holder is not None and holder["pid"] == int((pids / "rank-0").read_text())

        # refused before any model is loaded, with or without --overwrite, and the running folder is untouched

        from fused_stable.train.model import load

        def no_model(*args, **kwargs):
            raise AssertionError("the second run loaded a model before it was refused")

        monkeypatch.setattr(load, "load_base_model", no_model)
        before = sorted(os.listdir(out))
        for extra in ([], ["--overwrite", "true"], ["--resume", "latest"]):
            code, _, err = (
                sft(*RUN, *extra, "--output_dir", out) if "--resume" not in extra else sft("--output_dir", out, *extra)
            )
            assert code == 2 and err.count("\n") == 1, err
            assert f"output_dir '{out}' is in use by fused-stable sft (pid {holder['pid']}" in err, err
        assert sorted(os.listdir(out)) == before
        monkeypatch.undo()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    assert first.returncode == -signal.SIGKILL
    # the kernel let go of the dead run's lock: its file is still there, the lock is not
    assert os.path.isfile(out / outputs.LOCK_FILE) and outputs.folder_lock_holder(str(out)) is None
    code, stdout, err = sft("--output_dir", out, "--resume", "latest", "--max_steps", "4")
    assert code == 0, err
    assert "resumed from" in stdout and not os.path.exists(out / outputs.LOCK_FILE)


def _small_save(out, step, value=1.0):
    weight = torch.nn.Parameter(torch.full((2, 3), value))
    opt = torch.optim.AdamW([weight], lr=1e-3)
    return checkpoint.save_checkpoint(
        str(out), step, model_state={"weight": weight.detach()}, optimizer=opt, trainer_state={}, config={}
    )


def test_a_marker_that_cannot_be_written_leaves_no_step_folder(tmp_path, monkeypatch):
    """The disk fills up between the rename and the COMPLETE marker: no `step-N` is left to be passed over on
    every resume, and a checkpoint of the same step that the save was replacing is put back as it was."""
    import errno

    out = tmp_path / "run"
    _small_save(out, 1)
    first = checkpoint.verify_checkpoint(str(out / "checkpoints" / "step-1"))["files"]
    real = checkpoint._write_bytes

    def no_room_for_the_marker(path, data):
        if os.path.basename(path) == checkpoint.COMPLETE_MARKER:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(checkpoint, "_write_bytes", no_room_for_the_marker)
    for step, value in ((2, 2.0), (1, 3.0)):  # a new step, then a replacement of step 1
        with pytest.raises(checkpoint.SaveFailed) as failed:
            _small_save(out, step, value)
        assert failed.value.errno == errno.ENOSPC and failed.value.checkpoint.endswith(f"step-{step}")
        assert os.listdir(out / "checkpoints") == ["step-1"]
        assert checkpoint.verify_checkpoint(str(out / "checkpoints" / "step-1"))["files"] == first
