"""How a run of `fused-stable sft` that stops early says so: one line with why, the newest complete checkpoint
(read back from disk, not assumed) and the exact command that continues it. A reason outside the run (the disk or
quota filled up, another torchrun rank died) ends it with exit code FAILED."""

from __future__ import annotations

import errno
import os
import shlex
import sys


def continue_command(output_dir: str, world_size: int) -> str:
    """The exact command that continues the run in output_dir."""
    launcher = (
        f"torchrun --standalone --nproc-per-node {world_size} -m fused_stable sft"
        if world_size > 1
        else "fused-stable sft"
    )
    return f"{launcher} --output_dir {shlex.quote(output_dir)} --resume latest"


# the run could not go on for a reason outside it (exit code 1): the disk or quota filled up, or under torchrun
# another rank died; the newest complete checkpoint is intact and the message says how to continue
FAILED = 1
NO_SPACE = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "a file-size limit was reached",
}


def what_failed(exc: OSError, output_dir: str) -> str:
    from fused_stable.train.run.checkpoint import SaveFailed

    if isinstance(exc, SaveFailed):
        return f"saving {exc.checkpoint} failed ({exc.strerror}) and left nothing behind"
    where = exc.filename or f"the files of {output_dir}"
    return f"writing {where} failed ({exc.strerror})"


def report_failure(setup, why: str, before_continuing: str = "", every_rank: bool = False) -> None:
    """One line: why the run stopped, the newest complete checkpoint (read back, not assumed) and how to continue."""
    from fused_stable.train.run import checkpoint

    if not (every_rank or setup.runtime.is_main):
        return
    newest, _ = checkpoint.latest_verified_checkpoint(setup.cfg.output_dir)
    where = (
        f"the newest complete checkpoint, {newest}, is intact; {before_continuing}continue: "
        f"{continue_command(setup.cfg.output_dir, setup.runtime.world_size)}"
        if newest
        else "the run has no complete checkpoint (start it again with --overwrite)"
    )
    print(f"fused-stable sft: error: {why}; {where}", file=sys.stderr, flush=True)


def report_abandoned(output_dir: str, world_size: int) -> None:
    """After a second interrupt: what is on disk now (read back, not assumed)."""
    from fused_stable.train.run import checkpoint

    newest, _ = checkpoint.latest_verified_checkpoint(output_dir)
    if newest is None:
        print(
            "fused-stable sft: interrupted again: stopped at once; the run has no complete checkpoint "
            "(start it again with --overwrite)",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(
            f"fused-stable sft: interrupted again: stopped at once; the newest complete checkpoint is "
            f"{newest}\n  continue: {continue_command(output_dir, world_size)}",
            file=sys.stderr,
            flush=True,
        )


def no_usable_checkpoint(problem: str, output_dir: str) -> str:
    """What `--resume latest` found when no checkpoint verifies, and what to do, without deleting any."""
    from fused_stable.train.run import checkpoint

    found = checkpoint.list_checkpoints(output_dir, include_incomplete=True)
    if not found:
        return f"{problem}; the run never saved one: start it again with --overwrite (without --resume)"
    names = ", ".join(os.path.basename(path) for _, path in found[-4:])
    return (
        f"{problem}; the run saved {len(found)} ({names}) and none verifies: to keep them, start the run again in "
        "another output_dir (--overwrite here would delete them)"
    )
