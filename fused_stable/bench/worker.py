"""Worker process for one time-boxed benchmark row: `python -m fused_stable.bench.worker '<job json>'`.

The parent (runner._run_isolated) kills it when its time box runs out; on success it prints one `RESULT {json}`
line with the same row dict `runner.measure_group` returns in-process. The set's baseline contender (`pair_with`)
is timed alongside, interleaved, and its median rides along as `paired_baseline_median_s`.
"""

from __future__ import annotations

import sys

import torch

from fused_stable import strict_json

from .contenders import CONTENDERS
from .paramsets import ParamSetSpec
from .runner import Options, measure_group


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m fused_stable.bench.worker '<job json>'", file=sys.stderr)
        return 2
    job = strict_json.loads(argv[0])
    opts = Options(**{k: tuple(v) if isinstance(v, list) else v for k, v in job["opts"].items()})
    if opts.threads:
        torch.set_num_threads(opts.threads)
    contenders = [CONTENDERS[job["contender"]]]
    if job.get("pair_with"):
        contenders.insert(0, CONTENDERS[job["pair_with"]])
    rows = measure_group(ParamSetSpec.from_json(job["spec"]), contenders, opts, job["copy_bw"])
    row = rows[-1]
    if row["status"] == "error":  # compilation is optional (no compiler, unsupported op): a skip, not a failure
        row.update(status="skipped", reason=f"torch.compile failed: {row['reason']}")
    if len(rows) == 2 and rows[0]["status"] == "ok":
        row["paired_baseline_median_s"] = rows[0]["median_s"]
    print("RESULT " + strict_json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
