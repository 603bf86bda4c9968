"""Without a server: the one-run lock and its stale detection, the states the reader gives a run from its files
and records (paused, stopped by the page, stopped by the guard with its reason, killed, failed), the
`fused-stable webui` options (a public bind without --auth is one line and exit code 2), and the form."""

import json
import os
import subprocess
import sys

import pytest
import yaml

import fused_stable
from fused_stable import cli
from fused_stable.errors import UserError
from fused_stable.webui import form
from fused_stable.webui.controller import RunController
from fused_stable.webui.lock import WorkspaceLock, process_alive, process_start_time
from fused_stable.webui.paths import Workspace
from fused_stable.webui.records import RunRecord
from fused_stable.webui.runs import read_status


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ------------------------------------------------------------------------------------------ the lock
def test_a_live_lock_refuses_a_second_run_and_a_dead_one_is_taken_over(tmp_path):
    lock = WorkspaceLock(str(tmp_path))
    lock.acquire("/ws/first", os.getpid())
    with pytest.raises(UserError, match=r"a run is already going in this workspace \(/ws/first, process \d+\)"):
        lock.acquire("/ws/second", os.getpid())
    lock.release(os.getpid() + 1)  # another process's release leaves it alone
    assert lock.holder()["run_dir"] == "/ws/first"

    # a run that crashed (its process is gone) does not leave the workspace stuck
    lock.hand_over("/ws/first", _dead_pid())
    assert lock.holder() is None and not os.path.exists(lock.path)
    lock.acquire("/ws/second", os.getpid())
    assert lock.holder()["run_dir"] == "/ws/second"


def test_a_reused_pid_is_not_the_run_that_took_the_lock(tmp_path):
    lock = WorkspaceLock(str(tmp_path))
    with open(lock.path, "w") as f:  # this process's PID, but a start time that is not this process's
        json.dump({"run_dir": "/ws/old", "pid": os.getpid(), "start_time": process_start_time(os.getpid()) - 1}, f)
    assert lock.holder() is None
    assert process_alive(os.getpid(), process_start_time(os.getpid()))
    assert not process_alive(_dead_pid())


def test_a_damaged_lock_is_stale_once_it_is_not_being_written(tmp_path):
    lock = WorkspaceLock(str(tmp_path))
    with open(lock.path, "w") as f:
        f.write("{")
    assert lock.holder() is not None  # just written: another start may be writing it
    os.utime(lock.path, (0, 0))
    assert lock.holder() is None


# ------------------------------------------------------------------------------------------ states
def _run(tmp_path, name="run"):
    ws = Workspace(str(tmp_path))
    run_dir = os.path.join(ws.root, name)
    os.makedirs(os.path.join(run_dir, "checkpoints", "step-4"))
    open(os.path.join(run_dir, "checkpoints", "step-4", "COMPLETE"), "w").close()
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step in range(1, 5):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "loss": 2.0,
                        "grad_norm": 3.0,
                        "lr": 1e-3,
                        "skipped": step == 2,
                        "skipped_total": int(step >= 2),
                        "tokens_per_s": 10.0,
                        "elapsed_s": float(step),
                    }
                )
                + "\n"
            )
        f.write('{"step": 5, "loss"')  # a line being written: left for the next read
    record = RunRecord(ws.root, run_dir)
    record.new_launch("start", [], "fused-stable sft ...")
    return ws, run_dir, record


def test_states_from_the_exit_record_and_the_request(tmp_path):
    ws, run_dir, record = _run(tmp_path)
    pid = _dead_pid()
    record.started(pid, None)
    killed = read_status(ws, run_dir)
    assert killed.state == "failed" and "without saying how" in killed.reason and killed.can_resume
    assert killed.step == 4 and killed.loss == 2.0 and killed.skipped_steps == [2]

    record.request("pause")
    record.ended(pid, 130)
    assert read_status(ws, run_dir).state == "paused"
    record.request("stop")
    assert read_status(ws, run_dir).state == "stopped"
    record.ended(pid, 2)
    with open(record.log_path, "a") as f:
        f.write("fused-stable sft: error: dataset 'x' not found\n")
    failed = read_status(ws, run_dir)
    assert failed.state == "failed" and failed.reason == "exit code 2: fused-stable sft: error: dataset 'x' not found"
    os.makedirs(os.path.join(run_dir, "adapter"))
    open(os.path.join(run_dir, "adapter", "adapter_model.safetensors"), "w").close()
    record.ended(pid, 0)
    assert read_status(ws, run_dir).state == "finished" and not read_status(ws, run_dir).can_resume


