"""Launched by test_faults.py as `python THIS PLAN.json`: real `fused-stable sft` processes that die, or run out of
space, at exact points. The imports are paid once; each case is a child forked from this process (torch has
started no thread yet at that point), which runs `fused_stable.train.run.sft.main` with the plan's arguments and its
own output_dir, its stdout and stderr going to `<log>.out` / `<log>.err` (`log`: the output_dir unless the case
names another place; beside the folder, which must be new). The results, one per case (`{"name", "signal",
"code"}`), are printed as JSON on stdout.

A case's fault, keyed by what the child does:
  {"kill": [stage, step]}   SIGKILL itself when the checkpoint save of `step` reaches `stage` (the stages of
                            fused_stable.train.run.checkpoint._save_stage: "tmp", a file's name, "renamed", ...);
  {"cut_metrics": step}     write the first half of metrics.jsonl's line for `step`, fsync it, then SIGKILL itself;
  {"file_size_limit": [stage, step, bytes]}  at that save stage, lower RLIMIT_FSIZE to `bytes`: the next write past
                            it fails with EFBIG (Python ignores SIGXFSZ), as on a disk with no space left;
  {"fill_disk": [stage, step, path]}  at that save stage, write a file at `path` until its filesystem is full
                            (a small tmpfs the test mounted): the next write fails with ENOSPC.
"""

import json
import os
import resource
import signal
import sys
import traceback

# everything a run imports, before the first fork
import peft  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401

from fused_stable import strict_json
from fused_stable.train.run import (
    checkpoint,  # noqa: F401
    report,
    sft,
)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _at_stage(stage: str, step: int, action) -> None:
    def hook(reached: str, at: int) -> None:
        if (reached, at) == (stage, step):
            action()

    checkpoint._save_stage = hook


def _fill(path: str) -> None:
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass


def _install(fault: dict) -> None:
    if "kill" in fault:
        _at_stage(*fault["kill"], _die)
    elif "cut_metrics" in fault:
        real_log, cut_at = report.Reporter.log, fault["cut_metrics"]

        def log(self, rows):
            for row in rows:
                if row["step"] == cut_at:
                    line = strict_json.dumps(row) + "\n"
                    self._metrics.write(line[: len(line) // 2])
                    self._metrics.flush()
                    os.fsync(self._metrics.fileno())
                    _die()
                real_log(self, [row])

        report.Reporter.log = log
    elif "file_size_limit" in fault:
        stage, step, limit = fault["file_size_limit"]
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        _at_stage(stage, step, lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard)))
    elif "fill_disk" in fault:
        stage, step, path = fault["fill_disk"]
        _at_stage(stage, step, lambda: _fill(path))


def _child(case: dict, args: list[str]) -> int:
    out = case["output_dir"]
    for fd, suffix in ((1, ".out"), (2, ".err")):
        target = os.open(case.get("log", out) + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    _install(case.get("fault", {}))
    return sft.main([*args, *case.get("extra", []), "--output_dir", out])


def main(plan_path: str) -> int:
    with open(plan_path) as f:
        plan = json.load(f)
    results = []
    for case in plan["cases"]:
        pid = os.fork()
        if pid == 0:
            code = 70  # EX_SOFTWARE: the child raised (its traceback goes to its .err file)
            try:
                code = _child(case, plan["args"])
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        results.append(
            {
                "name": case["name"],
                "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            }
        )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
