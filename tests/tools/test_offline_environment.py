"""Every command runs offline (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE), set by its main(), never at import time:
importing a command's module changes no environment variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fused_stable.cli import OFFLINE_ENVIRONMENT

COMMANDS = {
    "sft": "fused_stable.train.run.sft",
    "chat": "fused_stable.train.saved.chat",
    "export": "fused_stable.train.saved.export",
    "stress": "fused_stable.stress",
    "bench": "fused_stable.bench",
    "webui": "fused_stable.webui.cli",
}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_importing_the_commands_sets_no_environment_variable():
    """In a fresh interpreter (nothing imported yet, the variables unset): import every command's module and
    the dispatcher, and compare the whole environment before and after."""
    code = (
        "import importlib, json, os, sys\n"
        "before = dict(os.environ)\n"
        f"for name in {sorted(COMMANDS.values()) + ['fused_stable.cli']!r}:\n"
        "    importlib.import_module(name)\n"
        "after = dict(os.environ)\n"
        "print(json.dumps({k: [before.get(k), after.get(k)] for k in set(before) | set(after) "
        "if before.get(k) != after.get(k)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_ENVIRONMENT}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_main_sets_the_offline_environment(command, monkeypatch, capsys):
    """`--help` is the cheapest run of each main(): the variables are set once it returns."""
    import importlib

    from fused_stable import cli

    for name in OFFLINE_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    module = importlib.import_module(cli.SUBCOMMANDS[command][0])
    assert module.main(["--help"]) == 0
    capsys.readouterr()
    assert {name: os.environ.get(name) for name in OFFLINE_ENVIRONMENT} == OFFLINE_ENVIRONMENT


def test_a_value_the_user_set_is_kept(monkeypatch):
    from fused_stable.cli import offline_environment

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    offline_environment()
    assert os.environ["HF_HUB_OFFLINE"] == "0" and os.environ["TRANSFORMERS_OFFLINE"] == "1"
