"""The engine matrix (issue 52 item 3): every rule x engine x state precision either follows its rule or is refused
in one line that says why. No cell may run another rule's update, or skip its rule, in silence.

Engines here: a plain loop, `torch.compile(opt.step)` (dynamo, eager backend), the HF Trainer through
`fused_trainer_optimizers`, Lightning with `FusedStableCallback`, and DDP on 2 gloo ranks (every DDP cell in one
pair of processes). FSDP2 and DeepSpeed ZeRO have their own tests (test_integ_fsdp2_*.py, test_integ_deepspeed*.py),
not yet these cells. How a cell is judged: engine_cells.py's doc (record, then replay the rule's fused optimizer
and its reference from the recorded grads).

The table of docs/integrations.md ("The engine matrix") is `render()` of this module's cells; the test below fails
when they differ, printing the table to paste.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import engine_cells as cells
import pytest
import torch
import torch.multiprocessing as mp

ENGINES = ["plain", "compile", "hf", "lightning", "ddp"]
# a refusal: (rule, engine or "*", precision or "*") -> the words its one line must hold
REFUSED = {
    ("adafactor", "*", "bf16"): "rows \\+ cols values per matrix",
    ("adafactor", "*", "8bit"): "rows \\+ cols values per matrix",
    ("adafactor", "compile", "fp32"): "does not run inside torch.compile",
}
# the identity margin: a cell's update is this many times nearer to its rule's reference than to any other rule's
MARGIN = 10.0
DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def refusal(rule: str, engine: str, precision: str) -> str | None:
    for key in ((rule, engine, precision), (rule, "*", precision), (rule, engine, "*")):
        if key in REFUSED:
            return REFUSED[key]
    return None


CELLS = [(r, e, p) for r in cells.RULES for e in ENGINES for p in cells.PRECISIONS]


@pytest.fixture(scope="module")
def ddp_records(tmp_path_factory) -> Path:
    """Every DDP cell, run once on 2 gloo ranks (one spawn), rank 0's records by cell; under pytest-xdist the
    workers share the one run (a lock in their common temporary folder)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    # a worker's base is <session>/popen-gwN: the session's folder is the one the workers share
    out = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "engine-matrix-ddp"
    with FileLock(str(out) + ".lock"):
        if not (out / "done").exists():
            out.mkdir(exist_ok=True)
            args = (2, str(out / "store"), str(out))
            mp.start_processes(cells.ddp_rank, args=args, nprocs=2, start_method="spawn")
            (out / "done").touch()
    return out


def run(rule: str, engine: str, precision: str, tmp_path: Path, ddp_records: Path | None) -> dict:
    """The cell's record, or {"refused": its line}."""
    if engine == "ddp":
        return torch.load(ddp_records / f"{rule}-{precision}.pt", weights_only=False)
    try:
        if engine in ("plain", "compile"):
            return cells.run_plain(rule, precision, compiled=engine == "compile")
        if engine == "hf":
            return cells.run_hf(rule, precision, str(tmp_path))
        return cells.run_lightning(rule, precision, str(tmp_path))
    except (ValueError, NotImplementedError) as exc:
        return {"refused": str(exc)}
    except Exception as exc:  # torch.compile wraps what the step raised (a refusal there is a RuntimeError)
        cause = exc.__cause__ or exc.__context__
        if engine == "compile" and isinstance(cause, (ValueError, NotImplementedError, RuntimeError)):
            return {"refused": str(cause).split("\n\nfrom user code:")[0]}  # dynamo appends where it was raised
        raise


def assert_follows_its_rule(rule: str, precision: str, record: dict) -> None:
    """The engine's params are the plain-loop replay of the rule's fused optimizer bit for bit, and that update is
    its rule's: nearer to its reference than to any other rule's by MARGIN; in fp32 within 4x the floor."""
    order = record["order"]
    fused = cells.replay(record, lambda net: [cells.fused(rule, precision, net, order, backend="torch")])
    for name, value in record["last"].items():
        assert torch.equal(value, fused[name]), f"{name}: the engine's step is not its rule's ({rule}, {precision})"
    first = record["first"]

    def reference(rule_name: str, grads: dict = record) -> dict:
        return cells.replay(grads, lambda net: cells.references(rule_name, net))

    own = reference(rule)
    near = cells.distance(fused, own, first)
    others = {other: cells.distance(fused, reference(other), first) for other in cells.RULES if other != rule}
    nearest = min(others, key=others.get)
    assert near * MARGIN < others[nearest], f"{rule} {precision}: {near:.3g} from its reference, {others}"
    if precision == "fp32":
        floor = cells.distance(reference(rule, cells.moved(record, 1)), own, first)
        assert near <= 4 * floor + 1e-7, f"{rule}: {near:.3g} from torch's, floor {floor:.3g}"


@pytest.mark.parametrize("rule, engine, precision", CELLS, ids=["-".join(c) for c in CELLS])
def test_a_cell_follows_its_rule_or_refuses_in_one_line(rule, engine, precision, tmp_path, request):
    ddp = request.getfixturevalue("ddp_records") if engine == "ddp" else None
    result = run(rule, engine, precision, tmp_path, ddp)
    words = refusal(rule, engine, precision)
    if words is not None:
        assert "refused" in result, f"{rule} x {engine} x {precision} ran; the matrix says it is refused ({words})"
        line = result["refused"]
        assert "\n" not in line.strip() and re.search(words, line), line
        return
    assert "refused" not in result, f"{rule} x {engine} x {precision} refused: {result.get('refused')}"
    assert len(result["grads"]) == cells.STEPS, f"{len(result['grads'])} optimizer steps, not {cells.STEPS}"
    assert_follows_its_rule(rule, precision, result)


def render() -> str:
    """The docs table: one row per rule and engine, a column per precision (ok: tested against its rule; refused:
    the words of its one line)."""
    lines = ["| rule | engine | " + " | ".join(cells.PRECISIONS) + " |", "|---|---|" + "---|" * len(cells.PRECISIONS)]
    for rule in cells.RULES:
        for engine in ENGINES:
            marks = []
            for precision in cells.PRECISIONS:
                words = refusal(rule, engine, precision)
                marks.append("ok" if words is None else "refused: " + words.replace("\\", ""))
            lines.append(f"| {rule} | {engine} | " + " | ".join(marks) + " |")
    return "\n".join(lines)


def test_the_docs_table_is_the_matrix():
    table = render()
    assert table in DOCS.read_text(), f"docs/integrations.md's engine matrix differs from the cells; paste:\n{table}"
