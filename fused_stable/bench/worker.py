"""Worker process for one benchmark row: `python -m fused_stable.bench.worker '<job json>'`.

The parent (runner._run_worker) runs one per row on the CPU plan, and one per time-boxed row (torch.compile)
everywhere; it kills the worker when its time box runs out. On success the worker prints one `RESULT [json]`
line: the row dicts `runner.measure_group` returns in-process, the set's baseline (`pair_with`, timed alongside,
interleaved) first when there is one. Its median and quartiles ride along on the row as `paired_baseline_*_s`.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

from fused_stable import strict_json

from .contenders import CONTENDERS
from .paramsets import ParamSetSpec
from .runner import Options, measure_group


def pair_rows(rows: list[dict], contender: str) -> list[dict]:
    """The worker's rows, with the baseline's figures (when it was timed alongside) on the measured row, and a
    failed time-boxed row turned into a skip (compilation is optional: no compiler, an unsupported op)."""
    row = rows[-1]
    if row["status"] == "error" and CONTENDERS[contender].isolated:
        row.update(status="skipped", reason=f"torch.compile failed: {row['reason']}")
    if len(rows) == 2 and rows[0]["status"] == "ok":
        for key in ("median_s", "q1_s", "q3_s"):
            row[f"paired_baseline_{key}"] = rows[0][key]
        row["paired_baseline_too_wide"] = rows[0]["too_wide"]
    return rows


def exit_with_the_parent(interval_s: float = 1.0) -> None:
    """End this worker when the run that started it is gone (killed): it runs in a session of its own, so no
    signal of the parent's reaches it."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m fused_stable.bench.worker '<job json>'", file=sys.stderr)
        return 2
    exit_with_the_parent()
    job = strict_json.loads(argv[0])
    opts = Options(**{k: tuple(v) if isinstance(v, list) else v for k, v in job["opts"].items()})
    if opts.threads:
        torch.set_num_threads(opts.threads)
    contenders = [CONTENDERS[job["contender"]]]
    if job.get("pair_with"):
        contenders.insert(0, CONTENDERS[job["pair_with"]])
    rows = measure_group(ParamSetSpec.from_json(job["spec"]), contenders, opts, job["copy_bw"])
    print("RESULT " + strict_json.dumps(pair_rows(rows, job["contender"])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
