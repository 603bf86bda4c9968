"""The page's API driven with gradio_client, on real `fused-stable sft` processes of the tiny model: start, live
status, a second start refused, pause, resume to the end with the same final weights as an uninterrupted run,
stop, a restarted webui that finds the running run, the CLI's own messages for bad values, and nothing read or
written outside the workspace."""

import os
import time

import httpx
import pytest
import torch
import yaml
from conftest import TINY_KEYS, Served
from gradio_client import handle_file
from gradio_client.exceptions import AppError
from safetensors.torch import load_file

from fused_stable.train.run import outputs, sft
from fused_stable.train.run.report import read_metrics
from fused_stable.webui.runs import STATES


def _yaml(**keys):
    return yaml.safe_dump({**TINY_KEYS, **keys}, sort_keys=False)


def _status(client, run=""):
    status = client.predict(run, api_name="/run_status")
    assert status["state"] in STATES, status
    return status


def _wait(client, condition, what, timeout=240):
    deadline = time.monotonic() + timeout
    while True:
        status = _status(client)
        if condition(status):
            return status
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; last status {status}")
        if status["state"] in ("failed", "finished") and not condition(status):
            pytest.fail(f"the run ended ({status['state']}) before {what}: {status}")
        time.sleep(0.2)


def _refused(client, api_name, *args) -> str:
    with pytest.raises(AppError) as info:
        client.predict(*args, api_name=api_name)
    return str(info.value)


