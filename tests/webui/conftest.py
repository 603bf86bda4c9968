"""Fixtures for the page's tests: a workspace, the page served in this process on a free loopback port (one
server per test module), and a gradio_client on it. Runs are real `fused-stable sft` processes on the tiny
model, made slow enough to pause (`slow_runner.py`)."""

import os
import signal
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SLOW_RUNNER = [sys.executable, os.path.join(HERE, "slow_runner.py"), "0.25"]  # 0.25 s after each logged step

# a few steps of the tiny scratch Llama on a small slice of the arithmetic task, logged every step
TINY_KEYS = {
    "model": "tiny",
    "dataset": "arithmetic",
    "arithmetic_examples": 64,
    "target_modules": "q_proj,v_proj",
    "batch_size": 4,
    "max_length": 96,
    "logging_steps": 1,
    "save_steps": 0,
    "tensorboard": False,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A page served in this process: `url`, `page` (its handlers), `workspace`, and a `client`."""

    def __init__(self, workspace_root, program=None, auth=None, tick_s=None):
        from gradio_client import Client

        from fused_stable.webui.server import create_app, launch

        self.app, self.page = create_app(str(workspace_root), program=program, tick_s=tick_s)
        self.workspace = self.page.workspace
        self.url = launch(self.app, host="127.0.0.1", port=free_port(), auth=auth)
        self.client = Client(self.url, verbose=False, auth=auth)

    def close(self, stop_runs=True):
        """Close the server; with `stop_runs`, first end a run still going (a test that failed half-way),
        so no training process outlives the test run."""
        if stop_runs:
            for proc in self.page.controller.running_processes():
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.app.close()


@pytest.fixture(scope="module")
def gradio_env():
    """create_app sets these two for its process (telemetry off, gradio's upload cache in the workspace):
    give the test process its own values back afterwards."""
    saved = {k: os.environ.get(k) for k in ("GRADIO_ANALYTICS_ENABLED", "GRADIO_TEMP_DIR")}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def served(tmp_path_factory, gradio_env):
    server = Served(tmp_path_factory.mktemp("workspace"), program=SLOW_RUNNER)
    yield server
    server.close()
