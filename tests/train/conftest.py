"""Fixture for the trainer tests: `sft` runs the `fused-stable sft` CLI in-process."""

import pytest

from fused_stable.train.run import sft as sft_command


@pytest.fixture
def sft(capsys):
    """Run the CLI in-process; returns (exit code, stdout, stderr)."""

    def run(*argv):
        code = sft_command.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run
