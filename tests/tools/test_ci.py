""".ci/run runs the README's own test command, and the test run names the versions it resolved first."""

import importlib.metadata
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the dependencies whose releases have changed what the tests see (issue 28): each must be named in the header
MUST_BE_REPORTED = ("torch", "triton", "transformers", "peft", "bitsandbytes", "accelerate", "lightning", "trl")


def test_ci_runs_the_command_after_the_readme_marker():
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    after_marker = lines[lines.index("<!-- ci-test-command -->") + 1 :]
    readme_command = next(line for line in after_marker if not line.startswith("```"))
    printed = subprocess.run(
        ["bash", os.path.join(REPO_ROOT, ".ci", "run"), "--print-command"], capture_output=True, text=True, check=True
    ).stdout
    assert printed == readme_command + "\n"
    assert "pip install -e " in readme_command and "-m pytest" in readme_command


def test_a_quiet_test_run_prints_the_resolved_versions_first():
    # `-q` hides pytest's own header: the README's command uses it, and the versions must still come first
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "tests/tools/test_ci.py"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("versions: python ")
    for name in MUST_BE_REPORTED:
        try:
            assert f"{name} {importlib.metadata.version(name)}" in first
        except importlib.metadata.PackageNotFoundError:
            assert f"{name} not installed" in first
