"""The process of one run started by the page: `python -m fused_stable.webui.runner WORKSPACE RUN_DIR -- ARGS`
is `fused-stable sft ARGS` in this same process (SIGINT reaches the trainer as Ctrl-C does), which then
records how it ended (`exit.json`, so a page started later still knows, after the page that started it is
gone) and gives the workspace lock back. A process killed outright records nothing: its lock is stale by its
PID, and the page reports the run as failed.
"""

from __future__ import annotations

import os
import sys
import traceback

from fused_stable.webui.lock import WorkspaceLock
from fused_stable.webui.paths import CONTROL_DIR
from fused_stable.webui.records import RunRecord


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[2] != "--":
        print("usage: python -m fused_stable.webui.runner WORKSPACE RUN_DIR -- SFT_ARGS", file=sys.stderr)
        return 2
    workspace_root, run_dir, sft_args = argv[0], argv[1], argv[3:]
    code = 1
    try:
        from fused_stable import cli

        code = cli.main(["sft", *sft_args])
    except KeyboardInterrupt:  # a signal before the trainer took SIGINT over (while importing)
        code = 130
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        RunRecord(workspace_root, run_dir).ended(os.getpid(), code)
        WorkspaceLock(os.path.join(workspace_root, CONTROL_DIR)).release(os.getpid())
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
