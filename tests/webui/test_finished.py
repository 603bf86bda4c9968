"""Chat and export on a finished run go through the commands' own code (the page's answer is the one
`fused-stable chat --prompt` prints; the export is `fused-stable export`'s, with its refusals), the Runs view
lists the workspace's runs, and --auth is enforced."""

import os

import httpx
import pytest
from conftest import TINY_KEYS, Served
from gradio_client.exceptions import AppError

from fused_stable.train.run import sft
from fused_stable.train.run.outputs import read_manifest
from fused_stable.train.saved import chat


@pytest.fixture(scope="module")
def finished(tmp_path_factory, gradio_env):
    server = Served(tmp_path_factory.mktemp("workspace"))
    run_dir = os.path.join(server.workspace.root, "done")
    # with a system message: the page answers with it, as chat does (stored with the run)
    keys = {**TINY_KEYS, "max_steps": 2, "output_dir": run_dir, "system": "You are a helpful assistant."}
    flags = [f"--{k}={v}" for k, v in keys.items()]
    assert sft.main(flags) == 0  # a run made on the command line: the page shows it all the same
    yield server
    server.close()


def test_chat_answers_as_the_chat_command_does(finished, capsys):
    reply = finished.client.predict("done", "What is 2 + 3?", 12, api_name="/chat")
    capsys.readouterr()
    code = chat.main(["--adapter", os.path.join(finished.workspace.root, "done"), "--prompt", "What is 2 + 3?",
                      "--max_new_tokens", "12"])  # fmt: skip
    assert code == 0
    assert reply == capsys.readouterr().out.strip()
    with pytest.raises(AppError, match="has no final adapter or model yet"):
        finished.client.predict("nothing-here", "hi", 4, api_name="/chat")


def test_the_chat_tab_keeps_the_conversation(finished):
    from fused_stable.webui.app import chat_turn

    turn = chat_turn(finished.page)
    history, cleared = turn("done", [], "What is 2 + 3?")
    assert cleared == "" and [m["role"] for m in history] == ["user", "assistant"]
    # gradio 6 gives the history back as lists of parts
    shown = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in history]
    history, _ = turn("done", shown, "And 4 + 4?")
    assert [m["content"] for m in history[:3]] == ["What is 2 + 3?", shown[1]["content"][0]["text"], "And 4 + 4?"]
    expected = finished.page.finished.reply("done", history[:3])
    assert history[3] == {"role": "assistant", "content": expected}


def test_export_is_the_export_command(finished):
    result = finished.client.predict("done", "done-merged", False, api_name="/export_run")
    target = os.path.join(finished.workspace.root, "done-merged")
    assert result["name"] == "done-merged" and result["output_dir"] == target
    assert read_manifest(target)["created_by"] == "fused-stable export"
    assert os.path.isfile(os.path.join(target, "config.json"))
    with pytest.raises(AppError, match="already holds an export; pass --overwrite to replace it"):
        finished.client.predict("done", "done-merged", False, api_name="/export_run")
    assert finished.client.predict("done", "done-merged", True, api_name="/export_run")["name"] == "done-merged"


def test_the_runs_list_and_the_status_of_a_run_made_elsewhere(finished):
    frame, names = finished.page.runs_table()
    assert names == ["done"]  # the export folder is not a run
    assert list(frame.iloc[0][["run", "state", "step"]]) == ["done", "finished", "2/2"]
    status = finished.client.predict("done", api_name="/run_status")
    assert status["state"] == "finished" and status["step"] == 2 and status["max_steps"] == 2
    with pytest.raises(AppError, match="no run in this workspace yet"):  # the page itself started none
        finished.client.predict("", api_name="/run_status")


def test_auth_is_asked_for(tmp_path, gradio_env):
    server = Served(tmp_path, auth=("me", "secret"))
    try:
        with pytest.raises(AppError, match="no run in this workspace yet"):  # in with the password
            server.client.predict("", api_name="/run_status")
        assert httpx.get(f"{server.url}gradio_api/info").status_code == 401  # and not without
        bad = httpx.post(f"{server.url}login", data={"username": "me", "password": "wrong"})
        assert bad.status_code == 400
    finally:
        server.close()
