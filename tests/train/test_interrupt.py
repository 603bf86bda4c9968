"""An interrupt is a checkpoint: real signals sent to real training processes (the embedded tiny model).

SIGINT / SIGTERM: the step under way finishes, a complete, verified checkpoint is written, the exact command
to continue is printed, and the process exits 130 / 143; continuing gives the uninterrupted run bit for bit.
A second SIGINT during that save abandons it and leaves the earlier checkpoints as they were. Under torchrun
a signal that reaches one rank stops every rank after the same step.
"""

import os
import shlex
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from sft_helpers import REPO_ROOT, TINY, read_metrics, wait_for

from fused_stable.train.run import checkpoint

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interrupt_script.py")
# logging every step (the interrupt script sleeps there), no periodic checkpoint unless a test asks for one
ARGS = ["--model", "tiny", *TINY, "--logging_steps", "1", "--save_steps", "100"]


def _launch(out, *extra, env=None, torchrun=False, pid_dir=None):
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1", **(env or {})}
    if pid_dir:
        env["PID_DIR"] = str(pid_dir)
    cmd = [sys.executable, SCRIPT, *ARGS, *map(str, extra), "--output_dir", str(out)]
    if torchrun:
        launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        env = {k: v for k, v in env.items() if k not in launch}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *cmd[1:]]
    return subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(out):
    path = os.path.join(out, "metrics.jsonl")
    return len(open(path).read().splitlines()) if os.path.isfile(path) else 0


def _interrupt_line(err):
    lines = [line for line in err.splitlines() if "interrupted by" in line]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_sigint_saves_a_checkpoint_and_continuing_matches_the_uninterrupted_run(sft, tmp_path):
    out, straight = tmp_path / "run", tmp_path / "straight"
    proc = _launch(out, "--max_steps", "12", env={"STEP_SLEEP": "0.3"})
    wait_for(lambda: _rows(out) >= 3, proc, "step 3 was logged")
    proc.send_signal(signal.SIGINT)
    stdout, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err

    line = _interrupt_line(err)
    step = int(line.split("after step ")[1].split()[0])
    assert 3 <= step < 12
    ckpt = out / "checkpoints" / f"step-{step}"
    assert line.endswith(f"of 12; checkpoint saved: {ckpt}")
    checkpoint.verify_checkpoint(str(ckpt))  # complete: every file matches its recorded size and checksum
    assert [r["step"] for r in read_metrics(out)] == list(range(1, step + 1))  # the steps before it were logged
    assert not [n for n in os.listdir(out / "checkpoints") if n.startswith(".")]  # no leftovers
    assert not os.path.exists(out / "adapter")  # the run is not finished: no final adapter

    # the printed command continues the run, to the same end as a run that was never interrupted
    command = [line for line in err.splitlines() if line.strip().startswith("continue:")]
    assert command == [f"  continue: fused-stable sft --output_dir {out} --resume latest"]
    code, stdout, err2 = sft(*shlex.split(command[0].split("fused-stable sft", 1)[1]))
    assert code == 0, err2
    assert f"resumed from {ckpt}" in stdout
    assert sft(*ARGS, "--max_steps", "12", "--output_dir", straight)[0] == 0
    a, b = read_metrics(straight), read_metrics(out)
    assert [r["step"] for r in b] == list(range(1, 13))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # exact floats
    wa = load_file(straight / "checkpoints" / "step-12" / "weights.safetensors")
    wb = load_file(out / "checkpoints" / "step-12" / "weights.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # elapsed_s is the run's training time: it goes on from the checkpoint, it does not restart at 0
    elapsed = [r["elapsed_s"] for r in b]
    assert all(x < y for x, y in zip(elapsed, elapsed[1:])), elapsed
    assert elapsed[step] > elapsed[step - 1] >= 0.3 * (step - 1)


@pytest.mark.slow  # one more training process: ~15 s on a quiet machine
def test_second_signal_during_the_save_abandons_it_and_keeps_the_earlier_checkpoints(tmp_path):
    """SIGTERM (as a scheduler sends it) starts the interrupt's save; a SIGINT during that save abandons it:
    exit code 143 (the first signal's), nothing half-written, every earlier checkpoint intact."""
    out, flag = tmp_path / "run", tmp_path / "saving"
    proc = _launch(
        out,
        "--max_steps",
        "50",
        "--save_steps",
        "2",
        "--save_total_limit",
        "0",
        env={"STEP_SLEEP": "0.2", "SLOW_SAVE_FLAG": str(flag)},
    )
    wait_for(lambda: _rows(out) >= 3 and os.path.isdir(out / "checkpoints" / "step-2"), proc, "step-2 was saved")
    proc.send_signal(signal.SIGTERM)
    wait_for(flag.exists, proc, "the interrupt's save began")
    earlier = {
        name: checkpoint.verify_checkpoint(str(out / "checkpoints" / name))["files"]
        for name in os.listdir(out / "checkpoints")
        if name.startswith("step-")
    }
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err
    assert "SIGTERM received: finishing this step, then saving a checkpoint" in err
    newest = max(earlier, key=lambda name: int(name.split("-")[1]))
    assert (
        f"interrupted again: stopped at once; the newest complete checkpoint is {out / 'checkpoints' / newest}" in err
    )
    # the abandoned save left nothing behind, and every earlier checkpoint is intact and unchanged
    names = os.listdir(out / "checkpoints")
    assert sorted(names) == sorted(earlier), names
    for name, files in earlier.items():
        assert checkpoint.verify_checkpoint(str(out / "checkpoints" / name))["files"] == files


@pytest.mark.slow  # torchrun with 2 ranks: ~20 s on a quiet machine
def test_torchrun_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    out, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    proc = _launch(
        out, "--max_steps", "40", "--save_total_limit", "0", env={"STEP_SLEEP": "0.2"}, torchrun=True, pid_dir=pids
    )
    wait_for(lambda: _rows(out) >= 3 and len(os.listdir(pids)) == 2, proc, "step 3 was logged")
    os.kill(int((pids / "rank-1").read_text()), signal.SIGINT)  # rank 1 only: rank 0 must learn it from rank 1
    stdout, err = proc.communicate(timeout=240)
    assert proc.returncode != 0  # torchrun reports workers that exited non-zero as a failure
    line = _interrupt_line(stdout + err)  # printed once, by rank 0
    step = int(line.split("after step ")[1].split()[0])
    ckpt = out / "checkpoints" / f"step-{step}"
    checkpoint.verify_checkpoint(str(ckpt))
    assert checkpoint.read_trainer_state(str(ckpt))["world_size"] == 2
    assert (
        f"continue: torchrun --standalone --nproc-per-node 2 -m fused_stable sft --output_dir {out} --resume latest"
        in err
    )
    assert [r["step"] for r in read_metrics(out)] == list(range(1, step + 1))
    # torchrun's summary: the ranks exited as interrupted (one may instead show the SIGTERM torchrun sends the
    # rest of the group once the first has exited, if it was still tearing down)
    codes = {ln.split(":")[1].split()[0] for ln in err.splitlines() if ln.strip().startswith("exitcode")}
    assert "130" in codes and codes <= {"130", "-15"}, err[-3000:]