def test_a_guard_stop_says_why_and_offers_resume(tmp_path):
    ws, run_dir, record = _run(tmp_path)
    with open(os.path.join(run_dir, "alerts.jsonl"), "w") as f:
        f.write(
            json.dumps(
                {
                    "step": 3,
                    "kind": "grad_spike",
                    "value": "Infinity",
                    "threshold": 6.0,
                    "action": "stop",
                    "detected_at": 4,
                    "top_tensors": [],
                }
            )
            + "\n"
        )
    with open(record.log_path, "a") as f:
        f.write("fused-stable sft: guard: step 3: grad-norm spike z=inf > 6 -> stop\n  resume: fused-stable sft ...\n")
    record.started(_dead_pid(), None)
    record.ended(record.process()["pid"], 3)
    status = read_status(ws, run_dir)
    assert status.state == "stopped" and status.can_resume and status.exit_code == 3
    assert status.reason == "the guard stopped the run: guard: step 3: grad-norm spike z=inf > 6 -> stop"
    assert status.alerts[0]["kind"] == "grad_spike" and status.alerts[0]["value"] == float("inf")
    assert status.to_dict()["alerts"][0]["value"] == "Infinity"  # strict JSON for the API


def test_a_running_process_is_running_until_it_ends(tmp_path):
    ws, run_dir, record = _run(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record.started(proc.pid, process_start_time(proc.pid))
        assert read_status(ws, run_dir).state == "running"
        proc.kill()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended, not yet reaped: a zombie
        assert read_status(ws, run_dir).state == "failed"
    finally:
        proc.kill()
        proc.wait()
    assert read_status(ws, run_dir).state == "failed"


# ------------------------------------------------------------------------------------------ the command
@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.5", "::", "example.org"])
def test_a_public_bind_without_auth_is_one_line_and_exit_code_2(host, capsys, tmp_path, monkeypatch):
    served = []
    monkeypatch.setattr("fused_stable.webui.server.serve", lambda *args, **kwargs: served.append(args) or 0)
    assert cli.main(["webui", "--host", host, "--workspace", str(tmp_path / "ws")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"fused-stable webui: error: --host {host} is not a loopback address")
    assert not os.path.exists(tmp_path / "ws") and served == []


def test_loopback_binds_and_auth_pass_the_checks(tmp_path):
    from fused_stable.webui.cli import build_parser, check_args

    def check(*argv):
        return check_args(build_parser().parse_args([*argv, "--workspace", str(tmp_path)]))

    assert check("--host", "127.0.0.1") is None and check("--host", "localhost") is None
    assert check("--host", "::1") is None
    assert check("--host", "0.0.0.0", "--auth", "me:se:cret") == ("me", "se:cret")
    for bad in ("me", ":pw", "me:"):
        with pytest.raises(UserError, match="--auth must be USER:PASSWORD"):
            check("--auth", bad)
    assert cli.main(["webui", "--port", "70000"]) == 2


# ------------------------------------------------------------------------------------------ the form
def test_safe_defaults_and_the_form_give_the_keys_and_command_they_show(tmp_path):
    fields = {key: form.default(key) for key in form.FIELD_KEYS}
    fields.update({k: value for k, (value, _) in form.SAFE_DEFAULTS.items()})
    fields.update({"model": "tiny", "dataset": "arithmetic", "max_steps": 20.0})
    keys = form.run_keys(fields, "LoRA+", "exp1", "logging_steps: 1\nlr: 0.0005\n")
    # only what differs from the sft defaults, the tuner's keys, and the YAML box over the fields
    assert keys == {
        "model": "tiny",
        "dataset": "arithmetic",
        "max_steps": 20,
        "lora_r": 16,
        "lora_alpha": 32,
        "loraplus_lr_ratio": 16.0,
        "output_dir": "exp1",
        "logging_steps": 1,
        "lr": 0.0005,
    }
    assert form.SAFE_DEFAULTS["max_grad_norm"][0] == 1.0 and form.SAFE_DEFAULTS["scheduler"][0] == "cosine"
    assert 0.05 <= form.SAFE_DEFAULTS["warmup_ratio"][0] <= 0.1 and 8 <= form.SAFE_DEFAULTS["lora_r"][0] <= 64
    assert "| `max_grad_norm` | `1.0` |" in form.safe_defaults_table()
    launch = RunController(Workspace(str(tmp_path))).prepare(yaml.safe_load(yaml.safe_dump(keys, sort_keys=False)))
    assert launch.command.startswith("fused-stable sft --model=tiny --dataset=arithmetic --max_steps=20")
    assert f"--output_dir={tmp_path}/exp1" in launch.command
    assert form.run_keys(fields, "QLoRA", "", "")["quant_bits"] == 4
    with pytest.raises(UserError, match="must be a YAML mapping"):
        form.run_keys(fields, "LoRA", "", "- a list")


def test_the_form_offers_the_update_rule_and_its_state_precision(tmp_path):
    """The rule (adamw | lion | muon) and the state precision are form fields (issue 35 item 6): as sft takes
    them, written only when not the default, and in the command line the page shows."""
    assert form.OPTIMIZER_CHOICES == {
        "optim": tuple(fused_stable.OPTIMIZERS),
        "state_precision": ("fp32", "bf16", "8bit"),
    }
    assert {"optim", "state_precision"} <= set(form.FIELD_KEYS)
    fields = {key: form.default(key) for key in form.FIELD_KEYS}
    assert "optim" not in form.form_keys(fields, "LoRA", "") and "state_precision" not in form.form_keys(
        fields, "LoRA", ""
    )
    fields.update({"model": "tiny", "dataset": "arithmetic", "optim": "lion", "state_precision": "8bit"})
    keys = form.run_keys(fields, "LoRA", "lion", "")
    assert (keys["optim"], keys["state_precision"]) == ("lion", "8bit")
    launch = RunController(Workspace(str(tmp_path))).prepare(yaml.safe_load(yaml.safe_dump(keys, sort_keys=False)))
    assert "--optim=lion --state_precision=8bit" in launch.command


def test_the_dataset_field_takes_several_datasets_each_inside_the_workspace(tmp_path):
    """A comma list in the dataset field (or a YAML list, and eval_dataset in the box): each file resolved in the
    workspace on its own, the built-in tasks and each item's #N kept; one item outside is refused."""
    fields = {key: form.default(key) for key in form.FIELD_KEYS}
    fields.update({"model": "tiny", "dataset": "arithmetic, uploads/a.jsonl#5"})
    keys = form.run_keys(fields, "LoRA", "several", "eval_dataset: [identity, uploads/b.json]\n")
    assert keys["dataset"] == "arithmetic, uploads/a.jsonl#5"
    launch = RunController(Workspace(str(tmp_path))).prepare(keys)
    assert f"--dataset=arithmetic,{tmp_path}/uploads/a.jsonl#5" in launch.args
    assert f"--eval_dataset=identity,{tmp_path}/uploads/b.json" in launch.args
    assert form.form_keys({**fields, "dataset": ["identity", "uploads/a.jsonl"]}, "LoRA", "")["dataset"] == (
        "identity,uploads/a.jsonl"
    )
    with pytest.raises(UserError, match="dataset '../a.jsonl' climbs out"):
        RunController(Workspace(str(tmp_path))).prepare({**keys, "dataset": "identity,../a.jsonl"})
