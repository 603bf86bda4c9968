"""Mutation check: plant each one-line bug of `catalogue.py` in a temporary copy of the repository and run the
test files that must catch it. A mutation the tests do not catch "survives": it needs a test, or a written
reason in the catalogue (`survives=`) why no test can see it.

    python tests/mutations/run.py                      # every mutation, 2 at a time
    python tests/mutations/run.py --only guard-grad-z-ge,loop-loss-read-per-micro-batch --jobs 1
    python tests/mutations/run.py --list
    python tests/mutations/run.py --check              # can every mutation still be planted? (seconds)

Not part of the default test run (it reruns test files once per mutation: minutes). Exit code 0 when every
mutation without a written reason is caught, 1 otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from catalogue import MUTATIONS, Mutation  # noqa: E402


@dataclass
class Outcome:
    id: str
    status: str  # killed (tests failed or crashed) | survived | stale (the line to mutate is gone) | error
    #                   (pytest could not run them: no test selected, a usage or collection error)
    seconds: float
    detail: str = ""


def _repo_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    return [f for f in listed if f and os.path.isfile(os.path.join(REPO, f))]


def _copy_repo(dest: str, files: list[str]) -> None:
    for rel in files:
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(REPO, rel), target)


def _apply(root: str, m: Mutation) -> str | None:
    """Plant the mutation; returns why it cannot be planted (the code changed), or None."""
    path = os.path.join(root, m.file)
    why = stale_reason(m, path)
    if why:
        return why
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace(m.old, m.new))
    return None


def stale_reason(m: Mutation, path: str) -> str | None:
    """Why the mutation cannot be planted in the file at `path` (the code moved on), or None."""
    if not os.path.isfile(path):
        return f"{m.file} not found: the code moved; update the entry in tests/mutations/catalogue.py"
    with open(path) as f:
        count = f.read().count(m.old)
    if count == 0:
        return f"target text not found in {m.file}: the code changed; update the entry's `old` ({m.old[:60]!r}...)"
    if count > 1:
        return f"target text occurs {count} times in {m.file}; make the entry's `old` longer, so it is unique"
    missing = [t for t in m.tests if not os.path.exists(os.path.join(REPO, t.split("::")[0]))]
    if missing:
        return f"test file(s) {', '.join(missing)} not found: update the entry's tests"
    return None


def _pytest(root: str, tests: list[str], timeout: float, select: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    if select:
        cmd += ["-k", select]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def run_one(m: Mutation, files: list[str], timeout: float) -> Outcome:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"mutation-{m.id}-") as root:
        _copy_repo(root, files)
        why = _apply(root, m)
        if why:
            return Outcome(m.id, "stale", 0.0, why)
        try:
            proc = _pytest(root, m.tests, timeout, m.select)
        except subprocess.TimeoutExpired:
            return Outcome(m.id, "killed", time.perf_counter() - start, f"timed out after {timeout:.0f}s")
    took = time.perf_counter() - start
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    summary = tail[-1] if tail else ""
    if proc.returncode == 0:
        return Outcome(m.id, "survived", took, summary)
    if proc.returncode == 1:  # tests ran and failed
        failed = [line for line in tail if line.startswith("FAILED")]
        return Outcome(m.id, "killed", took, (failed[0] if failed else summary)[:200])
    if proc.returncode < 0:  # the test process crashed (e.g. memory corrupted by the mutation): caught too
        return Outcome(m.id, "killed", took, f"the tests crashed (signal {-proc.returncode})")
    return Outcome(m.id, "error", took, f"pytest exit {proc.returncode}: {summary[:200]}")


def baseline(mutations: list[Mutation], files: list[str], timeout: float) -> str | None:
    """The unmutated copy must pass every test file used, or a 'killed' would mean nothing."""
    tests = sorted({t for m in mutations for t in m.tests})
    with tempfile.TemporaryDirectory(prefix="mutation-baseline-") as root:
        _copy_repo(root, files)
        proc = _pytest(root, ["-n", "2", *tests] if _has_xdist() else tests, timeout * 4)
    if proc.returncode != 0:
        return (proc.stdout + proc.stderr)[-3000:]
    return None


def _has_xdist() -> bool:
    try:
        import xdist  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated mutation ids")
    parser.add_argument("--jobs", type=int, default=2, help="mutations run at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutation (default 600)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the test files")
    parser.add_argument("--json", help="also write the outcomes to this file")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument(
        "--check",
        action="store_true",
        help="only check that every mutation can still be planted (seconds; no tests run)",
    )
    args = parser.parse_args(argv)

    chosen = MUTATIONS
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {m.id for m in MUTATIONS}
        if unknown:
            print(f"unknown mutation id(s): {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        chosen = [m for m in MUTATIONS if m.id in wanted]
    if args.list:
        for m in chosen:
            print(f"{m.id:45s} {m.file}: {m.what}")
        return 0
    if args.check:
        stale = [(m, stale_reason(m, os.path.join(REPO, m.file))) for m in chosen]
        stale = [(m, why) for m, why in stale if why]
        for m, why in stale:
            print(f"STALE: {m.id}: {why}")
        print(f"{len(chosen) - len(stale)} of {len(chosen)} mutations can be planted")
        return 1 if stale else 0

    files = _repo_files()
    if not args.no_baseline:
        failure = baseline(chosen, files, args.timeout)
        if failure:
            print("the unmutated test files fail; fix them first:\n" + failure, file=sys.stderr)
            return 2

    outcomes: list[Outcome] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_one, m, files, args.timeout): m for m in chosen}
        for future in concurrent.futures.as_completed(futures):
            outcome = future.result()
            outcomes.append(outcome)
            print(f"{outcome.status:8s} {outcome.seconds:6.1f}s  {outcome.id}  {outcome.detail}", flush=True)

    by_id = {m.id: m for m in chosen}
    outcomes.sort(key=lambda o: [m.id for m in chosen].index(o.id))
    killed = [o for o in outcomes if o.status == "killed"]
    survived = [o for o in outcomes if o.status == "survived"]
    explained = [o for o in survived if by_id[o.id].survives]
    unexplained = [o for o in survived if not by_id[o.id].survives]
    broken = [o for o in outcomes if o.status in ("stale", "error")]
    scored = len(killed) + len(survived)
    print(
        f"\nmutation score: {len(killed)}/{scored} killed"
        f" ({100.0 * len(killed) / max(scored, 1):.0f}%); {len(explained)} survive with a written reason, "
        f"{len(unexplained)} without; {len(broken)} stale or broken"
    )
    for o in explained:
        print(f"  survives (reason): {o.id}: {by_id[o.id].survives}")
    for o in unexplained:
        print(f"  SURVIVES: {o.id}: {by_id[o.id].what}")
    for o in broken:
        print(f"  {o.status.upper()}: {o.id}: {o.detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(o) for o in outcomes], f, indent=1)
    return 0 if not unexplained and not broken else 1


if __name__ == "__main__":
    sys.exit(main())