def test_start_pause_resume_reaches_the_uninterrupted_weights(served, tmp_path, capsys):
    client = served.client
    started = client.predict(_yaml(max_steps=16, output_dir="paused"), api_name="/start_run")
    assert started["state"] == "running" and started["run_dir"] == os.path.join(served.workspace.root, "paused")

    # one run at a time: a second start is refused while the first is going, and starts nothing
    message = _refused(client, "/start_run", _yaml(max_steps=4, output_dir="second"))
    assert "a run is already going in this workspace" in message and "paused" in message
    assert not os.path.exists(os.path.join(served.workspace.root, "second"))

    live = _wait(client, lambda s: s["step"] >= 3, "step 3")
    assert live["state"] == "running" and live["max_steps"] == 16
    assert isinstance(live["loss"], float) and isinstance(live["grad_norm"], float) and live["alerts"] == []
    assert live["max_grad_norm"] == 1.0 and live["eta_s"] is not None

    asked = client.predict(api_name="/pause_run")
    assert asked["request"] == "pause"
    paused = _wait(client, lambda s: s["state"] != "running", "the pause")
    assert paused["state"] == "paused" and paused["can_resume"], paused
    assert 3 <= paused["step"] < 16 and paused["exit_code"] == 130
    assert paused["checkpoint"].endswith(f"checkpoints/step-{paused['step']}")
    assert not os.path.exists(os.path.join(paused["run_dir"], "adapter"))  # not finished: waiting

    resumed = client.predict("", api_name="/resume_run")
    assert resumed["state"] == "running"
    done = _wait(client, lambda s: s["state"] == "finished", "the end of the run")
    assert done["step"] == 16 and done["exit_code"] == 0 and "--resume latest" in done["command"]

    # the same run without the pause, straight through in this process
    straight = tmp_path / "straight"
    flags = [f"--{k}={v}" for k, v in {**TINY_KEYS, "max_steps": 16, "output_dir": straight}.items()]
    assert sft.main(flags) == 0, capsys.readouterr().err
    a = load_file(straight / "adapter" / "adapter_model.safetensors")
    b = load_file(os.path.join(done["run_dir"], "adapter", "adapter_model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in read_metrics(straight)] == [r["loss"] for r in read_metrics(done["run_dir"])]


def test_stop_and_a_restarted_webui_finds_the_running_run(served):
    started = served.client.predict(_yaml(max_steps=400, output_dir="stopped"), api_name="/start_run")
    _wait(served.client, lambda s: s["step"] >= 1, "step 1")
    # the run is in a session of its own: Ctrl-C in the webui's terminal, or the webui ending, does not reach it
    assert os.getsid(started["pid"]) != os.getsid(0)

    again = Served(served.workspace.root, program=None)  # a second page over the same workspace: no memory of it
    try:
        seen = _wait(again.client, lambda s: s["step"] >= 2, "step 2 seen by the second page")
        assert seen["run_dir"] == started["run_dir"] and seen["pid"] == started["pid"]
        assert again.client.predict("stopped", api_name="/run_status")["state"] == "running"
        assert again.client.predict(api_name="/stop_run")["request"] == "stop"
        stopped = _wait(again.client, lambda s: s["state"] != "running", "the stop")
    finally:
        again.close(stop_runs=False)
    assert stopped["state"] == "stopped" and stopped["exit_code"] == 130 and stopped["can_resume"]
    assert "stopped from the page" in stopped["reason"] and stopped["step"] < 400
    assert stopped["checkpoint"].endswith(f"step-{stopped['step']}")
    assert "nothing to stop" in _refused(served.client, "/stop_run")


def test_a_guard_stop_says_why_and_offers_resume(served):
    # thresholds no real run would use, so that the guard stops this one within a few steps (at step 27)
    keys = {"max_steps": 60, "output_dir": "guarded", "guard": "stop", "guard_grad_z": 0.001, "guard_grad_ratio": 0}
    served.client.predict(_yaml(**keys), api_name="/start_run")
    stopped = _wait(served.client, lambda s: s["state"] != "running", "the guard's stop")
    assert stopped["state"] == "stopped" and stopped["exit_code"] == 3 and stopped["can_resume"], stopped
    step = stopped["step"]
    assert stopped["reason"].startswith(f"the guard stopped the run: guard: stopped at step {step} (grad_spike)")
    assert [a["action"] for a in stopped["alerts"]] == ["stop"] and stopped["alerts"][0]["kind"] == "grad_spike"
    assert stopped["checkpoint"].endswith(f"step-{step}")


def test_bad_values_get_the_cli_messages_and_start_nothing(served, capsys):
    for bad, flag in (({"lr": "inf"}, "--lr=inf"), ({"lerning_rate": 1}, None), ({"batch_size": 0}, "--batch_size=0")):
        message = _refused(served.client, "/start_run", _yaml(output_dir="bad", **bad))
        if flag is not None:  # the very line `fused-stable sft` prints for the same value
            assert sft.main(["--model=tiny", flag]) == 2
            cli_line = capsys.readouterr().err.strip()
            assert cli_line == f"fused-stable sft: error: {message}"
        else:
            assert message == "unknown key 'lerning_rate'; see `fused-stable sft --help` for the keys"
    assert "invalid YAML at line 1" in _refused(served.client, "/start_run", "lr: [1,")
    assert "resume is not a key" in _refused(served.client, "/start_run", _yaml(resume="latest"))
    old = os.path.join(served.workspace.root, "old-run")  # a run's folder: refused as sft refuses it
    outputs.claim(old, ["run.yaml"])
    message = _refused(served.client, "/start_run", _yaml(output_dir="old-run"))
    assert message.startswith(f"output_dir {old!r} already holds a run; it saved no checkpoint"), message
    assert not os.path.exists(os.path.join(served.workspace.root, "bad"))


def test_nothing_outside_the_workspace_is_read_or_written(served, tmp_path):
    root = served.workspace.root
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    os.symlink(outside, os.path.join(root, "link"))
    absolute, climbs, through_link, hidden = (
        "is an absolute path",
        "climbs out with '..'",
        "leads outside",
        "names a hidden entry",
    )
    cases = {
        "output_dir": [("../escape", climbs), (str(outside / "run"), absolute), ("link/run", through_link),
                       (".webui/run", hidden), ("a/../../escape", climbs)],
        "dataset": [(str(outside / "data.jsonl"), absolute), ("../outside/data.jsonl", climbs),
                    ("link/data.jsonl", through_link)],
        "model": [(str(outside), absolute), ("~/models", absolute), ("link", through_link)],
    }  # fmt: skip
    for key, values in cases.items():
        for value, why in values:
            message = _refused(served.client, "/start_run", _yaml(**{key: value, "max_steps": 2}))
            assert message.startswith(f"{key} {value!r} {why}"), message
    assert os.listdir(outside) == ["data.jsonl"] and not os.path.exists(tmp_path / "escape")
    assert "'..'" in _refused(served.client, "/run_status", "../outside")
    assert "'..'" in _refused(served.client, "/resume_run", "../outside")
    assert "absolute" in _refused(served.client, "/chat", str(outside), "hi", 4)
    assert "absolute" in _refused(served.client, "/export_run", "paused", str(outside / "export"), False)

    # an upload keeps only its base name, inside uploads/
    evil = tmp_path / "evil.jsonl"
    evil.write_text('{"instruction": "a", "output": "b"}\n')
    value, message = served.client.predict(handle_file(str(evil)), api_name="/upload_dataset")
    assert value == "uploads/evil.jsonl" and os.path.isfile(os.path.join(root, "uploads", "evil.jsonl"))
    assert served.workspace.upload_target("../../etc/evil.jsonl") == os.path.join(root, "uploads", "evil.jsonl")
    # gradio serves no file it did not create itself
    for path in ("/etc/passwd", str(evil), os.path.join(root, "uploads", "evil.jsonl")):
        assert httpx.get(f"{served.url}gradio_api/file={path}").status_code in (403, 404)
